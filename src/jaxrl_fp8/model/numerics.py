"""Row-invariant reductions: a token's result must not depend on how many other tokens share the batch.

Why: the rollout engine decodes one token per row while the trainer recomputes whole sequences, and RL
wants both to produce the same log-probabilities bit for bit. XLA:CPU picks its reduction and dot strategy
from the whole shape (measured on jax 0.11.2: a row sum over 2048 values of a one-row array differs from
the same row inside a 40-row array), so the few reductions on that path are written as a fixed sequence of
elementwise operations, which XLA compiles identically for every row:

- `row_sum`: a pairwise tree. The axis is zero-padded to a power of two and halved repeatedly
  (x[:n/2] + x[n/2:]). Padding with zeros is exact, so the result is also independent of how far the axis
  was padded. A long tree runs as several kernels (optimization barriers between levels), which stores partial
  sums but changes no add.
- maxima are exact in any order, so `jnp.max` is used as is.
- `rounded_product`: XLA:CPU contracts a*b+c into one FMA when the multiply and the add land in the same
  fusion, and fusion depends on the surrounding graph (a decode step and a full forward are different
  graphs). Products that feed an add are therefore materialized behind `lax.optimization_barrier`, so they
  are rounded on every path.
- `lanewise`: XLA:CPU computes exp/log/sin/cos/logistic with one code sequence in its vectorized loop body
  and another in the scalar remainder loop (measured: `jnp.exp` of a 7-element array differs in 5 elements
  from the same values inside a 119-element array). Transcendentals therefore run on a flat copy padded to
  whole 64-lane rows, fenced by optimization barriers so the padded loop is not fused back into an
  arbitrary shape. Only on CPU; on accelerators it is the plain function.
- 1/sqrt is computed as an IEEE division of an IEEE square root (both correctly rounded everywhere).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jaxrl_fp8.precision.arith import ieee_div

F32 = jnp.float32

__all__ = ["row_sum", "strided_partial_sums", "rounded_product", "lanewise", "exp", "silu", "rms_norm", "log_softmax",
           "log_normalized", "softmax"]

LANES = 64


def lanewise(fn, x: jax.Array) -> jax.Array:
    """fn(x) for an elementwise fn, computed so every element takes the same (vectorized) code path."""
    if jax.default_backend() != "cpu" or x.size == 0:
        return fn(x)
    flat = x.reshape(-1)
    pad = (-flat.size) % LANES
    rows = jnp.pad(flat, (0, pad)).reshape(-1, LANES)
    y = lax.optimization_barrier(fn(lax.optimization_barrier(rows)))
    return y.reshape(-1)[: flat.size].reshape(x.shape)


def exp(x: jax.Array) -> jax.Array:
    return lanewise(jnp.exp, x)


def silu(x: jax.Array) -> jax.Array:
    """x * sigmoid(x), as HF's SiLU, with a row-invariant sigmoid."""
    return x * lanewise(jax.nn.sigmoid, x)


def rounded_product(a: jax.Array, b) -> jax.Array:
    """a * b, rounded before any later add can fuse with it (no FMA contraction; see module doc)."""
    return lax.optimization_barrier(a * b)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def row_sum(x: jax.Array, axis: int = -1, keepdims: bool = False) -> jax.Array:
    """Sum over `axis` as a fixed pairwise tree of elementwise adds (row invariant, see module doc).

    Differentiated in closed form: the cotangent of a sum is the output's cotangent broadcast over the axis. These
    are the values autodiff of the tree gives (each level's slices transpose to zero pads whose add_any places every
    cotangent once), without two pads and an add per level in the backward: under every RMSNorm of the trainer's
    backward (H = 2048: 11 levels) that was 33 ops writing ~4 H values a token where one broadcast fuses into its
    consumer."""
    axis = axis % x.ndim
    return _row_sum(x, axis, keepdims, x.shape[axis])


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _row_sum(x: jax.Array, axis: int, keepdims: bool, length: int) -> jax.Array:
    return _pairwise_tree(x, axis, keepdims)


def _row_sum_fwd(x, axis, keepdims, length):
    return _pairwise_tree(x, axis, keepdims), None


def _row_sum_bwd(axis, keepdims, length, _, g):
    g = g if keepdims else jnp.expand_dims(g, axis)
    return (jnp.broadcast_to(g, g.shape[:axis] + (length,) + g.shape[axis + 1:]),)


_row_sum.defvjp(_row_sum_fwd, _row_sum_bwd)


# Long trees (the vocabulary's: 2^18 at V = 151936) are cut into kernels: the first after FIRST_LEVELS levels, then
# every LEVELS_PER_KERNEL. Left alone, XLA:GPU fuses the first ten levels with the exp before them into one kernel
# whose threads each add 1,024 leaves, too few threads to pull the bandwidth. The cuts change no add (only where
# the partial sums are stored), so no bit: measured equal on an H100, where log-softmax + pick over [rows, 151936]
# took 0.035 / 0.126 / 0.724 ms against 0.039 / 0.162 / 1.022 ms at 64 / 256 / 1706 rows (vocab_side.py
# --parts logprob, results/vocab_side_h100.json).
SPLIT_FROM = 1 << 14
FIRST_LEVELS = 7
LEVELS_PER_KERNEL = 6


def _pairwise_tree(x: jax.Array, axis: int, keepdims: bool) -> jax.Array:
    x = _padded_pow2(jnp.moveaxis(x, axis, -1))
    out = _tree_levels(x, 0, None)[..., 0]
    return jnp.expand_dims(out, axis) if keepdims else out


def _padded_pow2(x: jax.Array) -> jax.Array:
    n = x.shape[-1]
    p = _next_pow2(n)
    return x if p == n else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, p - n)])


def _tree_levels(x: jax.Array, level: int, stop: int | None) -> jax.Array:
    """x [..., 2^k] after the tree's levels `level` + 1 ... `stop` (None: down to one value): each x[:h] + x[h:],
    with the kernel cuts of a long tree (its length at level 0, `_tree_split`) after the levels that end one."""
    split = _tree_split(x.shape[-1] << level)
    while x.shape[-1] > 1 and (stop is None or level < stop):
        h = x.shape[-1] // 2
        x = x[..., :h] + x[..., h:]
        level += 1
        if split and h > 1 and level >= FIRST_LEVELS and (level - FIRST_LEVELS) % LEVELS_PER_KERNEL == 0:
            x = lax.optimization_barrier(x)
    return x


def _tree_split(padded_length: int) -> bool:
    return padded_length >= SPLIT_FROM


def strided_partial_sums(x: jax.Array, levels: int = FIRST_LEVELS) -> tuple[jax.Array, jax.Array]:
    """(`row_sum(x)` with its bits, the tree's partial sums after `levels` levels) over the last axis.

    The partials are float [..., C], C = 2^ceil(log2 n) / 2^levels (levels capped at ceil(log2 n)): partial j is
    the tree's sum of x[..., j + C t] over t (the zero padding included). One tree gives both, so the sampler gets a
    row's total and the mass of its strided chunks from one pass over the vocabulary. At the default, a long tree's
    partials are exactly what its first kernel stores."""
    x = _padded_pow2(x)
    head = _tree_levels(x, 0, min(levels, x.shape[-1].bit_length() - 1))
    return _tree_levels(head, x.shape[-1].bit_length() - 1 - (head.shape[-1].bit_length() - 1), None)[..., 0], head


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """HF Qwen3 RMSNorm: normalize in float32, cast back to x's dtype, then multiply by the scale."""
    xf = x.astype(F32)
    # An explicit multiply by 1/H (XLA would rewrite a division by a constant into this anyway). For a power-of-two
    # H (Qwen3's 2048 and head_dim 128) the product is exact (or, below float32's normal range, absorbed by + eps
    # either way), so a multiply-add contracted into one FMA rounds as the separate multiply and add: no barrier,
    # which saves a GPU kernel per norm (four per layer).
    total, h = row_sum(xf * xf, keepdims=True), x.shape[-1]
    var = total * F32(1.0 / h) if h & (h - 1) == 0 else rounded_product(total, F32(1.0 / h))
    inv = ieee_div(F32(1.0), jnp.sqrt(var + F32(eps)))
    y = (xf * inv).astype(x.dtype)
    return scale.astype(x.dtype) * y


def log_softmax(logits: jax.Array) -> jax.Array:
    """float32 log-softmax over the last axis with the row-invariant sum."""
    z = logits.astype(F32)
    m = lax.stop_gradient(jnp.max(z, axis=-1, keepdims=True))
    shifted = z - m
    return log_normalized(shifted, row_sum(exp(shifted), keepdims=True))


def log_normalized(shifted: jax.Array, total: jax.Array) -> jax.Array:
    """shifted - log(total): the last step of `log_softmax` (shifted = z - max z, total = the row sum of
    exp(shifted), [..., 1]); the sampler, which sums the tree itself (`strided_partial_sums`), ends with it too, so
    both give the same bits."""
    return shifted - lanewise(jnp.log, total)


def pick_logprobs(logp: jax.Array, tokens: jax.Array) -> jax.Array:
    """`logp[..., token]`: each token's log-prob from a full log-softmax `[..., V]` (an exact gather)."""
    return jnp.take_along_axis(logp, tokens[..., None].astype(jnp.int32), axis=-1)[..., 0]


def softmax(logits: jax.Array) -> jax.Array:
    """float32 softmax over the last axis with the row-invariant sum."""
    z = logits.astype(F32)
    e = exp(z - lax.stop_gradient(jnp.max(z, axis=-1, keepdims=True)))
    return ieee_div(e, row_sum(e, keepdims=True))
