"""FP8 per-token-group / per-block / per-tensor quantizers: bitwise against the numpy statement of the rule."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxrl_fp8 import precision as P
from tests.precision import np_reference as R

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2


def bits(a):
    a = np.asarray(a)
    return a.view(np.uint8) if a.dtype.itemsize == 1 else a.view(np.uint32)


def assert_bitwise(actual, expected):
    np.testing.assert_array_equal(bits(actual), bits(np.asarray(expected, dtype=np.asarray(actual).dtype)))


def rand(shape, seed, spread=True):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32)
    if spread:  # blocks of very different magnitude exercise the per-block scales
        x *= np.exp2(rng.integers(-20, 20, size=shape[:-1] + (1,))).astype(np.float32)
    return x


@pytest.mark.parametrize("shape", [(1, 128), (1, 1), (3, 300), (2, 5, 257), (7, 384), (4, 64)])
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("pow2", [False, True])
def test_per_token_group_bitwise(shape, dtype, pow2):
    x = rand(shape, hash((shape, pow2)) % 2**31)
    q, s = P.quantize_fp8_per_token_group(x, 128, dtype=dtype, pow2_scale=pow2)
    rq, rs = R.fp8_group(x, 128, np.dtype(dtype), pow2)
    assert q.shape == x.shape and q.dtype == dtype
    assert s.shape == x.shape[:-1] + (-(-shape[-1] // 128),) and s.dtype == jnp.float32
    assert_bitwise(s, rs)
    assert_bitwise(q, rq)


@pytest.mark.parametrize("shape", [(128, 128), (200, 300), (3, 130, 129), (1, 1), (256, 1024), (2, 2, 128, 256)])
@pytest.mark.parametrize("pow2", [False, True])
def test_per_block_bitwise(shape, pow2):
    w = rand(shape, 7 + len(shape))
    q, s = P.quantize_fp8_per_block(w, (128, 128), pow2_scale=pow2)
    rq, rs = R.fp8_block(w, 128, 128, np.dtype(E4M3), pow2)
    assert s.shape == shape[:-2] + (-(-shape[-2] // 128), -(-shape[-1] // 128))
    assert_bitwise(s, rs)
    assert_bitwise(q, rq)


def test_dequantize_inverts_layout_and_crops():
    x = rand((5, 300), 3)
    q, s = P.quantize_fp8_per_token_group(x)
    xh = P.dequantize_fp8_per_token_group(q, s)
    expected = (np.pad(np.asarray(q, np.float32), [(0, 0), (0, 84)]).reshape(5, 3, 128) * np.asarray(s)[..., None]).reshape(5, 384)[:, :300]
    assert_bitwise(xh, expected)
    w = rand((130, 260), 4)
    qw, sw = P.quantize_fp8_per_block(w)
    wh = np.asarray(P.dequantize_fp8_per_block(qw, sw))
    blockwise = np.asarray(qw, np.float32) * np.repeat(np.repeat(np.asarray(sw), 128, 0), 128, 1)[:130, :260]
    assert_bitwise(wh, blockwise)
    with pytest.raises(ValueError, match="scale_inv shape"):
        P.dequantize_fp8_per_block(qw, sw[:, :1])


def test_zero_blocks_give_zero_and_finite_scale():
    w = rand((256, 256), 5)
    w[:128, 128:] = 0.0
    q, s = P.quantize_fp8_per_block(w)
    assert np.isfinite(np.asarray(s)).all()
    assert float(s[0, 1]) == np.float32(np.float32(1e-10) / np.float32(448))
    assert not np.asarray(q[:128, 128:], np.float32).any()
    x = np.zeros((2, 256), np.float32)
    q, s = P.quantize_fp8_per_token_group(x)
    assert np.isfinite(np.asarray(s)).all() and not np.asarray(q, np.float32).any()


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nonfinite_poisons_only_its_block(bad):
    w = rand((256, 384), 6)
    clean_q, clean_s = P.quantize_fp8_per_block(w)
    w[3, 200] = bad  # block (0, 1)
    q, s = P.quantize_fp8_per_block(w)
    s, clean_s = np.asarray(s), np.asarray(clean_s)
    assert np.isnan(s[0, 1])
    assert np.isnan(np.asarray(q[:128, 128:256], np.float32)).all()
    mask = np.ones_like(s, bool)
    mask[0, 1] = False
    np.testing.assert_array_equal(s[mask], clean_s[mask])
    qa, qc = np.asarray(q, np.float32), np.asarray(clean_q, np.float32)
    qa[:128, 128:256] = 0
    qc[:128, 128:256] = 0
    np.testing.assert_array_equal(qa, qc)
    # activations: same rule per 1x128 group
    x = rand((2, 256), 8)
    x[1, 5] = bad
    q, s = P.quantize_fp8_per_token_group(x)
    assert np.isnan(np.asarray(s)[1, 0]) and np.isfinite(np.asarray(s)[[0, 0, 1], [0, 1, 1]]).all()
    assert np.isnan(np.asarray(q[1, :128], np.float32)).all() and np.isfinite(np.asarray(q[1, 128:], np.float32)).all()


def test_saturation_subnormals_and_negative_zero():
    x = np.zeros((1, 128), np.float32)
    x[0, 0], x[0, 1], x[0, 2], x[0, 3] = 3.0, -3.0, -0.0, 1e-40  # 1e-40 is an fp32 subnormal
    q, s = P.quantize_fp8_per_token_group(x)
    qf = np.asarray(q, np.float32)
    assert qf[0, 0] == 448.0 and qf[0, 1] == -448.0  # the amax maps exactly to +-fmax
    assert bits(q)[0, 2] == 0x80  # -0 keeps its sign
    assert qf[0, 3] == 0.0
    # E4M3 subnormal outputs: values 2^-9 * s must survive as the smallest subnormal
    y = np.zeros((1, 128), np.float32)
    y[0, 0] = 448.0
    y[0, 1] = 2.0**-9
    y[0, 2] = 2.0**-11  # below half the smallest subnormal -> 0
    q, s = P.quantize_fp8_per_token_group(y)
    assert float(s[0, 0]) == 1.0
    assert np.asarray(q, np.float32)[0, 1] == 2.0**-9 and np.asarray(q, np.float32)[0, 2] == 0.0
    assert_bitwise(q, R.fp8_group(y, 128, np.dtype(E4M3))[0])


def test_per_tensor_and_channel():
    x = rand((64, 200), 9)
    q, s = P.quantize_fp8_per_tensor(x)
    assert s.shape == ()
    expect_s = np.float32(np.abs(x).max()) / np.float32(448)
    assert float(s) == expect_s
    assert_bitwise(q, np.clip(x / expect_s, -448, 448).astype(ml_dtypes.float8_e4m3fn))
    qc, sc = P.quantize_fp8_per_channel(x)
    assert sc.shape == (64, 1)
    assert_bitwise(sc[:, 0], (np.abs(x).max(1) / np.float32(448)).astype(np.float32))
    xh = np.asarray(P.dequantize_fp8_per_channel(qc, sc))
    assert (np.abs(xh - x) <= _fp8_error_bound(x, np.asarray(sc), 3, 2.0**-9)).all()


def _fp8_error_bound(x, s, mant_bits, min_sub):
    """RNE error of a scaled value y = x / s: half an ulp of y's binade (or of the subnormal spacing)."""
    y = np.abs(x / s)
    ulp = np.exp2(np.floor(np.log2(np.maximum(y, 1e-30))) - mant_bits)
    return s * np.maximum(ulp, min_sub) / 2 * 1.0001 + 1e-30


@pytest.mark.parametrize("seed", range(5))
def test_dequantize_quantize_error_bound(seed):
    """Property: every element's error is within half an E4M3 ulp of its scaled value (per block)."""
    rng = np.random.default_rng(seed)
    shape = (int(rng.integers(1, 300)), int(rng.integers(1, 400)))
    x = rand(shape, seed + 100) * rng.choice([1e-6, 1.0, 1e4])
    q, s = P.quantize_fp8_per_token_group(x)
    xh = np.asarray(P.dequantize_fp8_per_token_group(q, s))
    s_full = np.repeat(np.asarray(s), 128, -1)[:, : shape[1]]
    assert (np.abs(xh - x) <= _fp8_error_bound(x, s_full, 3, 2.0**-9)).all()
    qb, sb = P.quantize_fp8_per_block(x)
    xb = np.asarray(P.dequantize_fp8_per_block(qb, sb))
    sb_full = np.repeat(np.repeat(np.asarray(sb), 128, 0), 128, 1)[: shape[0], : shape[1]]
    assert (np.abs(xb - x) <= _fp8_error_bound(x, sb_full, 3, 2.0**-9)).all()


def test_ieee_div_is_correctly_rounded():
    rng = np.random.default_rng(0)
    a = (rng.random(50000) * 1000).astype(np.float32)
    b = (rng.random(50000) * 10 + 0.1).astype(np.float32)
    assert_bitwise(P.ieee_div(a, b), a / b)
    assert_bitwise(P.ieee_div(a, 448.0), a / np.float32(448))
    for one in (1.0, 1, np.float32(1.0)):  # a concrete divisor of 1: the dividend itself, no division in the program
        assert_bitwise(P.ieee_div(a, one), a / np.float32(1))
        assert "divide" not in jax.jit(lambda x, one=one: P.ieee_div(x, one)).lower(a).as_text()
    c = np.concatenate([np.exp2(np.arange(-120, 120)), rng.random(1000) * 1e6]).astype(np.float32)
    assert_bitwise(P.ceil_pow2(c), R.pow2_ceil(c))
