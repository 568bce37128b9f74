"""Grouped BF16 kernel: ragged groups, empty experts, both weight layouts, row invariance; interpret and H200."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_fp8.ops import reference as R
from pallas_kernels import gemm_grouped_bf16 as G
from tests.pallas_kernels.moe_data import EXPERTS, ROWS, ragged_sizes

BF16 = jnp.bfloat16


def _operands(seed, m, e, o, c):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((m, c)) * rng.uniform(0.01, 10.0, (m, 1)), BF16)
    w = jnp.asarray(rng.standard_normal((e, o, c)), BF16)
    return x, w


def _check(y, x, w, gs, tol=1e-6):
    """Against the float64 grouped product of the same BF16 values; rows past the groups must be 0."""
    assert R.rel_err(y, R.grouped_dot(x, w, gs)) < tol
    assert np.all(np.asarray(y, np.float32)[int(np.sum(gs)) :] == 0)


def test_interpret_groups_straddling_blocks_empty_experts_partial_last_block():
    x, w = _operands(0, 300, 5, 256, 192)
    gs = jnp.asarray([0, 129, 0, 150, 0], jnp.int32)
    _check(G.grouped_matmul(x, w, gs, interpret=True), x, w, gs)


def test_interpret_kn_layout_equals_nk_bitwise():
    """The data-gradient layout reads w [E, C, O] in place and gives the same bits as the forward layout."""
    x, w = _operands(1, 140, 3, 128, 256)
    gs = jnp.asarray([3, 130, 1], jnp.int32)
    nk = np.asarray(G.grouped_matmul(x, w, gs, interpret=True))
    kn = np.asarray(G.grouped_matmul(x, jnp.swapaxes(w, 1, 2), gs, layout="kn", interpret=True))
    np.testing.assert_array_equal(kn, nk)
    _check(nk, x, w, gs)


@pytest.mark.row_invariant_cpu
def test_interpret_row_invariance_across_block_offsets_and_m1():
    """The same rows give identical bits wherever the 128-row block boundaries fall; M = 1 included."""
    x, w = _operands(2, 200, 2, 128, 128)
    gs = jnp.asarray([60, 140], jnp.int32)
    full = np.asarray(G.grouped_matmul(x, w, gs, interpret=True))
    shifted = np.asarray(G.grouped_matmul(x[50:], w, jnp.asarray([10, 140], jnp.int32), interpret=True))
    np.testing.assert_array_equal(shifted, full[50:])
    one = np.asarray(G.grouped_matmul(x[70:71], w, jnp.asarray([0, 1], jnp.int32), interpret=True))
    np.testing.assert_array_equal(one, full[70:71])


@pytest.mark.parametrize("rows", [1, 64, 200, 300])
def test_dense_decode_tilings_give_the_default_bits(rows):
    """A dense product of decode / prefill rows takes its row-count tiling (`default_config`); every one gives the bits
    of the grouped kernels' default tiling. Grouped products and large M keep the default."""
    x, w = _operands(4, rows, 1, 512, 128)
    gs = jnp.asarray([rows], jnp.int32)
    picked = np.asarray(G.grouped_matmul(x, w, gs, interpret=True))
    default = np.asarray(G.grouped_matmul(x, w, gs, interpret=True, config=G.Bf16GroupedConfig()))
    np.testing.assert_array_equal(picked.view(np.uint32), default.view(np.uint32))
    _check(picked, x, w, gs)


def test_default_config_by_rows():
    C = G.Bf16GroupedConfig
    assert G.default_config(1, 64) == C(max_concurrent_steps=5, grid_minor_dim=1)
    assert G.default_config(1, 256) == C(max_concurrent_steps=5, grid_tile_width=2, grid_minor_dim=0)
    assert G.default_config(1, 1024) == C(max_concurrent_steps=5, grid_tile_width=2, grid_minor_dim=1)
    assert G.default_config(1, 1025) == C() and G.default_config(8, 64) == C()


def test_interpret_bf16_output_and_padding_rows():
    x, w = _operands(3, 100, 4, 128, 64)
    gs = jnp.asarray([10, 0, 20, 30], jnp.int32)  # rows 60..99 belong to no group
    y = G.grouped_matmul(x, w, gs, out_dtype=BF16, interpret=True)
    assert y.dtype == BF16
    _check(y, x, w, gs, tol=1e-2)


def test_clear_errors():
    x, w = _operands(4, 8, 2, 128, 128)
    gs = jnp.asarray([4, 4], jnp.int32)
    with pytest.raises(ValueError, match="bfloat16"):
        G.grouped_matmul(x.astype(jnp.float32), w, gs, interpret=True)
    with pytest.raises(ValueError, match="multiple of 128"):
        G.grouped_matmul(x, w[:, :100], gs, interpret=True)
    with pytest.raises(ValueError, match="contracts over"):
        G.grouped_matmul(x[:, :64], w, gs, interpret=True)
    with pytest.raises(ValueError, match="layout"):
        G.grouped_matmul(x, w, gs, layout="tn", interpret=True)
    with pytest.raises(ValueError, match="group_sizes"):
        G.grouped_matmul(x, w, gs[:1], interpret=True)


@pytest.mark.gpu
@pytest.mark.parametrize("o,c", [(1536, 2048), (2048, 768), (384, 1024)])
def test_gpu_moe_shapes(o, c):
    e, m = EXPERTS, ROWS
    sizes = ragged_sizes(o)
    x, w = _operands(2, m, e, o, c)
    gs = jnp.asarray(sizes, jnp.int32)
    y = G.grouped_matmul(x, w, gs)
    _check(y, x, w, gs, tol=1e-5)
    _check(G.grouped_matmul(x, jnp.swapaxes(w, 1, 2), gs, layout="kn"), x, w, gs, tol=1e-5)
    alone = G.grouped_matmul(x[:5], w, jnp.asarray([5] + [0] * (e - 1), jnp.int32))
    np.testing.assert_array_equal(np.asarray(alone), np.asarray(y)[:5])


@pytest.mark.gpu
def test_gpu_decode_rows():
    """Decode-sized M (a few rows per expert, most experts empty): exact rows, zero tail."""
    x, w = _operands(5, 8, 32, 1536, 2048)
    gs = jnp.asarray([0] * 5 + [2, 0, 3, 1] + [0] * 23, jnp.int32)
    _check(G.grouped_matmul(x, w, gs), x, w, gs, tol=1e-5)


def test_interpret_ring_gives_each_expert_the_bits_of_its_rows_alone():
    """Groups of whole 128-row blocks, K of 5 tiles (the ring's slots do not line up with tiles): each expert's rows
    in the grouped call, whose programs walk tiles of several items and the tail's zero tiles through one TMA ring,
    have the bits of a one-group call on its rows alone (a different walk), in both layouts."""
    x, w = _operands(4, 600, 4, 256, 320)
    gs = [128, 0, 256, 128]
    for layout, ww in (("nk", w), ("kn", jnp.swapaxes(w, 1, 2))):
        y = np.asarray(G.grouped_matmul(x, ww, jnp.asarray(gs, jnp.int32), layout=layout, interpret=True))
        start = 0
        for g, size in enumerate(gs):
            if size:
                rows = slice(start, start + size)
                alone = G.grouped_matmul(x[rows], ww[g : g + 1], jnp.asarray([size], jnp.int32), layout=layout, interpret=True)
                np.testing.assert_array_equal(y[rows], np.asarray(alone))
            start += size
        assert np.all(y[512:] == 0)
