"""`grouped_linear`: the MoE expert GEMM on expert-sorted rows, differentiable like `linear`."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxrl_fp8.ops import backends, block_scaled, grouping, operands as O
from jaxrl_fp8.precision import formats as F

F32 = jnp.float32
BF16 = jnp.bfloat16


def grouped_linear(x, w, group_sizes, *, fmt: str = "bf16", backward: str = "high_precision", backend: str | None = None,
                   out_dtype=None, x_fp8=None):
    """y[r] = x[r] . w[g(r)]^T for rows sorted by expert: x [M, K], w [E, N, K], group_sizes int [E].

    Rows past sum(group_sizes) are padding and get 0; empty groups are allowed. Only the rows of each
    expert are multiplied by that expert (never all experts on all rows). Formats and backward modes as in
    `ops.linear`.
    x_fp8: fp8-block only, x's 1x128 FP8 operands (`operands.FP8Act`) when the caller already has them, e.g. each
      token's groups quantized once and gathered to its k expert rows (`fp8_input(...).take_rows(rows)`) instead of
      quantizing the k copies: the same bits, since a group's quantization sees only its own row. No gradient flows
      through them (the backward uses x). Other formats ignore it.
    """
    O.check_args(fmt, backward, "ops.grouped_linear")
    backends.check_backend(backend)
    x = jnp.asarray(x)
    if x.ndim != 2:
        raise ValueError(f"ops.grouped_linear: x must be [M, K] rows sorted by expert; got shape {x.shape}")
    e, n, _ = O.check_weight(w, fmt, x.shape[1], 3, "ops.grouped_linear")
    group_sizes = grouping.check_group_sizes(group_sizes, e, "ops.grouped_linear group_sizes")
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    if x.shape[0] == 0:
        return jnp.zeros((0, n), out_dtype)
    x_fp8 = x_fp8.check(x, "ops.grouped_linear x_fp8") if fmt == F.FP8_BLOCK and x_fp8 is not None else None
    return _grouped(x, w, group_sizes, x_fp8, fmt, backward, backend, out_dtype)


def fp8_input(x, w, backend: str | None = None) -> O.FP8Act:
    """x's 1x128 FP8 operands as `grouped_linear(x, w, fmt="fp8-block")` would make them (same backend, same bits),
    without a gradient: rows of x may be quantized before they are gathered into expert order (`FP8Act.take_rows`)."""
    n, k = w.shape[-2:]
    return O.fp8_act_gemm(jax.lax.stop_gradient(x), backends.resolve(backend, F.FP8_BLOCK, n, k))


def _bf16_dot(x, w, gs, backend, layout="nk", out_dtype=jnp.float32):
    """BF16 grouped GEMM, float32 sums rounded to out_dtype: the Pallas kernel on Hopper (auto) when the shape fits,
    else XLA."""
    o, c = (w.shape[1], w.shape[2]) if layout == "nk" else (w.shape[2], w.shape[1])
    be = backends.resolve_bf16_grouped(backend, o, c)
    return backends.bf16_grouped_matmul(x, w, gs, backend=be, layout=layout, out_dtype=out_dtype)


def _forward(x, w, gs, fmt, backend, out_dtype, x_fp8=None):
    e, n, k = w.shape
    if fmt == F.BF16:
        return _bf16_dot(x, jnp.asarray(w), gs, backend, out_dtype=out_dtype), None
    if fmt == F.FP8_BLOCK:
        be = backends.resolve(backend, fmt, n, k)
        xa = x_fp8 if x_fp8 is not None else O.fp8_act_gemm(x, be)
        wq, sb = O.fp8_weight(w, be)
        # the kernel rounds its float32 tiles to out_dtype as it stores them (round to nearest even, the convert XLA
        # would run after it): the same values without a float32 [M, N] round trip through memory and a convert
        # kernel, and a staging tile of out_dtype in shared memory
        y = block_scaled.grouped_block_scaled_matmul(xa.q, xa.scale, wq, sb, gs, backend=be, out_dtype=out_dtype,
                                                     b_scale_op=O.weight_scale_operand(w), a_scale_op=xa.scale_op)
        return y, (xa, wq, sb)  # scales in the contract's layout only if a backward asks (`FP8Act.scales`)
    xd, wd = O.emulated_operands(x, w, fmt)
    return _bf16_dot(xd, wd, gs, backend, out_dtype=out_dtype), (xd, wd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _grouped(x, w, gs, x_fp8, fmt, backward, backend, out_dtype):
    return _forward(x, w, gs, fmt, backend, out_dtype, x_fp8)[0]


def _grouped_fwd(x, w, gs, x_fp8, fmt, backward, backend, out_dtype):
    y, fwd_ops = _forward(x, w, gs, fmt, backend, out_dtype, x_fp8)
    keep = fwd_ops if (backward == "dequantized" or (backward == "fp8" and fmt == F.FP8_BLOCK)) else None
    return y, (x, w, gs, keep)


def _rows_in_groups(a, gs):
    """Zero the padding rows past sum(group_sizes), so they cannot move a quantization scale."""
    live = jnp.arange(a.shape[0]) < jnp.sum(gs)
    return jnp.where(live[:, None], a, jnp.zeros_like(a))


def _grouped_bwd(fmt, backward, backend, out_dtype, res, g):
    x, w, gs, kept = res
    e, n, k = w.shape
    g = _rows_in_groups(g, gs)
    if backward == "fp8":
        be, be_fwd = backends.resolve(backend, F.FP8_BLOCK, k, n), backends.resolve(backend, F.FP8_BLOCK, n, k)
        wq, sb = (kept[1], kept[2]) if kept is not None else O.fp8_weight(w, be_fwd)
        ga = O.fp8_act_gemm(g, be)
        dx = block_scaled.grouped_block_scaled_matmul(ga.q, ga.scale, *O.fp8_dgrad_weight(w, wq, sb), gs, backend=be,
                                                      b_scale_op=O.weight_scale_operand(w, transposed=True),
                                                      a_scale_op=ga.scale_op)
        xm = _rows_in_groups(x, gs)
        gtq, sgt = O.fp8_act_transposed(g, be)
        xtq, sxt = O.fp8_act_transposed(xm, be)
        dw = block_scaled.grouped_wgrad_fp8(gtq, sgt, xtq, sxt, gs, e, backend=be_fwd,  # [E, N, K]: the weight's shape
                                            out_dtype=O.wgrad_dtype(w))
    else:
        a, b = O.backward_operands(backward, fmt, x, w, kept)
        dx = _bf16_dot(g, b, gs, backend, layout="kn")
        dw = backends.bf16_grouped_wgrad(g, a, gs, e, backend=backends.resolve_bf16_grouped_wgrad(backend, n, k),
                                         out_dtype=O.wgrad_dtype(w))
    return dx.astype(x.dtype), O.master_cotangent(w, dw), None, None


_grouped.defvjp(_grouped_fwd, _grouped_bwd)
