"""The FP8 block-scaled GEMMs on the backend `ops.backends` chose: a Pallas kernel, or the XLA block math.

The XLA path is `xla_gemm` / `grouping`'s block math with the high-precision form's product of one K block
(`high_precision.block_dot`: an XLA dot on CPU, the row-invariant Pallas BF16 kernel under split3 on Hopper).
"""

from __future__ import annotations

import jax

from jaxrl_fp8.ops import grouping, high_precision, xla_gemm


def block_scaled_matmul(a_q, a_scale, b_q, b_scale, *, backend: str, b_rows_per_scale: int = 128, out_dtype=jax.numpy.float32,
                        b_scale_op=None, a_scale_op=None):
    """C[M, N] = A[M, K] . B[N, K]^T, 1x128 scales on A, 128x128 (or 1x128) on B (`xla_gemm.block_scaled_matmul`).
    b_scale_op: B's scales in the kernel's layout, made once (`operands.PreparedWeight.scale_op`); a_scale_op: A's
    (`operands.fp8_act_gemm`; a_scale may then be None on a kernel backend). The XLA path ignores both."""
    if backend == "xla":
        return xla_gemm.block_scaled_matmul(a_q, a_scale, b_q, b_scale, b_rows_per_scale=b_rows_per_scale,
                                            out_dtype=out_dtype, block_dot=high_precision.block_dot())
    from pallas_kernels import gemm_dense

    return gemm_dense.block_scaled_matmul(
        a_q, a_scale, b_q, b_scale, b_rows_per_scale=b_rows_per_scale, out_dtype=out_dtype, interpret=backend == "interpret",
        b_scale_op=b_scale_op, a_scale_op=a_scale_op,
    )


def grouped_block_scaled_matmul(a_q, a_scale, b_q, b_scale, group_sizes, *, backend: str, out_dtype=jax.numpy.float32,
                                b_scale_op=None, a_scale_op=None):
    """Rows of group g times expert g's weight b_q[g] [N, K] (128x128 scales); rows past the groups are 0.
    b_scale_op, a_scale_op as in `block_scaled_matmul`."""
    if backend == "xla":
        return grouping.grouped_block_scaled_matmul(a_q, a_scale, b_q, b_scale, group_sizes, out_dtype=out_dtype,
                                                    block_dot=high_precision.block_dot())
    from pallas_kernels import gemm_grouped

    return gemm_grouped.grouped_block_scaled_matmul(
        a_q, a_scale, b_q, b_scale, group_sizes, out_dtype=out_dtype, interpret=backend == "interpret", b_scale_op=b_scale_op,
        a_scale_op=a_scale_op,
    )


def grouped_wgrad_fp8(dyt_q, dyt_scale, xt_q, xt_scale, group_sizes, num_groups: int, *, backend: str,
                      out_dtype=jax.numpy.float32):
    """FP8 grouped weight gradient [E, N, K] (operands quantized 1x128 along M): float32 sums rounded to out_dtype
    (the kernel rounds as it stores, to nearest even like XLA's convert: the same values)."""
    if backend == "xla":
        return grouping.grouped_wgrad_fp8(dyt_q, dyt_scale, xt_q, xt_scale, group_sizes, num_groups,
                                          block_dot=high_precision.block_dot()).astype(out_dtype)
    from pallas_kernels import gemm_grouped_wgrad

    return gemm_grouped_wgrad.grouped_wgrad_fp8(
        dyt_q, dyt_scale, xt_q, xt_scale, group_sizes, num_groups, interpret=backend == "interpret", out_dtype=out_dtype
    )
