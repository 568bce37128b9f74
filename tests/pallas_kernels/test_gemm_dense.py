"""Dense block-scaled FP8 kernel: interpret mode on CPU (small tiles) and on the H200 (-m gpu)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_fp8.ops import reference as R
from jaxrl_fp8.ops import xla_gemm
from jaxrl_fp8.precision.fp8 import quantize_fp8_per_block, quantize_fp8_per_token_group
from pallas_kernels import gemm_dense


def _operands(seed, m, n, k, b_rows_per_scale=128):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((m, k)) * rng.uniform(0.01, 10.0, (m, 1)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((n, k)) * rng.uniform(0.01, 1.0, (n, 1)), jnp.float32)
    xq, sa = quantize_fp8_per_token_group(x, 128)
    if b_rows_per_scale == 1:
        wq, sb = quantize_fp8_per_token_group(w, 128)
    else:
        wq, sb = quantize_fp8_per_block(w, (128, 128))
    return xq, sa, wq, sb


@pytest.mark.parametrize("m,n,k,rows", [(1, 128, 128, 128), (100, 256, 256, 128), (130, 128, 384, 1)])
def test_interpret_matches_float64(m, n, k, rows):
    xq, sa, wq, sb = _operands(m + n + k, m, n, k, rows)
    y = gemm_dense.block_scaled_matmul(xq, sa, wq, sb, b_rows_per_scale=rows, interpret=True)
    assert y.shape == (m, n) and y.dtype == jnp.float32
    assert R.rel_err(y, R.block_scaled_matmul(xq, sa, wq, sb, rows)) < 1e-6


C = gemm_dense.GemmConfig


@pytest.mark.parametrize("rows", [128, 1])
@pytest.mark.parametrize("cfg", [C(), C(max_concurrent_steps=2, k_blocks_per_step=2), C(tile_n=256, max_concurrent_steps=2, k_blocks_per_step=2)],
                         ids=["k1", "k2", "k2_n256"])
def test_interpret_tilings_compute_the_same_block_math(cfg, rows):
    """Every tiling (one or two K blocks per step; row-folded or per-column scales) against float64."""
    xq, sa, wq, sb = _operands(11, 70, 256, 512, rows)
    assert gemm_dense.uses_row_scales(cfg, rows) == (rows == 128 and cfg.tile_n == 128)
    y = gemm_dense.block_scaled_matmul(xq, sa, wq, sb, b_rows_per_scale=rows, interpret=True, config=cfg)
    assert R.rel_err(y, R.block_scaled_matmul(xq, sa, wq, sb, rows)) < 1e-6


def test_decode_batches_get_the_narrowest_column_tile_of_one_wave():
    """M <= 256: the narrowest column tile whose output tiles fit one wave of CTAs (132 SMs off a GPU; the shapes
    measured on the GPU: the stacked q/k/v [5120, 2048] and o [2048, 4096] at 64 and 256 rows); larger M: the
    shape-only tiling."""
    assert gemm_dense.default_config(5120, 2048, 64) == C(tile_n=64, max_concurrent_steps=4, grid_tile_width=16, grid_minor_dim=0)
    assert gemm_dense.default_config(5120, 2048, 256) == C(tile_n=128, max_concurrent_steps=4, grid_tile_width=16, grid_minor_dim=0)
    assert gemm_dense.default_config(2048, 4096, 256) == C(tile_n=32, max_concurrent_steps=8, grid_tile_width=16, grid_minor_dim=0)
    assert gemm_dense.default_config(2048, 4096, 1).tile_n == 32
    assert gemm_dense.default_config(2048, 4096, 257) == gemm_dense.default_config(2048, 4096) == C(max_concurrent_steps=2, k_blocks_per_step=2)
    assert gemm_dense.default_config(151936, 2048, 64) == gemm_dense.default_config(151936, 2048)  # no tile fits one wave


@pytest.mark.parametrize("m", [1, 64, 200])
def test_interpret_decode_tilings_compute_the_training_tilings_block_math(m):
    """A decode batch takes narrower column tiles (and per-column scales) than a training batch. On the GPU a row's
    bits are the same either way (`test_gpu_row_invariance_bitwise`); the interpreter's XLA:CPU rounds the promotion's
    multiply-add differently per tile shape (measured: a few elements in 2048 one float32 ulp apart), so here the
    rows agree to float32 rounding."""
    xq, sa, wq, sb = _operands(13, 300, 256, 384)
    assert gemm_dense.default_config(256, 384, m).tile_n == 32 and gemm_dense.default_config(256, 384, 300).tile_n == 128
    full = np.asarray(gemm_dense.block_scaled_matmul(xq, sa, wq, sb, interpret=True))
    part = np.asarray(gemm_dense.block_scaled_matmul(xq[:m], sa[:m], wq, sb, interpret=True))
    np.testing.assert_allclose(part, full[:m], rtol=1e-6, atol=1e-6 * np.abs(full).max())


def test_scales_laid_out_for_another_batch_size_pick_their_tiling():
    """A b_scale_op made for any batch (rows=None, the trainer's) in a decode-sized call keeps the shape-only tiling;
    one made for the decode rows gets the decode tiling: each gives the bits of its tiling with scales laid out in
    the call."""
    xq, sa, wq, sb = _operands(14, 8, 256, 384)
    for rows in (None, 8):
        op = gemm_dense.weight_scale_operand(sb, 256, 384, rows=rows)
        got = gemm_dense.block_scaled_matmul(xq, sa, wq, sb, interpret=True, b_scale_op=op)
        want = gemm_dense.block_scaled_matmul(xq, sa, wq, sb, interpret=True, config=gemm_dense.default_config(256, 384, rows))
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert gemm_dense.weight_scale_operand(sb, 256, 384, rows=8).shape == (3, 256)  # per-column scales
    assert gemm_dense.weight_scale_operand(sb, 256, 384).shape == (2, 3, 128)  # one per row block
    with pytest.raises(ValueError, match="b_scale_op"):
        gemm_dense.block_scaled_matmul(xq, sa, wq, sb, interpret=True, b_scale_op=sb[None])


def test_config_checks_k_against_the_step():
    xq, sa, wq, sb = _operands(12, 8, 128, 384)
    with pytest.raises(ValueError, match="k_blocks_per_step"):
        gemm_dense.block_scaled_matmul(xq, sa, wq, sb, interpret=True, config=C(k_blocks_per_step=2))
    assert gemm_dense.default_config(128, 384).k_blocks_per_step == 1 and gemm_dense.default_config(128, 2048).k_blocks_per_step == 2


def test_interpret_row_invariance_and_bf16_out():
    xq, sa, wq, sb = _operands(1, 140, 128, 256)
    full = np.asarray(gemm_dense.block_scaled_matmul(xq, sa, wq, sb, interpret=True, out_dtype=jnp.bfloat16))
    alone = np.asarray(gemm_dense.block_scaled_matmul(xq[137:138], sa[137:138], wq, sb, interpret=True, out_dtype=jnp.bfloat16))
    np.testing.assert_array_equal(alone[0], full[137])
    assert full.dtype == jnp.bfloat16


def test_bad_shapes_raise_clear_errors():
    xq, sa, wq, sb = _operands(2, 8, 128, 256)
    with pytest.raises(ValueError, match="multiples of 128"):
        gemm_dense.block_scaled_matmul(xq[:, :200], sa, wq[:, :200], sb, interpret=True)
    with pytest.raises(ValueError, match="a_scale"):
        gemm_dense.block_scaled_matmul(xq, sa[:, :1], wq, sb, interpret=True)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        gemm_dense.block_scaled_matmul(xq.astype(jnp.bfloat16), sa, wq, sb, interpret=True)


def test_interpret_scales_in_the_kernel_layout_give_the_same_bits():
    """a_scale_op (A's scales as the quantizer writes them for the kernel, [K/128, >= Mp]) instead of a_scale: the
    same output bits; a wider padding than the row block is accepted; a wrong layout is named."""
    from pallas_kernels import quantize as Q

    xq, sa, wq, sb = _operands(5, 130, 128, 256)
    want = np.asarray(gemm_dense.block_scaled_matmul(xq, sa, wq, sb, interpret=True))
    for mp in (256, 384):
        op = jnp.pad(sa, [(0, mp - 130), (0, 0)]).T
        np.testing.assert_array_equal(np.asarray(gemm_dense.block_scaled_matmul(xq, None, wq, sb, interpret=True, a_scale_op=op)), want)
    x = jnp.asarray(np.random.default_rng(6).standard_normal((130, 256)), jnp.bfloat16)
    q, op = Q.fp8_gemm_operand(x, interpret=True)
    rq, rs = quantize_fp8_per_token_group(x, 128)
    np.testing.assert_array_equal(np.asarray(gemm_dense.block_scaled_matmul(q, None, wq, sb, interpret=True, a_scale_op=op)),
                                  np.asarray(gemm_dense.block_scaled_matmul(rq, rs, wq, sb, interpret=True)))
    with pytest.raises(ValueError, match="a_scale_op"):
        gemm_dense.block_scaled_matmul(xq, None, wq, sb, interpret=True, a_scale_op=sa)


# ---- on the H200 --------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k,rows", [(1, 2048, 2048, 128), (64, 4096, 2048, 128), (1000, 1536, 2048, 128), (4096, 2048, 4096, 1), (333, 768, 640, 128)])
def test_gpu_matches_float64(m, n, k, rows):
    xq, sa, wq, sb = _operands(m * 3 + n, m, n, k, rows)
    y = gemm_dense.block_scaled_matmul(xq, sa, wq, sb, b_rows_per_scale=rows)
    ref = R.block_scaled_matmul(xq, sa, wq, sb, rows)
    assert R.rel_err(y, ref) < 1e-3  # FP8 wgmma block accumulation is below float32 precision
    # the XLA path computes the same function
    assert R.rel_err(xla_gemm.block_scaled_matmul(xq, sa, wq, sb, b_rows_per_scale=rows), ref) < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(2048, 2048), (5120, 2048), (2048, 4096)])
def test_gpu_row_invariance_bitwise(n, k):
    """A row's bits alone, in a decode batch (M <= 256: narrower column tiles, `default_config`) and in a training
    batch, float32 and BF16 out; the decode step's stacked q/k/v and o shapes among them."""
    xq, sa, wq, sb = _operands(5, 777, n, k)
    for out in (jnp.float32, jnp.bfloat16):
        f = jax.jit(lambda a, s: gemm_dense.block_scaled_matmul(a, s, wq, sb, out_dtype=out))
        full = np.asarray(f(xq, sa))
        for i in [0, 300, 776]:
            np.testing.assert_array_equal(np.asarray(f(xq[i : i + 1], sa[i : i + 1]))[0], full[i])
        for m in (64, 256):
            np.testing.assert_array_equal(np.asarray(f(xq[:m], sa[:m])), full[:m])
