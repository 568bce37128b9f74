"""Per-token log-probs and entropies of the trainer's loss, with a closed-form backward, and the head applied in
chunks of positions.

The trainer's loss needs log_softmax(logits / T)[token] and the entropy at every position. `token_stats` computes
them with the rollout's own functions (`token_logprobs`: the row-invariant pairwise sum the decode step uses, so the
trainer's log-probs keep the rollout's bits) and differentiates them in closed form: d/dz of log p[token] is
onehot - p, of the entropy -p (log p + H). Autodiff of the same forward would differentiate the pairwise tree (a
tree of pads and adds over the vocabulary padded to 2^18), scatter a one-hot and, under remat, rebuild the tree:
on the H200 that was ~11 ms of elementwise work per 2,048 positions at Qwen3's V = 151936 (step_profile, the
accumulated update). The backward needs no row invariance (it enters no rollout / trainer comparison).

Computed at once the stats hold [B, T, V] float32 logits and what softmax and its gradient make of them: ~24 B x V a
token, 3.6 MB at V = 151936, most of an update's activation memory. `chunked_token_stats` runs the head and the
stats over `chunk` positions at a time inside a `lax.map`, each chunk rematerialised in the backward
(`jax.checkpoint`), so one chunk's logits are live at a time. Every position goes through the same ops as at once,
so the values are the unchunked ones, bit for bit where the head's product is row invariant (the GPU kernels;
XLA:CPU on most hosts). `chunk` is an upper bound: the positions are split into as few chunks as it allows, of equal
size (`balanced_chunk`), so padding costs fewer positions than there are chunks instead of up to a whole chunk (a
4-row micro-batch of 1,279 positions a row takes 3 chunks of 1,706, where chunks of 2,048 would pad 5,116 positions
to 6,144 and spend a sixth of the head's products and vocabulary passes on zeros).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_fp8.model import numerics
from jaxrl_fp8.model.matmul import head_logits
from jaxrl_fp8.rl.losses import entropy_from_log_softmax
from jaxrl_fp8.rollout.sampling import effective_temperature, tempered_logits

F32 = jnp.float32


def token_stats(logits: jax.Array, targets: jax.Array, temperature, with_entropy: bool = True):
    """(log-probs, entropies or None), float32 `[...]`, of `targets` `[...]` under `logits` `[..., V]` at
    `temperature` (a scalar or `[...]`; 0 = greedy, measured at 1): `token_logprobs` and `entropy_from_logits` of the
    tempered logits, bit for bit, differentiable in `logits` only (closed-form backward, see module doc).

    A Python / NumPy scalar temperature (the trainer's) stays static through the custom_vjp: traced, it would become
    a divisor `ieee_div` cannot skip at T = 1, materialised at the logits' shape (a [1706, 151936] float32 tensor of
    ones, written once and re-read by a divide kernel in every chunk's forward and backward)."""
    static = effective_temperature(temperature)  # a Python float exactly when the temperature is static
    if isinstance(static, float):
        return _token_stats(bool(with_entropy), static, logits, targets, None)
    return _token_stats(bool(with_entropy), None, logits, targets, temperature)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _token_stats(with_entropy, static_temperature, logits, targets, temperature):
    return _token_stats_fwd(with_entropy, static_temperature, logits, targets, temperature)[0]


def _temperature(static_temperature, temperature):
    return temperature if static_temperature is None else static_temperature


def _token_stats_fwd(with_entropy, static_temperature, logits, targets, temperature):
    # one log-softmax for both (the ops of token_logprobs and entropy_from_logits, so their bits): three vocabulary
    # passes (max, the pairwise normaliser, the entropy's sum). The residuals are the logits alone: under the chunk's
    # remat the backward then rebuilds only the head's product, none of these passes.
    logp_all = numerics.log_softmax(tempered_logits(logits, _temperature(static_temperature, temperature)))
    logp = numerics.pick_logprobs(logp_all, targets)
    ent = entropy_from_log_softmax(logp_all) if with_entropy else None
    return (logp, ent), (logits, targets, temperature)


def _backward_log_softmax():
    """The log-softmax of the backward. On CPU the row-invariant one (`numerics`: XLA:CPU's reductions change bits
    with the batch shape, and a micro-batched gradient should equal the whole minibatch's up to float32 order, not
    up to BF16 roundings flipped downstream). Elsewhere XLA's own (one pass; the GPU's pairwise tree costs ~4x as
    much at V = 151936): the backward needs no row invariance."""
    return numerics.log_softmax if jax.default_backend() == "cpu" else functools.partial(jax.nn.log_softmax, axis=-1)


def _token_stats_bwd(with_entropy, static_temperature, res, cts):
    logits, targets, temperature = res
    g_logp, g_ent = cts
    temperature = _temperature(static_temperature, temperature)
    z = tempered_logits(logits, temperature)
    logp_all = _backward_log_softmax()(z)
    p = jnp.exp(logp_all)
    # d/dlogits = d/dz / T: the 1/T folds into the per-position coefficients (no divide over the vocabulary; the
    # backward keeps no bits, so the order of the scaling is free), and at a static T = 1 it is no op at all
    t = effective_temperature(temperature)
    if not (isinstance(t, float) and t == 1.0):
        g_logp = g_logp * (1.0 / t)
        g_ent = g_ent * (1.0 / t) if with_entropy else None
    onehot = jnp.arange(z.shape[-1], dtype=jnp.int32) == jnp.asarray(targets, jnp.int32)[..., None]
    dlogits = g_logp[..., None] * (onehot.astype(F32) - p)
    if with_entropy:  # the entropy of this backward's own p (a coefficient: no bits to keep)
        ent = entropy_from_log_softmax(logp_all)
        dlogits = dlogits - g_ent[..., None] * p * (logp_all + ent[..., None])
    return dlogits.astype(logits.dtype), None, None


_token_stats.defvjp(_token_stats_fwd, _token_stats_bwd)


def balanced_chunk(n: int, chunk: int) -> int:
    """Positions per chunk for `n` positions in chunks of at most `chunk`: as few chunks as `chunk` allows, of equal
    size (the last one padded by fewer positions than there are chunks)."""
    if n < 1 or chunk < 1:
        raise ValueError(f"positions ({n}) and chunk ({chunk}) must be >= 1")
    chunks = -(-n // chunk)
    return -(-n // chunks)


def chunked_token_stats(hidden: jax.Array, head: jax.Array, targets: jax.Array, temperature, chunk: int, *,
                        with_entropy: bool = True):
    """(log-probs, entropies), float32 `[B, T]`, of `targets` [B, T] under logits = hidden [B, T, H] . head [V, H]^T
    at temperature `temperature`, at most `chunk` positions at a time (`balanced_chunk`; the last chunk zero-padded);
    entropies None without `with_entropy` (the old-log-prob pass)."""
    b, t, h = hidden.shape
    if targets.shape != (b, t):
        raise ValueError(f"targets {targets.shape} must be [B, T] = {(b, t)} like hidden's leading axes")
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    n = b * t
    chunk = balanced_chunk(n, chunk) if n else chunk
    chunks = -(-n // chunk)
    pad = chunks * chunk - n
    flat_h = jnp.pad(hidden.reshape(n, h), ((0, pad), (0, 0)))
    flat_t = jnp.pad(targets.reshape(n).astype(jnp.int32), (0, pad))
    # the map closes over a float32 copy for the gradient: the chunks' head gradients then add up in float32 and are
    # rounded to the head's dtype once (as the unchunked product's accumulation is); each chunk multiplies the head
    # as given (its compute dtype), so the forward bits do not change and nothing is cast per chunk
    head_f32 = head.astype(F32)

    @jax.checkpoint
    def one(args):
        hc, tc = args
        logits = head_logits(hc, head_f32, head.dtype, w_compute=head)
        logp, ent = token_stats(logits, tc, temperature, with_entropy)
        return (logp, ent) if with_entropy else (logp,)

    out = jax.lax.map(one, (flat_h.reshape(chunks, chunk, h), flat_t.reshape(chunks, chunk)))
    unflat = lambda x: x.reshape(-1)[:n].reshape(b, t)  # noqa: E731
    return unflat(out[0]), (unflat(out[1]) if with_entropy else None)
