"""Grouped block-scaled FP8 kernel: ragged groups, empty experts, padding rows; interpret and H200."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_fp8.ops import reference as R
from jaxrl_fp8.precision.fp8 import quantize_fp8_per_block, quantize_fp8_per_token_group
from pallas_kernels import gemm_grouped


def _operands(seed, m, e, n, k):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((m, k)) * rng.uniform(0.01, 10.0, (m, 1)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((e, n, k)), jnp.float32)
    xq, sa = quantize_fp8_per_token_group(x, 128)
    wq, sb = quantize_fp8_per_block(w, (128, 128))
    return xq, sa, wq, sb


def test_aligned_layout_round_trip():
    gs = jnp.asarray([3, 0, 130, 1, 0], jnp.int32)
    src, dst, tile_group = gemm_grouped.aligned_layout(gs, 140, 128)
    src, dst, tg = map(np.asarray, (src, dst, tile_group))
    assert np.all(dst[134:] == -1)  # padding rows
    np.testing.assert_array_equal(src[dst[:134]], np.arange(134))
    assert list(tg[:4]) == [0, 2, 2, 3] and np.all(tg[4:] == -1)


def test_interpret_ragged_groups_with_empty_experts():
    xq, sa, wq, sb = _operands(0, 150, 4, 128, 256)
    gs = jnp.asarray([30, 0, 100, 10], jnp.int32)
    y = gemm_grouped.grouped_block_scaled_matmul(xq, sa, wq, sb, gs, interpret=True)
    assert R.rel_err(y, R.grouped_block_scaled_matmul(xq, sa, wq, sb, gs)) < 1e-6
    assert np.all(np.asarray(y)[140:] == 0)


def test_interpret_single_row():
    xq, sa, wq, sb = _operands(1, 1, 3, 128, 128)
    gs = jnp.asarray([0, 1, 0], jnp.int32)
    y = gemm_grouped.grouped_block_scaled_matmul(xq, sa, wq, sb, gs, interpret=True)
    assert R.rel_err(y, R.grouped_block_scaled_matmul(xq, sa, wq, sb, gs)) < 1e-6


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(1536, 2048), (2048, 768)])
def test_gpu_moe_shapes(n, k):
    e, m = 16, 4000
    rng = np.random.default_rng(n)
    sizes = rng.multinomial(m - 100, np.ones(e) / e)
    sizes[3] = 0
    sizes[5] += sizes[3]
    xq, sa, wq, sb = _operands(2, m, e, n, k)
    gs = jnp.asarray(sizes, jnp.int32)
    y = gemm_grouped.grouped_block_scaled_matmul(xq, sa, wq, sb, gs, out_dtype=jnp.bfloat16)
    ref = R.grouped_block_scaled_matmul(xq, sa, wq, sb, gs)
    assert R.rel_err(y, ref) < 1e-2  # bf16 output rounding
    assert np.all(np.asarray(y, np.float32)[int(sizes.sum()) :] == 0)
    y32 = gemm_grouped.grouped_block_scaled_matmul(xq, sa, wq, sb, gs)
    assert R.rel_err(y32, ref) < 1e-3
    # row invariance: the first rows of expert 0 alone give the same bits
    alone = gemm_grouped.grouped_block_scaled_matmul(xq[:5], sa[:5], wq, sb, jnp.asarray([5] + [0] * (e - 1), jnp.int32))
    np.testing.assert_array_equal(np.asarray(alone), np.asarray(y32)[:5])
