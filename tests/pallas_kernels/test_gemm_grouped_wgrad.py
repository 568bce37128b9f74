"""Grouped FP8 wgrad kernel: experts sharing 128-row quantization blocks, empty experts, tail rows; interpret and H200."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_fp8.ops import grouping, reference as R
from jaxrl_fp8.precision.fp8 import dequantize_fp8_per_token_group, quantize_fp8_per_token_group
from pallas_kernels import gemm_grouped_wgrad as W
from tests.pallas_kernels.moe_data import EXPERTS, ROWS, ragged_sizes


def _operands(seed, m, n, k):
    """dy [m, n], x [m, k] -> their 1x128 quantization along M (rows zero-padded to 128), as the backward makes them."""
    rng = np.random.default_rng(seed)
    dy = jnp.asarray(rng.standard_normal((m, n)) * rng.uniform(0.01, 10.0, (m, 1)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    pad = lambda a: jnp.pad(a, [(0, (-m) % 128), (0, 0)])
    return (*quantize_fp8_per_token_group(pad(dy).T, 128), *quantize_fp8_per_token_group(pad(x).T, 128))


def _float64(dq, ds, xq, xs, gs, e, m):
    """dw[g] = dy^[rows of g]^T . x^[rows of g] of the dequantized operands, in float64."""
    dy = np.asarray(dequantize_fp8_per_token_group(dq, ds, 128), np.float64).T[:m]
    x = np.asarray(dequantize_fp8_per_token_group(xq, xs, 128), np.float64).T[:m]
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


def test_clear_errors():
    dq, ds, xq, xs = _operands(0, 64, 128, 128)
    gs = jnp.asarray([64], jnp.int32)
    with pytest.raises(ValueError, match="multiples of 128"):
        W.grouped_wgrad_fp8(dq[:100], ds[:100], xq, xs, gs, 1, interpret=True)
    with pytest.raises(ValueError, match="group_sizes"):
        W.grouped_wgrad_fp8(dq, ds, xq, xs, gs, 2, interpret=True)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        W.grouped_wgrad_fp8(dq.astype(jnp.float32), ds, xq, xs, gs, 1, interpret=True)


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
