"""MXFP8 and NVFP4 quantizers: bitwise against the numpy statement, packing, pairing, edge cases, bounds."""

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxrl_fp8 import precision as P
from jaxrl_fp8.precision import nvfp4 as NV
from tests.precision import np_reference as R
from tests.precision.test_fp8 import assert_bitwise, rand


@pytest.mark.parametrize("shape", [(1, 32), (3, 100), (2, 4, 256), (1, 1)])
def test_mxfp8_bitwise_and_scale_byte(shape):
    x = rand(shape, 11)
    q, e = P.quantize_mxfp8(x, 32)
    rq, rs = R.fp8_group(x, 32, np.dtype(jnp.float8_e4m3fn), pow2=True)
    assert e.dtype == jnp.uint8 and e.shape == shape[:-1] + (-(-shape[-1] // 32),)
    assert_bitwise(q, rq)
    np.testing.assert_array_equal(np.exp2(np.asarray(e, np.float64) - 127), rs)  # byte b means 2^(b-127)
    # no value saturates: |x / s| <= 448 always (the point of the ceil rule)
    xs = np.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, (-shape[-1]) % 32)]).reshape(*shape[:-1], -1, 32)
    assert (np.abs(xs / rs[..., None]) <= 448).all()
    np.testing.assert_array_equal(np.asarray(P.dequantize_mxfp8(q, e)), np.asarray(P.dequantize_fp8_per_token_group(q, jnp.asarray(rs), 32)))


def test_e8m0_edges():
    b = jnp.array([0, 1, 126, 127, 128, 254, 255], jnp.uint8)
    f = np.asarray(P.e8m0_to_float(b))
    assert f[0] == 2.0**-127 and f[1] == 2.0**-126 and f[3] == 1.0 and f[5] == 2.0**127 and np.isnan(f[6])
    np.testing.assert_array_equal(np.asarray(P.float_to_e8m0(f[:6])), np.asarray(b[:6]))


def test_e2m1_rounding_matches_ml_dtypes_including_ties():
    ties = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], np.float32)
    vals = np.concatenate([ties, -ties, np.linspace(-6, 6, 4801, dtype=np.float32), [0.0, -0.0, 6.0, -6.0]]).astype(np.float32)
    codes = np.asarray(NV.e2m1_codes(jnp.asarray(vals)))
    expect = np.asarray(vals.astype(ml_dtypes.float4_e2m1fn)).view(np.uint8) & 0xF
    np.testing.assert_array_equal(codes, expect)
    np.testing.assert_array_equal(np.asarray(NV.e2m1_values(codes)), vals.astype(ml_dtypes.float4_e2m1fn).astype(np.float32))


def test_nibble_packing_low_first():
    codes = jnp.array([[1, 2, 3, 4]], jnp.uint8)
    packed = np.asarray(NV.pack_nibbles(codes))
    assert packed.tolist() == [[0x21, 0x43]]
    np.testing.assert_array_equal(np.asarray(NV.unpack_nibbles(packed)), np.asarray(codes))


@pytest.mark.parametrize("shape", [(4, 64), (3, 50), (2, 8, 160), (1, 16)])
@pytest.mark.parametrize("fos", [False, True])
def test_nvfp4_bitwise(shape, fos):
    x = rand(shape, 21, spread=False) * np.float32(3.0)
    packed, bs, g = P.quantize_nvfp4(x, four_over_six=fos)
    rc, rbs, rg = R.nvfp4(x, four_over_six=fos)
    kp = -(-shape[-1] // 16) * 16
    assert packed.shape == shape[:-1] + (kp // 2,) and packed.dtype == jnp.uint8
    assert bs.shape == shape[:-1] + (kp // 16,) and bs.dtype == jnp.float8_e4m3fn
    assert_bitwise(g, rg)
    assert_bitwise(bs, rbs)
    np.testing.assert_array_equal(np.asarray(NV.unpack_nibbles(packed)), rc)
    xh = np.asarray(P.dequantize_nvfp4(packed, bs, g, k=shape[-1]))
    assert xh.shape == x.shape
    d = np.repeat(np.asarray(bs, np.float32) * np.asarray(g), 16, -1)[..., : shape[-1]]
    y = np.abs(x) / d
    assert (np.abs(xh - x) <= d * (np.maximum(0.25, 0.25 * y) + 0.4) + 1e-30).all()


def test_nvfp4_per_row_and_per_expert_global():
    x = rand((3, 5, 64), 22)
    rows = P.nvfp4_global_amax(x, per_row=True)
    assert rows.shape == (3, 5)
    packed, bs, g = P.quantize_nvfp4(x, global_amax=rows)
    assert g.shape == (3, 5)
    for i in range(3):
        p1, b1, g1 = P.quantize_nvfp4(x[i, 2], global_amax=rows[i, 2])
        assert_bitwise(packed[i, 2], p1)
        assert_bitwise(bs[i, 2], b1)
    qw = P.quantize_weight(x, "nvfp4")  # an [E, N, K] stack: one global per expert
    assert qw.global_scale.shape == (3,)
    p0 = P.quantize_nvfp4(x[1])
    assert_bitwise(qw.data[1], p0[0])


def test_nvfp4_pair_shares_global_scale():
    gate, up = rand((32, 64), 23, spread=False), rand((32, 64), 24, spread=False) * 5
    (pg, bg, gg), (pu, bu, gu) = P.quantize_nvfp4_pair(gate, up)
    assert float(gg) == float(gu) == np.float32(np.float32(max(np.abs(gate).max(), np.abs(up).max())) / np.float32(2688))


def test_nvfp4_zero_and_nonfinite_blocks():
    x = rand((2, 64), 25, spread=False)
    x[0, :16] = 0.0
    x[1, 20] = np.nan
    packed, bs, g = P.quantize_nvfp4(x)
    xh = np.asarray(P.dequantize_nvfp4(packed, bs, g))
    assert np.isfinite(np.asarray(g))
    assert (xh[0, :16] == 0).all()
    assert np.isnan(xh[1, 16:32]).all()  # only the poisoned block
    assert np.isfinite(np.delete(xh[1], np.s_[16:32])).all() and np.isfinite(xh[0]).all()
    clean = x.copy()
    clean[1, 16:32] = 0
    xc = np.asarray(P.dequantize_nvfp4(*P.quantize_nvfp4(clean)))
    np.testing.assert_array_equal(np.delete(xh[1], np.s_[16:32]), np.delete(xc[1], np.s_[16:32]))


def test_four_over_six_never_worse_per_block():
    x = rand((64, 128), 26, spread=False)
    for fos in (False, True):
        p, b, g = P.quantize_nvfp4(x, four_over_six=fos)
        err = (np.asarray(P.dequantize_nvfp4(p, b, g)) - x) ** 2
        if fos:
            err_fos = err.reshape(64, 8, 16).sum(-1)
        else:
            err_six = err.reshape(64, 8, 16).sum(-1)
    assert err_fos.sum() < err_six.sum()


@pytest.mark.parametrize("fmt", ["fp8-block", "mxfp8", "nvfp4"])
def test_quantized_weight_roundtrip_and_activation(fmt):
    w = rand((2, 256, 192), 27, spread=False)
    qw = P.quantize_weight(w, fmt)
    assert qw.shape == w.shape
    wh = np.asarray(qw.dequantize())
    rel = np.linalg.norm(wh - w) / np.linalg.norm(w)
    assert rel < {"fp8-block": 0.04, "mxfp8": 0.04, "nvfp4": 0.15}[fmt]
    x = rand((5, 192), 28, spread=False)
    xh = np.asarray(P.quantize_dequantize_activation(x, fmt))
    assert np.linalg.norm(xh - x) / np.linalg.norm(x) < {"fp8-block": 0.04, "mxfp8": 0.04, "nvfp4": 0.15}[fmt]
    np.testing.assert_array_equal(np.asarray(P.quantize_dequantize_activation(x, "bf16", dtype=jnp.float32)), x)


# A block whose e4m3 scale sits at a tie only one rounding away: (amax / 6) / g = 200.00002 rounds up to
# 208, while the product form amax / (6 * g) = 200.0 is a tie that rounds to the even 192. XLA's algebraic simplifier
# rewrites the first into the second unless the contract stops it; eager dispatch never shows it.
_TIE_BLOCK = [0xBF077BD3, 0x3D851FB3, 0xBF72566F, 0x3EE10633, 0xBF8EFC8B, 0x3F263569, 0xBF827BF3, 0x3E8A6477,
              0xBF7B9E0D, 0x3F3BCBEB, 0x3FE4924A, 0x3E899B96, 0xBF4F295B, 0xBFA21A8C, 0xBF358D1D, 0x3F98FEC7]


@pytest.mark.parametrize("fos", [False, True])
def test_nvfp4_jitted_keeps_the_two_scale_divisions(fos):
    """Jitted (as every caller runs it) == eager == the numpy statement, on the tie block and random blocks."""
    import jax

    tie = np.array(_TIE_BLOCK, np.uint32).view(np.float32)
    x = np.concatenate([tie[None], rand((63, 16), 5, spread=False) * np.float32(2.0)]).reshape(16, 64)
    rc, rbs, rg = R.nvfp4(x, global_amax=np.float32(4.0), four_over_six=fos)
    run = lambda a: P.quantize_nvfp4(a, global_amax=4.0, four_over_six=fos)
    for packed, bs, g in (jax.jit(run)(x), run(x)):
        assert_bitwise(g, rg)
        assert_bitwise(bs, rbs)
        np.testing.assert_array_equal(np.asarray(NV.unpack_nibbles(packed)), rc)
    if not fos:
        assert np.asarray(jax.jit(run)(x)[1]).view(np.uint8)[0, 0] == 0x75  # 208, the correctly rounded scale


@pytest.mark.parametrize("which", ["token_group", "block", "mxfp8", "nvfp4"])
def test_quantizers_jitted_equal_numpy(which):
    """The jitted quantizers against the numpy statement on random data (the other tests run them eagerly)."""
    import jax

    x = rand((64, 256), 17) * np.float32(5.0)
    if which == "token_group":
        got, want = jax.jit(lambda a: P.quantize_fp8_per_token_group(a, 128))(x), R.fp8_group(x, 128, np.dtype(jnp.float8_e4m3fn), pow2=False)
    elif which == "block":
        got, want = jax.jit(lambda a: P.quantize_fp8_per_block(a, (128, 128)))(x), R.fp8_block(x, 128, 128, np.dtype(jnp.float8_e4m3fn), pow2=False)
    elif which == "mxfp8":
        q, e = jax.jit(lambda a: P.quantize_mxfp8(a, 32))(x)
        rq, rs = R.fp8_group(x, 32, np.dtype(jnp.float8_e4m3fn), pow2=True)
        got, want = (q, np.exp2(np.asarray(e, np.float64) - 127).astype(np.float32)), (rq, rs)
    else:
        packed, bs, g = jax.jit(P.quantize_nvfp4)(x)
        rc, rbs, rg = R.nvfp4(x)
        got, want = (NV.unpack_nibbles(packed), bs, g), (rc, rbs, rg)
    for a, b in zip(got, want):
        assert_bitwise(a, b)
