"""ops.linear on the XLA path: block math vs float64, row invariance (bitwise), backward modes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_fp8 import ops
from jaxrl_fp8.ops import reference as R
from jaxrl_fp8.precision.fp8 import dequantize_fp8_per_block, quantize_fp8_per_block, quantize_fp8_per_token_group
from jaxrl_fp8.precision.quantized import QuantizedWeight, quantize_dequantize_activation, quantize_weight

FMTS = ["bf16", "fp8-block", "mxfp8", "nvfp4"]


def _data(seed, m, n, k, xdtype=jnp.bfloat16):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((m, k)) * rng.uniform(0.1, 4.0, (m, 1)), xdtype)
    w = jnp.asarray(rng.standard_normal((n, k)) * 0.05, jnp.float32)
    return x, w


def _emulated_ref(x, w, fmt):
    """float64 product of exactly the operand values each format feeds its GEMM."""
    if fmt == "bf16":
        return np.asarray(x.astype(jnp.float32), np.float64) @ np.asarray(w.astype(jnp.bfloat16).astype(jnp.float32), np.float64).T
    if fmt == "fp8-block":
        xq, sa = quantize_fp8_per_token_group(x, 128)
        wq, sb = quantize_fp8_per_block(w, (128, 128))
        return R.block_scaled_matmul(xq, sa, wq, sb)
    xd = quantize_dequantize_activation(x, fmt, dtype=jnp.float32).astype(jnp.bfloat16)
    wd = quantize_weight(w, fmt).dequantize(jnp.float32).astype(jnp.bfloat16)
    return np.asarray(xd, np.float64) @ np.asarray(wd, np.float64).T


@pytest.mark.parametrize(
    "fmt,m,n,k",
    [(f, *s) for f in ("bf16", "fp8-block") for s in [(1, 128, 128), (5, 256, 384), (33, 128, 200), (64, 200, 256)]]
    + [("mxfp8", 5, 256, 384), ("nvfp4", 33, 128, 200)],
)
def test_forward_matches_float64_block_math(fmt, m, n, k):
    x, w = _data(m * 7 + n + k, m, n, k)
    y = ops.linear(x, w, fmt=fmt, backend="xla", out_dtype=jnp.float32)
    assert y.shape == (m, n) and y.dtype == jnp.float32
    assert R.rel_err(y, _emulated_ref(x, w, fmt)) < 2e-6


def test_quantized_weight_input_equals_master_input():
    x, w = _data(1, 9, 256, 256)
    qw = quantize_weight(w, "fp8-block")
    a = ops.linear(x, w, fmt="fp8-block", out_dtype=jnp.float32)
    b = ops.linear(x, qw, fmt="fp8-block", out_dtype=jnp.float32)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_leading_axes_and_dtypes():
    x, w = _data(2, 12, 128, 256)
    y = ops.linear(x.reshape(3, 4, 256), w, fmt="fp8-block")
    assert y.shape == (3, 4, 128) and y.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(y.reshape(12, 128)), np.asarray(ops.linear(x, w, fmt="fp8-block")))


@pytest.mark.parametrize("fmt", [pytest.param("bf16", marks=pytest.mark.row_invariant_cpu), "fp8-block"])
def test_row_invariance_bitwise(fmt):
    """A row computed alone equals the same row inside batches of several sizes and positions."""
    x, w = _data(3, 130, 256, 512)
    f = jax.jit(lambda x: ops.linear(x, w, fmt=fmt, backend="xla", out_dtype=jnp.float32))
    full = np.asarray(f(x))
    for i in [0, 17, 129]:
        alone = np.asarray(f(x[i : i + 1]))[0]
        np.testing.assert_array_equal(alone, full[i])
    for m in [2, 3, 8, 64, 100]:
        np.testing.assert_array_equal(np.asarray(f(x[:m])), full[:m])
        np.testing.assert_array_equal(np.asarray(f(x[130 - m :])), full[130 - m :])


def test_bad_inputs_name_the_problem():
    x, w = _data(4, 4, 128, 256)
    with pytest.raises(ValueError, match="K=256"):
        ops.linear(x, w[:, :128])
    with pytest.raises(ValueError, match="fmt"):
        ops.linear(x, w, fmt="fp16")
    with pytest.raises(ValueError, match="backward"):
        ops.linear(x, w, backward="exact")
    with pytest.raises(ValueError, match="backend"):
        ops.linear(x, w, backend="cuda")
    with pytest.raises(ValueError, match="QuantizedWeight"):
        ops.linear(x, quantize_weight(w, "mxfp8"), fmt="fp8-block")
    with pytest.raises(ValueError, match="multiples of 128"):
        ops.linear(x[:, :200], w[:, :200], fmt="fp8-block", backend="interpret")


# ---- gradients -------------------------------------------------------------------------------------------


def _ste(v, v_hat):
    """Straight-through: the value of v_hat, the gradient of v."""
    return v + jax.lax.stop_gradient(v_hat - v)


def _ref_grads(x, w, c, fmt, backward):
    """Autodiff of the reference forward (float32, straight-through quantizers) for the given backward mode."""
    x32 = x.astype(jnp.float32)
    if backward == "high_precision" or fmt == "bf16":
        f = lambda x, w: jnp.dot(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16).T, preferred_element_type=jnp.float32)
    else:
        if fmt == "fp8-block":
            xq, sa = quantize_fp8_per_token_group(x32, 128)
            xd = (xq.astype(jnp.float32).reshape(x.shape[0], -1, 128) * sa[..., None]).reshape(x.shape)
            wq, sb = quantize_fp8_per_block(w, (128, 128))
            wd = dequantize_fp8_per_block(wq, sb)
        else:
            xd = quantize_dequantize_activation(x32, fmt, dtype=jnp.float32)
            wd = quantize_weight(w, fmt).dequantize(jnp.float32)
        f = lambda x, w: jnp.dot(
            _ste(x, xd).astype(jnp.bfloat16), _ste(w, wd).astype(jnp.bfloat16).T, preferred_element_type=jnp.float32
        )
    return jax.grad(lambda x, w: jnp.sum(f(x, w) * c), argnums=(0, 1))(x32, w)


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("backward", ["high_precision", "dequantized", "fp8"])
def test_gradients_vs_autodiff_of_reference(fmt, backward):
    m, n, k = 48, 256, 384
    x, w = _data(11, m, n, k, jnp.float32)
    c = jnp.asarray(np.random.default_rng(5).standard_normal((m, n)), jnp.float32)
    gx, gw = jax.grad(lambda x, w: jnp.sum(ops.linear(x, w, fmt=fmt, backward=backward, backend="xla") * c), argnums=(0, 1))(x, w)
    rx, rw = _ref_grads(x, w, c, fmt, "high_precision" if backward == "fp8" else backward)
    # bf16 operands: <1e-2; the fp8 mode also quantizes the gradient operands (e4m3: ~3% per element).
    tol = 6e-2 if backward == "fp8" else 1e-2
    assert R.rel_err(gx, rx) < tol and R.rel_err(gw, rw) < tol
    assert gw.dtype == w.dtype and gx.dtype == x.dtype


def test_fp8_backward_is_the_block_math():
    """fp8 mode: dgrad/wgrad equal the float64 block math on operands quantized along each contraction axis."""
    m, n, k = 160, 256, 384
    x, w = _data(12, m, n, k, jnp.float32)
    c = jnp.asarray(np.random.default_rng(6).standard_normal((m, n)), jnp.float32)
    gx, gw = jax.grad(lambda x, w: jnp.sum(ops.linear(x, w, fmt="fp8-block", backward="fp8", backend="xla") * c), argnums=(0, 1))(x, w)
    cq, sc = quantize_fp8_per_token_group(c, 128)
    wq, sb = quantize_fp8_per_block(w, (128, 128))
    np.testing.assert_array_less(R.rel_err(gx, R.block_scaled_matmul(cq, sc, np.asarray(wq).T, np.asarray(sb).T)), 2e-6)
    pad = (-m) % 128
    ct = jnp.pad(c, [(0, pad), (0, 0)]).T
    xt = jnp.pad(x, [(0, pad), (0, 0)]).T
    ctq, sct = quantize_fp8_per_token_group(ct, 128)
    xtq, sxt = quantize_fp8_per_token_group(xt, 128)
    np.testing.assert_array_less(R.rel_err(gw, R.block_scaled_matmul(ctq, sct, xtq, sxt, b_rows_per_scale=1)), 2e-6)


def test_quantized_weight_gets_zero_cotangent():
    x, w = _data(13, 8, 128, 128, jnp.float32)
    qw = quantize_weight(w, "nvfp4")
    gx, gq = jax.grad(lambda x, q: jnp.sum(ops.linear(x, q, fmt="nvfp4")), argnums=(0, 1), allow_int=True)(x, qw)
    assert isinstance(gq, QuantizedWeight) and float(jnp.abs(gx).sum()) > 0
