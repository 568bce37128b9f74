"""Per-token log-probs and entropies from the model's final hidden states, the head applied in chunks of positions.

The trainer's loss needs log_softmax(logits / T)[token] and the entropy at every position. Computed at once they
hold [B, T, V] float32 logits and what log-softmax, softmax and their gradients make of them: ~24 B x V a token,
3.6 MB at Qwen3's V = 151936, most of an update's activation memory. Here the head, the log-softmax and the
entropy run over `chunk` positions at a time inside a `lax.map`, each chunk rematerialised in the backward
(`jax.checkpoint`), so one chunk's logits are live at a time. Every position goes through the same ops as in
`token_logprobs` / `entropy_from_logits` (row-invariant head product and reductions), so the values are the
unchunked ones, bit for bit where the head's product is row invariant (the GPU kernels; XLA:CPU on most hosts).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_fp8.model.matmul import high_precision_linear
from jaxrl_fp8.rl.losses import entropy_from_logits
from jaxrl_fp8.rollout.sampling import tempered_logits, token_logprobs

F32 = jnp.float32


def chunked_token_stats(hidden: jax.Array, head: jax.Array, targets: jax.Array, temperature, chunk: int, *,
                        with_entropy: bool = True):
    """(log-probs, entropies), float32 `[B, T]`, of `targets` [B, T] under logits = hidden [B, T, H] . head [V, H]^T
    at temperature `temperature`, `chunk` positions at a time (the last chunk zero-padded); entropies None without
    `with_entropy` (the old-log-prob pass)."""
    b, t, h = hidden.shape
    if targets.shape != (b, t):
        raise ValueError(f"targets {targets.shape} must be [B, T] = {(b, t)} like hidden's leading axes")
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    n = b * t
    chunks = -(-n // chunk)
    pad = chunks * chunk - n
    flat_h = jnp.pad(hidden.reshape(n, h), ((0, pad), (0, 0)))
    flat_t = jnp.pad(targets.reshape(n).astype(jnp.int32), (0, pad))
    # the map closes over a float32 copy: the chunks' head gradients then add up in float32 and are rounded to the
    # head's dtype once (as the unchunked product's accumulation is); each chunk multiplies the head in its own
    # dtype (an exact round trip), so the forward bits do not change
    head_dtype, head_f32 = head.dtype, head.astype(F32)

    @jax.checkpoint
    def one(args):
        hc, tc = args
        logits = high_precision_linear(hc, head_f32.astype(head_dtype), F32)
        logp = token_logprobs(logits, tc, temperature)
        return (logp, entropy_from_logits(tempered_logits(logits, temperature))) if with_entropy else (logp,)

    out = jax.lax.map(one, (flat_h.reshape(chunks, chunk, h), flat_t.reshape(chunks, chunk)))
    unflat = lambda x: x.reshape(-1)[:n].reshape(b, t)  # noqa: E731
    return unflat(out[0]), (unflat(out[1]) if with_entropy else None)
