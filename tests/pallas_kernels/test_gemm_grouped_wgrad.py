"""Grouped wgrad kernels (FP8 and BF16): experts sharing 128-row blocks, empty experts, tail rows; interpret and H200.

`grouped_wgrad_fp8` / `grouped_wgrad_bf16` are the persistent k-grouped kernels, `grouped_wgrad_fp8_gather` /
`grouped_wgrad_bf16_gather` (rows gathered to 128-aligned offsets) their oracles: a persistent kernel must give its
gather kernel's bits (same blocks, block order and block math), in interpret mode and on the GPU.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_fp8.ops import grouping, reference as R
from jaxrl_fp8.precision.fp8 import dequantize_fp8_per_token_group, quantize_fp8_per_token_group
from pallas_kernels import gemm_grouped_wgrad as W
from tests.pallas_kernels.moe_data import EXPERTS, ROWS, ragged_sizes


def _operands(seed, m, n, k, pad_rows=True):
    """dy [m, n], x [m, k] -> their 1x128 quantization along M (rows zero-padded to 128 unless `pad_rows` is False:
    then the operands keep M = m columns, a last partial group), as the backward makes them."""
    rng = np.random.default_rng(seed)
    dy = jnp.asarray(rng.standard_normal((m, n)) * rng.uniform(0.01, 10.0, (m, 1)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    pad = (lambda a: jnp.pad(a, [(0, (-m) % 128), (0, 0)])) if pad_rows else (lambda a: a)
    return (*quantize_fp8_per_token_group(pad(dy).T, 128), *quantize_fp8_per_token_group(pad(x).T, 128))


def _float64(dq, ds, xq, xs, gs, e, m):
    """dw[g] = dy^[rows of g]^T . x^[rows of g] of the dequantized operands, in float64."""
    dy = np.asarray(dequantize_fp8_per_token_group(dq, ds, 128), np.float64).T[:m]
    x = np.asarray(dequantize_fp8_per_token_group(xq, xs, 128), np.float64).T[:m]
    if dy.shape[0] < m:  # unpadded operands
        dy, x = (np.pad(a, [(0, m - a.shape[0]), (0, 0)]) for a in (dy, x))
    return R.grouped_wgrad(dy, x, gs, e)


@pytest.mark.parametrize("m,sizes", [
    (300, [0, 129, 0, 150, 0]),          # boundaries off the block grid, empty experts, 21 tail rows
    (256, [3, 5, 100, 20, 128]),         # four experts inside the first block
    (1, [0, 1, 0]),                      # one row
    (200, [0, 0, 0]),                    # no row belongs to any expert
])
def test_interpret_matches_xla_path_and_float64(m, sizes):
    n, k, e = 128, 256, len(sizes)
    dq, ds, xq, xs = _operands(m, m, n, k)
    gs = jnp.asarray(sizes, jnp.int32)
    got = np.asarray(W.grouped_wgrad_fp8(dq, ds, xq, xs, gs, e, interpret=True))
    assert got.shape == (e, n, k)
    assert R.rel_err(got, grouping.grouped_wgrad_fp8(dq, ds, xq, xs, gs, e)) < 1e-6
    assert R.rel_err(got, _float64(dq, ds, xq, xs, gs, e, m)) < 1e-5
    for g, s in enumerate(sizes):
        if s == 0:
            assert np.all(got[g] == 0)


def _bits(a):
    return np.asarray(a, np.float32).view(np.uint32)


# (M, group sizes): every boundary kind the persistent kernel's edge blocks and block runs must get right
RAGGED = [
    (300, [0, 129, 0, 150, 0]),           # boundaries off the block grid, empty experts, 21 tail rows
    (256, [3, 5, 100, 20, 128]),          # four experts inside the first block, one straddling into the second
    (1, [0, 1, 0]),                       # one row
    (200, [0, 0, 0]),                     # no row belongs to any expert
    (384, [64, 128, 1, 1, 126]),          # a 128-row group straddling two experts; 1-row experts; whole last block
    (700, [130, 1, 0, 389, 180]),         # experts of 2-4 blocks (odd and even counts), M not a multiple of 128
]


@pytest.mark.parametrize("m,sizes", RAGGED)
@pytest.mark.parametrize("n,k", [(128, 256), (256, 128)])  # the edge copy masks dy^T, then x^T ("auto")
def test_persistent_matches_gather_kernel_bitwise_and_float64(m, sizes, n, k):
    e = len(sizes)
    dq, ds, xq, xs = _operands(m + n, m, n, k)
    gs = jnp.asarray(sizes, jnp.int32)
    got = np.asarray(W.grouped_wgrad_fp8(dq, ds, xq, xs, gs, e, interpret=True))
    assert got.shape == (e, n, k)
    old = W.grouped_wgrad_fp8_gather(dq, ds, xq, xs, gs, e, interpret=True)
    np.testing.assert_array_equal(_bits(got), _bits(old))
    assert R.rel_err(got, grouping.grouped_wgrad_fp8(dq, ds, xq, xs, gs, e)) < 1e-6
    assert R.rel_err(got, _float64(dq, ds, xq, xs, gs, e, m)) < 1e-5
    for g, s in enumerate(sizes):
        if s == 0:
            assert np.all(got[g] == 0)


CONFIGS = [
    W.WgradConfig(stages=2, mask="b"),   # the shallowest ring; mask the other operand
    W.WgradConfig(stages=3, k_fastest=False, mask="a"),
    W.WgradConfig(stages=2, blocks_per_step=2),  # promotion chains on the shallowest ring
]


@pytest.mark.parametrize("chain", [2])
def test_promotion_chains_same_bits(chain):
    """Chains of blocks (block i promoted under block i+1's wgmma) on expert runs of 0-5 blocks, odd and even (an odd
    last block alone): the one-block schedule's bits."""
    m, sizes = 1600, [0, 300, 5, 395, 640, 1, 259]  # runs of 3, 1, 4, 5, 1, 3 blocks (shared ends), one empty
    n, k, e = 128, 128, len(sizes)
    dq, ds, xq, xs = _operands(11, m, n, k, pad_rows=False)
    gs = jnp.asarray(sizes, jnp.int32)
    got = W.grouped_wgrad_fp8(dq, ds, xq, xs, gs, e, interpret=True, config=W.WgradConfig(blocks_per_step=chain))
    np.testing.assert_array_equal(_bits(got), _bits(W.grouped_wgrad_fp8(dq, ds, xq, xs, gs, e, interpret=True)))


@pytest.mark.parametrize("cfg", CONFIGS, ids=str)
def test_persistent_configs_same_bits(cfg):
    """Every tiling gives the same bits: the ring depth, tile order and the masked operand change
    only the schedule, never a block's product or the promotion order."""
    m, sizes = RAGGED[-1]
    n, k, e = 256, 128, len(sizes)
    dq, ds, xq, xs = _operands(7, m, n, k, pad_rows=False)
    gs = jnp.asarray(sizes, jnp.int32)
    got = W.grouped_wgrad_fp8(dq, ds, xq, xs, gs, e, interpret=True, config=cfg)
    np.testing.assert_array_equal(_bits(got), _bits(W.grouped_wgrad_fp8(dq, ds, xq, xs, gs, e, interpret=True)))
    assert R.rel_err(got, _float64(dq, ds, xq, xs, gs, e, m)) < 1e-5


def test_persistent_unpadded_m_matches_padded():
    """Operands whose M is not whole 128-row blocks (the kernel pads the last block) give the padded operands' bits."""
    m, sizes = 300, [0, 129, 0, 150, 21]
    n, k, e = 128, 128, len(sizes)
    gs = jnp.asarray(sizes, jnp.int32)
    raw = _operands(3, m, n, k, pad_rows=False)
    padded = _operands(3, m, n, k)
    assert raw[0].shape[1] == m and padded[0].shape[1] == 384
    a = W.grouped_wgrad_fp8(*raw, gs, e, interpret=True)
    b = W.grouped_wgrad_fp8(*padded, gs, e, interpret=True)
    np.testing.assert_array_equal(_bits(a), _bits(b))


@pytest.mark.row_invariant_cpu
@pytest.mark.parametrize("m,sizes", RAGGED[:2] + RAGGED[4:])
def test_persistent_matches_xla_path_bitwise(m, sizes):
    """Bitwise against the XLA path where this host's XLA:CPU dots are row invariant (interpret mode's tile products
    are dots of other shapes than the XLA path's; on other hosts the two differ in the last bits, rel. < 1e-6)."""
    n, k, e = 128, 256, len(sizes)
    dq, ds, xq, xs = _operands(m, m, n, k)
    gs = jnp.asarray(sizes, jnp.int32)
    got = W.grouped_wgrad_fp8(dq, ds, xq, xs, gs, e, interpret=True)
    np.testing.assert_array_equal(_bits(got), _bits(grouping.grouped_wgrad_fp8(dq, ds, xq, xs, gs, e)))


def test_expert_table_and_edge_blocks():
    """The kernel's schedule inputs: each expert's block run and which of its end blocks are shared, and the
    pre-masked copies of those blocks (other experts' rows zero)."""
    m, sizes = 384, [64, 128, 1, 1, 190]
    table, items, edge_items = W.expert_table(jnp.asarray(sizes, jnp.int32), m, len(sizes))
    np.testing.assert_array_equal(np.asarray(table), [
        [0, 0, 1, 1, 1],    # first block
        [1, 2, 1, 1, 2],    # block count
        [1, 1, 1, 1, 1],    # first block shared
        [1, 1, 1, 1, 0],    # last block shared (expert 4 ends with the array)
    ])
    a = jnp.asarray(np.arange(3 * m).reshape(3, m) % 200 + 1, jnp.uint8)
    a = jax.lax.bitcast_convert_type(a, jnp.float8_e4m3fn)
    edge = np.asarray(jax.lax.bitcast_convert_type(W.edge_blocks(a, items, edge_items), jnp.uint8)).reshape(3, 5, 2, 128)
    raw = np.asarray(jax.lax.bitcast_convert_type(a, jnp.uint8)).reshape(3, 3, 128)
    start = 0
    for g, s in enumerate(sizes):
        for which, blk in ((0, start // 128), (1, (start + s - 1) // 128)):
            lanes = np.arange(128) + blk * 128
            want = np.where((lanes >= start) & (lanes < start + s), raw[:, blk], 0)
            np.testing.assert_array_equal(edge[:, g, which], want)
        start += s
    rows = W.edge_blocks(a.T, items, edge_items, m_axis=0)  # the BF16 kernel's [M, C] operands: the same blocks
    assert rows.shape == (5 * 2 * 128, 3)
    np.testing.assert_array_equal(np.asarray(jax.lax.bitcast_convert_type(rows, jnp.uint8)).T.reshape(3, 5, 2, 128), edge)


@pytest.mark.parametrize("cfg", [W.WgradConfig(), *CONFIGS], ids=str)
def test_persistent_kernel_lowers_for_cuda(cfg):
    """Mosaic GPU's lowering of every config runs on the CPU (catches lowering errors before a GPU run)."""
    e, m, n, k = 8, 4096, 256, 384
    S = jax.ShapeDtypeStruct
    avals = (S((n, m), jnp.float8_e4m3fn), S((n, m // 128), jnp.float32), S((k, m), jnp.float8_e4m3fn),
             S((k, m // 128), jnp.float32), S((e,), jnp.int32))
    fn = functools.partial(W.grouped_wgrad_fp8, num_groups=e, config=cfg)
    txt = jax.jit(fn).trace(*avals).lower(lowering_platforms=("cuda",)).as_text()
    assert txt.count("custom_call @mosaic_gpu") == 1


@pytest.mark.parametrize("m,sizes", [(300, [0, 129, 0, 150, 0]), (256, [3, 5, 100, 20, 128]), (1, [0, 1, 0])])
def test_interpret_bf16_matches_xla_path_and_float64(m, sizes):
    rng = np.random.default_rng(m)
    n, k, e = 128, 256, len(sizes)
    dy = jnp.asarray(rng.standard_normal((m, n)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    gs = jnp.asarray(sizes, jnp.int32)
    got = np.asarray(W.grouped_wgrad_bf16(dy, x, gs, e, interpret=True))
    assert R.rel_err(got, grouping.grouped_wgrad(dy, x, gs, e)) < 1e-6
    bf = lambda a: np.asarray(a.astype(jnp.bfloat16), np.float64)
    assert R.rel_err(got, R.grouped_wgrad(bf(dy), bf(x), gs, e)) < 1e-6
    for g, s in enumerate(sizes):
        if s == 0:
            assert np.all(got[g] == 0)


def _bf16_operands(seed, m, n, k):
    rng = np.random.default_rng(seed)
    return (jnp.asarray(rng.standard_normal((m, n)), jnp.bfloat16), jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16))


@pytest.mark.parametrize("m,sizes", RAGGED)
def test_bf16_persistent_matches_gather_kernel_bitwise(m, sizes):
    """The BF16 persistent kernel (blocks in place, shared end blocks from the edge copy) gives the gather scheme's
    bits: the same 64-row steps chained into one accumulator in the same order."""
    n, k, e = 128, 256, len(sizes)
    dy, x = _bf16_operands(m, m, n, k)
    gs = jnp.asarray(sizes, jnp.int32)
    got = W.grouped_wgrad_bf16(dy, x, gs, e, interpret=True)
    np.testing.assert_array_equal(_bits(got), _bits(W.grouped_wgrad_bf16_gather(dy, x, gs, e, interpret=True)))
    assert R.rel_err(got, R.grouped_wgrad(np.asarray(dy, np.float64), np.asarray(x, np.float64), gs, e)) < 1e-6


@pytest.mark.parametrize("cfg", [W.WgradConfig(stages=2, mask="b"), W.WgradConfig(stages=3, k_fastest=False, mask="a")],
                         ids=str)
def test_bf16_persistent_configs_same_bits(cfg):
    """Ring depth, tile order and the masked operand change the BF16 kernel's schedule, never its bits."""
    m, sizes = RAGGED[-1]
    n, k, e = 256, 128, len(sizes)
    dy, x = _bf16_operands(5, m, n, k)
    gs = jnp.asarray(sizes, jnp.int32)
    got = W.grouped_wgrad_bf16(dy, x, gs, e, interpret=True, config=cfg)
    np.testing.assert_array_equal(_bits(got), _bits(W.grouped_wgrad_bf16_gather(dy, x, gs, e, interpret=True)))


def test_bf16_persistent_lowers_for_cuda():
    e, m, n, k = 8, 4096, 256, 384
    S = jax.ShapeDtypeStruct
    avals = (S((m, n), jnp.bfloat16), S((m, k), jnp.bfloat16), S((e,), jnp.int32))
    txt = jax.jit(functools.partial(W.grouped_wgrad_bf16, num_groups=e)).trace(*avals).lower(
        lowering_platforms=("cuda",)).as_text()
    assert txt.count("custom_call @mosaic_gpu") == 1


BF16 = jnp.bfloat16


def _bf16_bits(a):
    return np.asarray(jax.lax.bitcast_convert_type(jnp.asarray(a, BF16), jnp.uint16))


@pytest.mark.parametrize("m,sizes", [RAGGED[0], RAGGED[4], RAGGED[5]])
@pytest.mark.parametrize("stages", [4, 5])
def test_bfloat16_output_is_the_float32_result_rounded(m, sizes, stages):
    """out_dtype=bfloat16: both persistent kernels store the float32 tile rounded to nearest even, bit for bit XLA's
    convert of their float32 output; the smaller staging tile lets a fifth ring stage fit."""
    n, k, e = 256, 128, len(sizes)
    gs = jnp.asarray(sizes, jnp.int32)
    cfg = W.WgradConfig(stages=stages)
    dq, ds, xq, xs = _operands(m + 1, m, n, k)
    f32 = W.grouped_wgrad_fp8(dq, ds, xq, xs, gs, e, interpret=True)
    got = W.grouped_wgrad_fp8(dq, ds, xq, xs, gs, e, interpret=True, config=cfg, out_dtype=BF16)
    assert got.dtype == BF16 and got.shape == (e, n, k)
    np.testing.assert_array_equal(_bf16_bits(got), _bf16_bits(f32.astype(BF16)))
    dy, x = _bf16_operands(m + 2, m, n, k)
    f32 = W.grouped_wgrad_bf16(dy, x, gs, e, interpret=True)
    got = W.grouped_wgrad_bf16(dy, x, gs, e, interpret=True, config=cfg, out_dtype=BF16)
    assert got.dtype == BF16
    np.testing.assert_array_equal(_bf16_bits(got), _bf16_bits(f32.astype(BF16)))


def test_bfloat16_output_lowers_for_cuda_with_five_stages():
    e, m, n, k = 8, 4096, 256, 384
    S = jax.ShapeDtypeStruct
    cfg = W.WgradConfig(stages=5)
    fp8 = (S((n, m), jnp.float8_e4m3fn), S((n, m // 128), jnp.float32), S((k, m), jnp.float8_e4m3fn),
           S((k, m // 128), jnp.float32), S((e,), jnp.int32))
    bf16 = (S((m, n), BF16), S((m, k), BF16), S((e,), jnp.int32))
    for fn, avals in ((W.grouped_wgrad_fp8, fp8), (W.grouped_wgrad_bf16, bf16)):
        call = functools.partial(fn, num_groups=e, config=cfg, out_dtype=BF16)
        txt = jax.jit(call).trace(*avals).lower(lowering_platforms=("cuda",)).as_text()
        assert txt.count("custom_call @mosaic_gpu") == 1


def test_clear_errors():
    dq, ds, xq, xs = _operands(0, 64, 128, 128)
    gs = jnp.asarray([64], jnp.int32)
    with pytest.raises(ValueError, match="multiples of 128"):
        W.grouped_wgrad_fp8(dq[:100], ds[:100], xq, xs, gs, 1, interpret=True)
    with pytest.raises(ValueError, match="group_sizes"):
        W.grouped_wgrad_fp8(dq, ds, xq, xs, gs, 2, interpret=True)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        W.grouped_wgrad_fp8(dq.astype(jnp.float32), ds, xq, xs, gs, 1, interpret=True)
    with pytest.raises(ValueError, match="stages must be 2 to 4 with a float32 output"):
        W.grouped_wgrad_fp8(dq, ds, xq, xs, gs, 1, interpret=True, config=W.WgradConfig(stages=5))
    with pytest.raises(ValueError, match="stages must be 2 to 5 with a bfloat16 output"):
        W.grouped_wgrad_fp8(dq, ds, xq, xs, gs, 1, interpret=True, config=W.WgradConfig(stages=6), out_dtype=BF16)
    with pytest.raises(ValueError, match="out_dtype must be float32 or bfloat16; got float16"):
        W.grouped_wgrad_fp8(dq, ds, xq, xs, gs, 1, interpret=True, out_dtype=jnp.float16)
    with pytest.raises(ValueError, match="blocks_per_step must be one of"):
        W.grouped_wgrad_fp8(dq, ds, xq, xs, gs, 1, interpret=True, config=W.WgradConfig(blocks_per_step=4))
    dy, x = _bf16_operands(0, 64, 128, 128)
    with pytest.raises(ValueError, match="mask"):
        W.grouped_wgrad_bf16(dy, x, gs, 1, interpret=True, config=W.WgradConfig(mask="c"))
    with pytest.raises(ValueError, match="multiples of 128"):
        W.grouped_wgrad_bf16(dy[:, :100], x, gs, 1, interpret=True)


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(1536, 2048), (2048, 768)])
def test_gpu_bf16_moe_shapes(n, k):
    e, m = EXPERTS, ROWS
    sizes = ragged_sizes(k)
    rng = np.random.default_rng(k)
    dy = jnp.asarray(rng.standard_normal((m, n)), jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    gs = jnp.asarray(sizes, jnp.int32)
    got = np.asarray(W.grouped_wgrad_bf16(dy, x, gs, e))
    assert R.rel_err(got, R.grouped_wgrad(dy, x, gs, e)) < 1e-5
    assert np.all(got[3] == 0)
    np.testing.assert_array_equal(_bits(got), _bits(W.grouped_wgrad_bf16_gather(dy, x, gs, e)))


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(1536, 2048), (2048, 768)])
def test_gpu_moe_shapes(n, k):
    e, m = EXPERTS, ROWS
    sizes = ragged_sizes(n)
    dq, ds, xq, xs = _operands(1, m, n, k)
    gs = jnp.asarray(sizes, jnp.int32)
    got = np.asarray(W.grouped_wgrad_fp8(dq, ds, xq, xs, gs, e))
    assert R.rel_err(got, _float64(dq, ds, xq, xs, gs, e, m)) < 1e-3  # H200 FP8 wgmma accumulation
    assert np.all(got[3] == 0)


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(1536, 2048), (2048, 768)])
@pytest.mark.parametrize("cfg", [W.WgradConfig(), W.WgradConfig(k_fastest=False), W.WgradConfig(stages=3, mask="a"),
                                 W.WgradConfig(blocks_per_step=2)], ids=str)
def test_gpu_persistent_moe_shapes_same_bits_as_gather_kernel(n, k, cfg):
    e, m = EXPERTS, ROWS
    sizes = ragged_sizes(n + 1)
    dq, ds, xq, xs = _operands(2, m, n, k)
    gs = jnp.asarray(sizes, jnp.int32)
    got = np.asarray(W.grouped_wgrad_fp8(dq, ds, xq, xs, gs, e, config=cfg))
    assert R.rel_err(got, _float64(dq, ds, xq, xs, gs, e, m)) < 1e-3  # H200 FP8 wgmma accumulation
    assert np.all(got[3] == 0)
    np.testing.assert_array_equal(_bits(got), _bits(W.grouped_wgrad_fp8_gather(dq, ds, xq, xs, gs, e)))


@pytest.mark.gpu
def test_gpu_persistent_boundary_cases_same_bits_as_gather_kernel():
    """The interpret-mode boundary cases on the GPU (TMA reads in place, pre-masked edge blocks)."""
    for m, sizes in RAGGED:
        n, k, e = 256, 384, len(sizes)
        dq, ds, xq, xs = _operands(m, m, n, k, pad_rows=m % 2 == 0)
        gs = jnp.asarray(sizes, jnp.int32)
        got = W.grouped_wgrad_fp8(dq, ds, xq, xs, gs, e)
        np.testing.assert_array_equal(_bits(got), _bits(W.grouped_wgrad_fp8_gather(dq, ds, xq, xs, gs, e)))
        assert R.rel_err(got, _float64(dq, ds, xq, xs, gs, e, m)) < 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(1536, 2048), (2048, 768)])
@pytest.mark.parametrize("stages", [4, 5])
def test_gpu_bfloat16_output_is_the_float32_result_rounded(n, k, stages):
    e, m = EXPERTS, ROWS
    gs = jnp.asarray(ragged_sizes(n + 2), jnp.int32)
    cfg = W.WgradConfig(stages=stages)
    dq, ds, xq, xs = _operands(3, m, n, k)
    f32 = W.grouped_wgrad_fp8(dq, ds, xq, xs, gs, e)
    got = W.grouped_wgrad_fp8(dq, ds, xq, xs, gs, e, config=cfg, out_dtype=BF16)
    np.testing.assert_array_equal(_bf16_bits(got), _bf16_bits(f32.astype(BF16)))
    dy, x = _bf16_operands(4, m, n, k)
    f32 = W.grouped_wgrad_bf16(dy, x, gs, e)
    got = W.grouped_wgrad_bf16(dy, x, gs, e, config=cfg, out_dtype=BF16)
    np.testing.assert_array_equal(_bf16_bits(got), _bf16_bits(f32.astype(BF16)))
