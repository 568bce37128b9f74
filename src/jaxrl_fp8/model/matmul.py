"""The model's only entry to matrix products: `jaxrl_fp8.ops` for every format of the contract.

`fmt=None` means "no precision policy": compute in the parameters' own dtype. For bfloat16 parameters that
is `ops.linear(fmt="bf16")` itself; for float32 parameters (the fp32 parity tests against transformers) the
row-invariant float32 dot of ops' XLA path is used, because ops' "bf16" format casts operands to bfloat16.
A weight kept quantized (`QuantizedWeight`) that meets another format is dequantized first.
Router and lm_head are high precision by contract: float32 accumulation, never quantized.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jaxrl_fp8 import ops
from jaxrl_fp8.ops.grouped import fp8_input
from jaxrl_fp8.ops.grouping import grouped_dot
from jaxrl_fp8.ops.high_precision import high_precision_dot
from jaxrl_fp8.precision import QuantizedWeight

F32 = jnp.float32

__all__ = ["linear", "grouped_linear", "grouped_fp8_input", "high_precision_linear", "head_logits", "weight_dtype"]


def weight_dtype(w) -> jnp.dtype:
    return jnp.dtype(F32) if isinstance(w, QuantizedWeight) else jnp.dtype(w.dtype)


def _as_dense(w, dtype):
    return w.dequantize(dtype) if isinstance(w, QuantizedWeight) else w


def linear(x: jax.Array, w, fmt: str | None, backward: str = "high_precision", out_dtype=None) -> jax.Array:
    """x [..., K] . w[N, K]^T in format `fmt` (None: the parameters' dtype)."""
    out_dtype = out_dtype or x.dtype
    if isinstance(w, QuantizedWeight) and w.fmt != fmt:
        w = _as_dense(w, x.dtype)
    if fmt is None:
        if x.dtype == F32 or w.dtype == F32:
            return high_precision_linear(x.astype(F32), w.astype(F32), out_dtype)
        fmt = "bf16"
    return ops.linear(x, w, fmt=fmt, backward=backward, out_dtype=out_dtype)


def grouped_linear(x: jax.Array, w, group_sizes: jax.Array, fmt: str | None, backward: str = "high_precision", out_dtype=None,
                   x_fp8=None):
    """Expert GEMM on rows sorted by expert: x [M, K], w [E, N, K]. x_fp8: x's FP8 operands when fmt is fp8-block
    (`ops.grouped_linear`; ignored otherwise)."""
    out_dtype = out_dtype or x.dtype
    if isinstance(w, QuantizedWeight) and w.fmt != fmt:
        w = _as_dense(w, x.dtype)
    if fmt is None:
        if x.dtype == F32 or w.dtype == F32:
            return grouped_dot(x.astype(F32), w.astype(F32), group_sizes, out_dtype=out_dtype, compute_dtype=F32)
        fmt = "bf16"
    return ops.grouped_linear(x, w, group_sizes, fmt=fmt, backward=backward, out_dtype=out_dtype, x_fp8=x_fp8)


def grouped_fp8_input(x: jax.Array, w):
    """x's 1x128 FP8 operands as `grouped_linear(x, w, "fp8-block")` makes them (`ops.grouped.fp8_input`)."""
    return fp8_input(x, w)


def high_precision_linear(x: jax.Array, w: jax.Array, out_dtype=F32) -> jax.Array:
    """Row-invariant x . w^T with float32 accumulation in the operands' dtype (router, lm_head); the form
    (XLA dot or the split-BF16 kernel) is `ops.high_precision`'s."""
    lead = x.shape[:-1]
    y = high_precision_dot(x.reshape(-1, x.shape[-1]), w)
    return y.reshape(*lead, w.shape[0]).astype(out_dtype)


def head_logits(x: jax.Array, w: jax.Array, compute_dtype, w_compute: jax.Array | None = None) -> jax.Array:
    """float32 logits x [..., H] . w [V, H]^T: forward `high_precision_linear` of x and w in `compute_dtype` (the
    rollout's bits); backward in `compute_dtype` like every layer's: the logits' cotangent rounded to it once, one
    product per gradient, float32 accumulation (decision record 0004). `w` may be a float32 copy of
    compute-dtype values (an exact round trip): its gradient then comes back float32, so a chunked loss adds its
    chunks' head gradients in float32. `w_compute`: `w` already in `compute_dtype`, for a caller that multiplies one
    head many times (the chunked loss: a cast per chunk was a [V, H] pass each, 14 ms of a 302 ms update on the H100);
    the gradient still goes to `w`."""
    compute_dtype = jnp.dtype(compute_dtype)
    wc = w.astype(compute_dtype) if w_compute is None else w_compute
    if wc.dtype != compute_dtype or wc.shape != w.shape:
        raise ValueError(f"head_logits: w_compute {wc.dtype}{list(wc.shape)} must be w {list(w.shape)} in {compute_dtype}")
    lead = x.shape[:-1]
    y = _head_logits(jnp.dtype(w.dtype), x.reshape(-1, x.shape[-1]), w, lax.stop_gradient(wc))
    return y.reshape(*lead, w.shape[0])


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _head_logits(w_dtype, x, w, wc):
    del w  # differentiated through the backward only: the product reads its compute-dtype copy
    return high_precision_dot(x.astype(wc.dtype), wc).astype(F32)


def _head_logits_fwd(w_dtype, x, w, wc):
    return _head_logits(w_dtype, x, w, wc), (x, wc)


def _head_logits_bwd(w_dtype, res, g):
    x, wc = res
    g = g.astype(wc.dtype)

    def dot(a, b, contract):
        return lax.dot_general(a, b.astype(wc.dtype), ((contract, (0,)), ((), ())), preferred_element_type=F32)

    return dot(g, wc, (1,)).astype(x.dtype), dot(g, x, (0,)).astype(w_dtype), None


_head_logits.defvjp(_head_logits_fwd, _head_logits_bwd)
