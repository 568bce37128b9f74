"""`linear`: y = x . w^T in a precision format, differentiable through one of three backward modes."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jaxrl_fp8.ops import backends, block_scaled, operands as O
from jaxrl_fp8.ops.high_precision import high_precision_dot
from jaxrl_fp8.precision import formats as F

F32 = jnp.float32
BF16 = jnp.bfloat16


def linear(x, w, *, fmt: str = "bf16", backward: str = "high_precision", backend: str | None = None, out_dtype=None):
    """y[..., N] = x[..., K] . w[N, K]^T with float32 accumulation.

    fmt: "bf16" | "fp8-block" (x 1x128, w 128x128, per-K-block promotion) | "mxfp8" | "nvfp4" (emulated).
    w: master weight [N, K] (quantized on the fly) or a precision.QuantizedWeight of the same fmt.
    backward: "high_precision" | "dequantized" | "fp8" (see docs/decisions/0002-gemm-tiling.md).
    backend: None (auto), "xla", "mosaic", "interpret" (applies to the fp8-block GEMMs).
    """
    O.check_args(fmt, backward, "ops.linear")
    backends.check_backend(backend)
    x = jnp.asarray(x)
    if x.ndim < 1:
        raise ValueError("ops.linear: x must have a trailing K axis")
    k = x.shape[-1]
    n = O.check_weight(w, fmt, k, 2, "ops.linear")[0]
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.shape[0] == 0:
        return jnp.zeros((*lead, n), out_dtype)
    y = _linear(x2, w, fmt, backward, backend, out_dtype)
    return y.reshape(*lead, n)


def _weight_nk(w) -> tuple[int, int]:
    return tuple((w.shape if hasattr(w, "shape") else jnp.shape(w))[-2:])


_GEMM_OUT_DTYPES = (jnp.dtype(BF16), jnp.dtype(jnp.float16), jnp.dtype(F32))


def _forward(x, w, fmt, backend, out_dtype=F32):
    """Returns (y [M, N], the quantized operands the backward may reuse).

    y is float32 except for fp8-block, whose GEMM writes `out_dtype` directly: the same bits as float32 then
    a round-to-nearest-even cast (the kernel's epilogue and XLA's convert are both RNE), without the float32
    [M, N] round trip through HBM."""
    n, k = _weight_nk(w)
    if fmt == F.BF16:  # BF16 operands, float32 accumulation: the XLA dot, or the row-invariant kernel form
        return high_precision_dot(x.astype(BF16), jnp.asarray(w).astype(BF16)), None
    if fmt == F.FP8_BLOCK:
        be = backends.resolve(backend, fmt, n, k)
        xa = O.fp8_act_gemm(x, be)
        wq, sb = O.fp8_weight(w, be)
        gemm_out = out_dtype if jnp.dtype(out_dtype) in _GEMM_OUT_DTYPES else F32
        y = block_scaled.block_scaled_matmul(xa.q, xa.scale, wq, sb, backend=be, out_dtype=gemm_out,
                                             b_scale_op=O.weight_scale_operand(w), a_scale_op=xa.scale_op)
        return y, (xa, wq, sb)  # scales in the contract's layout only if a backward asks (`FP8Act.scales`)
    xd, wd = O.emulated_operands(x, w, fmt)
    return high_precision_dot(xd, wd), (xd, wd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def _linear(x, w, fmt, backward, backend, out_dtype):
    return _forward(x, w, fmt, backend, out_dtype)[0].astype(out_dtype)


def _linear_fwd(x, w, fmt, backward, backend, out_dtype):
    y, fwd_ops = _forward(x, w, fmt, backend, out_dtype)
    keep = fwd_ops if (backward == "dequantized" or (backward == "fp8" and fmt == F.FP8_BLOCK)) else None
    return y.astype(out_dtype), (x, w, keep)


def fp8_backward(g, x, wq_t, sb_t, backend, dx_dtype=F32, sb_t_op=None):
    """dgrad and wgrad in FP8: each GEMM's operands quantized 1x128 along its contraction axis.

    dgrad dx[M, K] = g[M, N] . W[N, K]: g grouped along N; W^T (wq_t [K, N], sb_t) is the forward 128x128 blocks
    transposed (`operands.fp8_dgrad_weight`). wgrad dw[N, K] = g^T . x: both quantized along M (rows padded with
    zeros to 128). sb_t_op: sb_t in the kernel's layout, made once (`operands.weight_scale_operand`), or None.
    """
    m, n = g.shape
    k = x.shape[1]
    be = backends.resolve(backend, F.FP8_BLOCK, k, n)
    ga = O.fp8_act_gemm(g, be)
    dx = block_scaled.block_scaled_matmul(ga.q, ga.scale, wq_t, sb_t, backend=be, out_dtype=dx_dtype, b_scale_op=sb_t_op,
                                          a_scale_op=ga.scale_op)
    mp = -(-m // 128) * 128  # wgrad contracts over M, zero-padded to whole 128-row groups
    be = backends.resolve(backend, F.FP8_BLOCK, k, mp)
    gtq, sgt = O.fp8_act_transposed(g, be)  # == fp8_act(pad_rows(g, 128).T), without the transposed copy
    xtq, sxt = O.fp8_act_transposed(x, be)
    dw = block_scaled.block_scaled_matmul(gtq, sgt, xtq, sxt, b_rows_per_scale=1, backend=be)
    return dx, dw


def _linear_bwd(fmt, backward, backend, out_dtype, res, g):
    x, w, kept = res
    if backward == "fp8":
        wq, sb = (kept[1], kept[2]) if kept is not None else O.fp8_weight(w, backends.resolve(backend, F.FP8_BLOCK, *_weight_nk(w)))
        dx, dw = fp8_backward(g, x, *O.fp8_dgrad_weight(w, wq, sb), backend, dx_dtype=x.dtype,
                              sb_t_op=O.weight_scale_operand(w, transposed=True))
    else:
        a, b = O.backward_operands(backward, fmt, x, w, kept)
        gb = g.astype(BF16)
        dx = lax.dot_general(gb, b.astype(BF16), (((1,), (0,)), ((), ())), preferred_element_type=F32)
        dw = lax.dot_general(gb, a.astype(BF16), (((0,), (0,)), ((), ())), preferred_element_type=F32)
    return dx.astype(x.dtype), O.master_cotangent(w, dw)


_linear.defvjp(_linear_fwd, _linear_bwd)
