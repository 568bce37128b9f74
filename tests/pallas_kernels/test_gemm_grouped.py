"""Grouped block-scaled FP8 kernel: ragged groups, empty experts, padding rows; interpret and H200."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_fp8.ops import reference as R
from jaxrl_fp8.precision.fp8 import quantize_fp8_per_block, quantize_fp8_per_token_group
from pallas_kernels import gemm_dense, gemm_grouped
from pallas_kernels.gemm_dense import GemmConfig
from tests.pallas_kernels.moe_data import EXPERTS, ROWS, ragged_sizes

# Both ways the two compute warpgroups share a CTA tile: 128-row blocks (the default), and 64-row blocks with a
# column tile each (gemm_grouped.NARROW_CONFIG, for groups of a few rows).
SPLITS = pytest.mark.parametrize("config", [None, gemm_grouped.NARROW_CONFIG], ids=["rows", "cols"])


def _operands(seed, m, e, n, k):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((m, k)) * rng.uniform(0.01, 10.0, (m, 1)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((e, n, k)), jnp.float32)
    xq, sa = quantize_fp8_per_token_group(x, 128)
    wq, sb = quantize_fp8_per_block(w, (128, 128))
    return xq, sa, wq, sb


def test_work_items_cover_every_row_once():
    """Each row is stored by exactly one work item, with its own group; the tail rows by a zero item."""
    rng = np.random.default_rng(7)
    for m, gs in [(140, [3, 0, 130, 1, 0]), (256, [256, 0]), (1, [0, 1]), (1000, list(rng.multinomial(900, np.ones(9) / 9)))]:
        items = np.asarray(gemm_grouped.work_items(jnp.asarray(gs, jnp.int32), m, 128))
        assert items.shape == (4, -(-m // 128) + len(gs))
        owner = np.full(m, -2)
        for g, blk, off, size in items.T:
            rows = np.arange(blk * 128 + off, blk * 128 + off + size)
            assert np.all(owner[rows] == -2), "a row stored twice"
            owner[rows] = g
        want = np.concatenate([np.full(s, i) for i, s in enumerate(gs)] + [np.full(m - sum(gs), -1)]).astype(int)
        np.testing.assert_array_equal(owner, want)


def test_work_items_are_one_loop_free_program():
    """The work list is computed without a while loop (it runs inside every decode step: a loop there is log2(E)
    rounds of small kernels) and gives the bisection's answer (jnp.searchsorted's default scan method)."""
    gs = jnp.asarray(np.random.default_rng(3).multinomial(500, np.ones(128) / 128), jnp.int32)
    program = jax.jit(lambda g: gemm_grouped.work_items(g, 512, 128)).lower(gs).as_text()
    assert "while" not in program
    sizes = np.asarray(gs)
    ends = np.minimum(np.cumsum(sizes), 512)
    starts = np.concatenate([[0], ends[:-1], ends[-1:]])
    ends = np.concatenate([ends, [512]])
    first = starts // 128
    blocks = np.where(ends > starts, (ends - 1) // 128 + 1 - first, 0)
    t = np.arange(4 + 128)
    want_group = np.minimum(np.searchsorted(np.cumsum(blocks), t, side="right"), 128)
    items = np.asarray(gemm_grouped.work_items(gs, 512, 128))
    np.testing.assert_array_equal(items[0], np.where(want_group < 128, want_group, -1))


@SPLITS
def test_interpret_ragged_groups_with_empty_experts(config):
    xq, sa, wq, sb = _operands(0, 150, 4, 256, 256)
    gs = jnp.asarray([30, 0, 100, 10], jnp.int32)
    y = gemm_grouped.grouped_block_scaled_matmul(xq, sa, wq, sb, gs, interpret=True, config=config)
    assert R.rel_err(y, R.grouped_block_scaled_matmul(xq, sa, wq, sb, gs)) < 1e-6
    assert np.all(np.asarray(y)[140:] == 0)


@SPLITS
def test_interpret_groups_straddling_blocks_and_partial_last_block(config):
    """Group boundaries off the 128-row grid, a group spanning three blocks, M not a multiple of 128."""
    xq, sa, wq, sb = _operands(3, 300, 5, 256, 256)
    gs = jnp.asarray([0, 129, 0, 150, 0], jnp.int32)
    y = gemm_grouped.grouped_block_scaled_matmul(xq, sa, wq, sb, gs, interpret=True, config=config)
    assert y.shape == (300, 256)
    assert R.rel_err(y, R.grouped_block_scaled_matmul(xq, sa, wq, sb, gs)) < 1e-6
    assert np.all(np.asarray(y)[279:] == 0)


@SPLITS
def test_interpret_scales_in_the_kernel_layout_give_the_same_bits(config):
    """a_scale_op ([K/128, >= Mp], as the quantizer writes it) instead of a_scale: the same bits, both splits."""
    xq, sa, wq, sb = _operands(7, 150, 4, 256, 256)
    gs = jnp.asarray([30, 0, 100, 10], jnp.int32)
    want = np.asarray(gemm_grouped.grouped_block_scaled_matmul(xq, sa, wq, sb, gs, interpret=True, config=config))
    op = jnp.pad(sa, [(0, 256 - 150), (0, 0)]).T
    got = gemm_grouped.grouped_block_scaled_matmul(xq, None, wq, sb, gs, interpret=True, config=config, a_scale_op=op)
    np.testing.assert_array_equal(np.asarray(got), want)


@pytest.mark.row_invariant_cpu
def test_interpret_row_invariance_across_block_offsets():
    """The same rows give bit-identical results wherever the 128-row block boundaries fall."""
    xq, sa, wq, sb = _operands(4, 200, 2, 128, 256)
    gs = jnp.asarray([60, 140], jnp.int32)
    full = np.asarray(gemm_grouped.grouped_block_scaled_matmul(xq, sa, wq, sb, gs, interpret=True))
    shifted = np.asarray(gemm_grouped.grouped_block_scaled_matmul(xq[50:], sa[50:], wq, sb, jnp.asarray([10, 140], jnp.int32), interpret=True))
    np.testing.assert_array_equal(shifted, full[50:])


def test_interpret_narrow_split_gives_the_default_bits():
    """64-row blocks with a column tile per warpgroup: the same wgmma shape per row, so the same bits as the
    default 128-row blocks; decode-like routing (a few rows per expert, empty experts), N of two column tiles.
    (A 64-row block is a half of a 128-row block, so each warpgroup multiplies the same 64 x 128 operand tiles in
    both splits: exact on any CPU, unlike `test_interpret_row_invariance_across_block_offsets`.)"""
    rng = np.random.default_rng(9)
    xq, sa, wq, sb = _operands(5, 90, 12, 512, 256)
    sizes = rng.multinomial(85, np.ones(12) / 12)
    sizes[[2, 7]] = 0
    gs = jnp.asarray(sizes, jnp.int32)
    rows = np.asarray(gemm_grouped.grouped_block_scaled_matmul(xq, sa, wq, sb, gs, interpret=True))
    cols = np.asarray(gemm_grouped.grouped_block_scaled_matmul(xq, sa, wq, sb, gs, interpret=True, config=gemm_grouped.NARROW_CONFIG))
    np.testing.assert_array_equal(cols, rows)
    assert np.all(cols[85:] == 0)


def test_narrow_split_needs_two_column_tiles():
    xq, sa, wq, sb = _operands(6, 10, 2, 384, 128)
    with pytest.raises(ValueError, match="multiple of the CTA tile's 256 columns"):
        gemm_grouped.grouped_block_scaled_matmul(xq, sa, wq, sb, jnp.asarray([4, 6], jnp.int32), interpret=True,
                                                 config=gemm_grouped.NARROW_CONFIG)
    with pytest.raises(ValueError, match="split"):
        gemm_grouped.grouped_block_scaled_matmul(xq, sa, wq, sb, jnp.asarray([4, 6], jnp.int32), interpret=True,
                                                 config=GemmConfig(split="diagonal"))


def test_interpret_ring_gives_the_dense_tile_routine_bits():
    """Groups of whole 128-row blocks, so each expert's tiles hold exactly the rows a dense GEMM of its rows holds: the
    grouped kernel's TMA ring (tiles of several items and the tail's zero tiles walked by each of the interpreter's
    3 programs, buffers running on across tiles) gives the dense kernel's per-tile pipeline's bits, float32 and
    bf16, K of 3 blocks (the ring's slots do not line up with tiles)."""
    xq, sa, wq, sb = _operands(11, 600, 4, 256, 384)
    gs = [128, 0, 256, 128]  # 512 rows in groups, 88 tail rows
    tiling = gemm_dense.default_config(256, 384)
    for out_dtype in (jnp.float32, jnp.bfloat16):
        y = np.asarray(gemm_grouped.grouped_block_scaled_matmul(xq, sa, wq, sb, jnp.asarray(gs, jnp.int32), interpret=True,
                                                                out_dtype=out_dtype).astype(jnp.float32))
        start = 0
        for g, size in enumerate(gs):
            if size:
                rows = slice(start, start + size)
                dense = gemm_dense.block_scaled_matmul(xq[rows], sa[rows], wq[g], sb[g], interpret=True, out_dtype=out_dtype,
                                                       config=tiling)  # the grouped kernel's tile, not a decode batch's
                np.testing.assert_array_equal(y[rows].view(np.uint32), np.asarray(dense.astype(jnp.float32)).view(np.uint32))
            start += size
        assert np.all(y[512:] == 0)


def test_interpret_bf16_output_is_the_float32_output_rounded():
    """`ops.grouped_linear` asks the kernel for BF16 outputs instead of float32 and an XLA convert: the kernel's store
    must round to nearest even exactly as that convert does (ragged groups, empty experts, the zero tail)."""
    xq, sa, wq, sb = _operands(13, 300, 6, 256, 768)
    gs = jnp.asarray([3, 0, 140, 1, 0, 90], jnp.int32)
    f32 = gemm_grouped.grouped_block_scaled_matmul(xq, sa, wq, sb, gs, interpret=True)
    bf16 = gemm_grouped.grouped_block_scaled_matmul(xq, sa, wq, sb, gs, interpret=True, out_dtype=jnp.bfloat16)
    assert bf16.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(bf16).view(np.uint16), np.asarray(f32.astype(jnp.bfloat16)).view(np.uint16))


@pytest.mark.parametrize("k", [128, 384, 768])  # K blocks per tile: 1, 3 (a chain of 2 and one alone), 6
def test_interpret_promotion_chains_give_the_one_block_bits(k):
    """Chains of 2 K blocks (the first promoted under the second one's wgmma; an odd last block alone) and one block
    at a time promote in the same K order: the same bits, both splits, ragged groups and the tail."""
    import dataclasses

    xq, sa, wq, sb = _operands(13, 300, 5, 256, k)
    gs = jnp.asarray([0, 129, 0, 150, 0], jnp.int32)
    for base in (gemm_grouped.DEFAULT_CONFIG, gemm_grouped.NARROW_CONFIG):
        want = np.asarray(gemm_grouped.grouped_block_scaled_matmul(xq, sa, wq, sb, gs, interpret=True, config=base))
        got = np.asarray(gemm_grouped.grouped_block_scaled_matmul(xq, sa, wq, sb, gs, interpret=True,
                                                                  config=dataclasses.replace(base, k_blocks_per_step=1)))
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def test_promotion_chains_lower_for_cuda_and_bad_lengths_are_refused():
    import dataclasses

    e, m, n, k = 8, 1024, 256, 768
    S = jax.ShapeDtypeStruct
    avals = (S((m, k), jnp.float8_e4m3fn), S((m, k // 128), jnp.float32), S((e, n, k), jnp.float8_e4m3fn),
             S((e, n // 128, k // 128), jnp.float32), S((e,), jnp.int32))
    for base in (gemm_grouped.DEFAULT_CONFIG, gemm_grouped.NARROW_CONFIG):
        for chain in (1, 2):
            fn = functools.partial(gemm_grouped.grouped_block_scaled_matmul,
                                   config=dataclasses.replace(base, k_blocks_per_step=chain))
            assert jax.jit(fn).trace(*avals).lower(lowering_platforms=("cuda",)).as_text().count("custom_call @mosaic_gpu") == 1
    xq, sa, wq, sb = _operands(1, 8, 1, 128, 256)
    with pytest.raises(ValueError, match="promotion chain"):
        gemm_grouped.grouped_block_scaled_matmul(xq, sa, wq, sb, jnp.asarray([8], jnp.int32), interpret=True,
                                                 config=GemmConfig(k_blocks_per_step=4))
    with pytest.raises(ValueError, match="k_blocks_per_step must be 1 or 2"):
        gemm_dense.block_scaled_matmul(xq, sa, wq[0], sb[0], interpret=True, config=GemmConfig(k_blocks_per_step=4))


@SPLITS
def test_interpret_single_row(config):
    xq, sa, wq, sb = _operands(1, 1, 3, 256, 128)
    gs = jnp.asarray([0, 1, 0], jnp.int32)
    y = gemm_grouped.grouped_block_scaled_matmul(xq, sa, wq, sb, gs, interpret=True, config=config)
    assert R.rel_err(y, R.grouped_block_scaled_matmul(xq, sa, wq, sb, gs)) < 1e-6


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(1536, 2048), (2048, 768)])
def test_gpu_moe_shapes(n, k):
    e, m = EXPERTS, ROWS
    sizes = ragged_sizes(n)
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


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 64, 256])
@pytest.mark.parametrize("n,k", [(768, 2048), (2048, 768)])
def test_gpu_narrow_split_decode_routing(rows, n, k):
    """A decode step's expert GEMMs (128 experts, top-8: a few rows an expert, most experts touched): the narrow
    split gives the default split's float32 bits, and a row alone its bits in the batch."""
    e, topk = 128, 8
    rng = np.random.default_rng(rows)
    experts = np.argsort(rng.random((rows, e)), axis=1)[:, :topk]
    gs = jnp.asarray(np.bincount(experts.reshape(-1), minlength=e), jnp.int32)
    xq, sa, wq, sb = _operands(7, rows * topk, e, n, k)
    default = np.asarray(gemm_grouped.grouped_block_scaled_matmul(xq, sa, wq, sb, gs))
    narrow = np.asarray(gemm_grouped.grouped_block_scaled_matmul(xq, sa, wq, sb, gs, config=gemm_grouped.NARROW_CONFIG))
    np.testing.assert_array_equal(narrow.view(np.uint32), default.view(np.uint32))
    assert R.rel_err(narrow, R.grouped_block_scaled_matmul(xq, sa, wq, sb, gs)) < 1e-3
    first = int(np.argmax(np.asarray(gs) > 0))
    alone = gemm_grouped.grouped_block_scaled_matmul(xq[:1], sa[:1], wq, sb, jnp.zeros((e,), jnp.int32).at[first].set(1),
                                                     config=gemm_grouped.NARROW_CONFIG)
    np.testing.assert_array_equal(np.asarray(alone).view(np.uint32), default[:1].view(np.uint32))
