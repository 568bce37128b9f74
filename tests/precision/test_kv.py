"""The FP8 KV-cache contract (precision/kv.py) against a float64 numpy reference of its rule: a power-of-two scale
per row (the smallest with amax <= 448 s, exponent bounds), e4m3 values rounded to nearest even, exact
dequantization; edge rows (zeros, inf, NaN, subnormals, tiny and huge amax) and the straight-through gradient."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxrl_fp8.precision.kv import MIN_EXPONENT, QuantizedKV, dequantize_kv, fake_quantize_kv, quantize_kv


def _reference(x: np.ndarray):
    """float64 rule: e = the smallest integer with amax <= 448 * 2^e, clipped to [MIN_EXPONENT, 126]."""
    x = np.asarray(x, np.float64)
    x = np.where(np.abs(x) < 2.0**-126, x * 0.0, x)  # float32 subnormals flushed (sign kept), as XLA:CPU does
    amax = np.abs(x).max(axis=-1)
    with np.errstate(divide="ignore", invalid="ignore"):
        e = np.where(amax > 0, np.ceil(np.log2(amax / 448.0)), MIN_EXPONENT)
    # log2 may round at exact powers of two: step to the smallest exponent that holds amax
    e = np.where((amax > 0) & (amax <= 448.0 * 2.0 ** (e - 1)), e - 1, e)
    e = np.clip(np.nan_to_num(e), MIN_EXPONENT, 126)
    finite = np.isfinite(amax)
    scale = np.where(finite, 2.0**e, np.nan)
    with np.errstate(invalid="ignore"):
        values = (x / scale[..., None]).astype(np.float32).astype(ml_dtypes.float8_e4m3fn)
    return values, scale


def _rows(seed=0):
    rng = np.random.default_rng(seed)
    rows = [rng.normal(size=128) * 10.0 ** rng.uniform(-6, 6) for _ in range(40)]
    rows += [np.zeros(128), np.full(128, 448.0), np.full(128, 448.0 * 2**-20), np.full(128, 224.0),
             np.r_[1e-38, np.zeros(127)], np.r_[3e-40, -2e-41, np.zeros(126)],  # subnormal float32
             np.r_[3.0e38, np.ones(127)], np.r_[np.inf, np.ones(127)], np.r_[np.nan, np.ones(127)],
             np.r_[-np.inf, np.ones(127)]]
    return np.stack(rows).astype(np.float32)


def test_quantize_matches_the_float64_rule():
    x = _rows()
    got = quantize_kv(jnp.asarray(x))
    values, scale = _reference(x)
    np.testing.assert_array_equal(np.asarray(got.scales), scale.astype(np.float32))
    np.testing.assert_array_equal(np.asarray(got.values).view(np.uint8)[np.isfinite(scale)],
                                  values.view(np.uint8)[np.isfinite(scale)])
    bad = ~np.isfinite(scale)
    assert bad.sum() == 3 and np.isnan(np.asarray(got.dequantize())[bad]).all()  # inf / NaN rows: NaN everywhere


def test_scales_are_powers_of_two_and_use_the_range():
    x = _rows()[:40]
    q = quantize_kv(jnp.asarray(x))
    s = np.asarray(q.scales, np.float64)
    assert (np.frexp(s)[0] == 0.5).all()  # powers of two
    amax = np.abs(x).max(-1)
    assert (amax <= 448 * s).all() and (amax > 224 * s).all()  # the smallest such power: amax in (224 s, 448 s]


def test_dequantize_is_exact_and_never_subnormal():
    x = _rows()
    q = quantize_kv(jnp.asarray(x))
    exact = np.asarray(q.values).astype(np.float64) * np.asarray(q.scales, np.float64)[:, None]
    for dtype in (jnp.float32, jnp.bfloat16):
        got = np.asarray(dequantize_kv(q.values, q.scales, dtype).astype(jnp.float32), np.float64)
        ok = np.isfinite(exact)
        np.testing.assert_array_equal(got[ok], exact[ok])
    nonzero = np.abs(exact[np.isfinite(exact) & (exact != 0)])
    assert nonzero.min() >= 2.0**-126  # a normal BF16 number: no flush-to-zero can touch it


def test_zero_rows_and_tiny_rows():
    x = jnp.zeros((3, 64), jnp.float32).at[1, 5].set(1e-38).at[2, 0].set(-5e-30)
    q = quantize_kv(x)
    assert not np.asarray(q.values[0].astype(jnp.float32)).any()
    assert float(q.scales[0]) == float(q.scales[1]) == 2.0**MIN_EXPONENT  # zeros; 1e-38 (subnormal) flushed or tiny
    d = np.asarray(q.dequantize())
    assert d[0].sum() == 0 and d[1, 5] in (0.0, 2.0**-126)
    assert d[2, 0] < 0 and abs(d[2, 0] / -5e-30 - 1) < 2**-3  # within e4m3's relative step


def test_any_shape_any_dtype_one_row():
    x = jax.random.normal(jax.random.key(1), (2, 3, 4, 128)).astype(jnp.bfloat16)
    q = quantize_kv(x)
    assert q.values.shape == x.shape and q.scales.shape == x.shape[:-1] and q.values.dtype == jnp.float8_e4m3fn
    one = quantize_kv(x[0, 0, :1])  # M = 1
    np.testing.assert_array_equal(np.asarray(one.scales), np.asarray(q.scales[0, 0, :1]))
    err = np.abs(np.asarray(q.dequantize(), np.float64) - np.asarray(x, np.float64))
    amax = np.abs(np.asarray(x, np.float64)).max(-1, keepdims=True)
    assert (err <= amax * 2**-3).all()  # e4m3: 3 mantissa bits under a scale that at most doubles amax's range


def test_fake_quantize_is_idempotent_with_a_straight_through_gradient():
    x = jax.random.normal(jax.random.key(2), (4, 16, 2, 128)) * 3
    once = fake_quantize_kv(x)
    np.testing.assert_array_equal(np.asarray(fake_quantize_kv(once)), np.asarray(once))
    np.testing.assert_array_equal(np.asarray(once), np.asarray(quantize_kv(x).dequantize(x.dtype)))
    g = jax.grad(lambda x: (fake_quantize_kv(x) * jnp.arange(128.0)).sum())(x)
    np.testing.assert_array_equal(np.asarray(g), np.broadcast_to(np.arange(128.0), x.shape))


def test_quantized_kv_is_a_pytree():
    q = quantize_kv(jnp.ones((2, 64)))
    leaves = jax.tree.leaves(q)
    assert len(leaves) == 2 and isinstance(jax.tree.map(lambda a: a, q), QuantizedKV)


@pytest.mark.parametrize("bad", ["fp16", "int8", ""])
def test_bad_kv_cache_names_itself(bad):
    from jaxrl_fp8.precision import PrecisionPolicy, get_recipe

    with pytest.raises(ValueError, match="kv_cache"):
        get_recipe("fp8_block", kv_cache=bad)
    with pytest.raises(ValueError, match="PrecisionPolicy.kv_cache"):
        PrecisionPolicy(fmt="bf16", num_layers=1, kv_cache=bad)
