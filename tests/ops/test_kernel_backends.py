"""ops with backend="interpret" (the Pallas kernels on CPU) and "mosaic" (-m gpu) against the XLA path."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_fp8 import ops
from jaxrl_fp8.ops import reference as R


def _data(seed, m, n, k, e=None):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    shape = (n, k) if e is None else (e, n, k)
    return x, jnp.asarray(rng.standard_normal(shape) * 0.05, jnp.float32)


GPU_TOL = 1e-3


def _grads(fn, x, w, c, backend, backward):
    return jax.grad(lambda x, w: jnp.sum(fn(x, w, backend, backward) * c), argnums=(0, 1))(x, w)


def test_interpret_linear_fp8_backward_matches_xla():
    """Forward, dgrad and wgrad through the dense kernel in interpret mode equal the XLA block math."""
    x, w = _data(0, 40, 128, 256)
    c = jnp.asarray(np.random.default_rng(1).standard_normal((40, 128)), jnp.float32)
    fn = lambda x, w, be, bw: ops.linear(x, w, fmt="fp8-block", backward=bw, backend=be)
    for a, b in zip(_grads(fn, x, w, c, "interpret", "fp8"), _grads(fn, x, w, c, "xla", "fp8")):
        assert R.rel_err(a, b) < 1e-6
    assert R.rel_err(fn(x, w, "interpret", "fp8"), fn(x, w, "xla", "fp8")) < 1e-6


def test_interpret_grouped_fp8_backward_matches_xla():
    """The grouped fp8 backward with the wgrad kernel (interpret mode) against the XLA path."""
    x, w = _data(11, 200, 128, 256, e=4)
    gs = jnp.asarray([50, 0, 120, 10], jnp.int32)  # 20 padding rows past the groups
    c = jnp.asarray(np.random.default_rng(12).standard_normal((200, 128)), jnp.float32)
    fn = lambda x, w, be, bw: ops.grouped_linear(x, w, gs, fmt="fp8-block", backward=bw, backend=be)
    for a, b in zip(_grads(fn, x, w, c, "interpret", "fp8"), _grads(fn, x, w, c, "xla", "fp8")):
        assert R.rel_err(a, b) < 1e-6


@pytest.mark.parametrize("fmt,backward", [("fp8-block", "fp8"), ("bf16", "high_precision")])
def test_interpret_grouped_wgrad_of_bf16_weights_is_bf16(fmt, backward):
    """BF16 weights (the trainer's compute dtype): the wgrad kernels store their float32 sums rounded to BF16 (no
    float32 [E, N, K] in memory), the values of the XLA path's float32 result cast."""
    x, w = _data(13, 200, 128, 256, e=4)
    w = w.astype(jnp.bfloat16)
    gs = jnp.asarray([50, 0, 120, 10], jnp.int32)
    c = jnp.asarray(np.random.default_rng(14).standard_normal((200, 128)), jnp.float32)
    fn = lambda x, w, be, bw: ops.grouped_linear(x, w, gs, fmt=fmt, backward=bw, backend=be)
    (_, dw_kernel), (_, dw_xla) = _grads(fn, x, w, c, "interpret", backward), _grads(fn, x, w, c, "xla", backward)
    assert dw_kernel.dtype == dw_xla.dtype == jnp.bfloat16
    # the float32 sums agree to ~1e-7 (test above); rounding both to BF16 flips at most a last bit here and there
    assert R.rel_err(np.asarray(dw_kernel, np.float32), np.asarray(dw_xla, np.float32)) < 1e-3
    assert np.all(np.asarray(dw_kernel[1], np.float32) == 0)  # the empty expert


def test_interpret_grouped_matches_xla():
    x, w = _data(2, 60, 128, 128, e=3)
    gs = jnp.asarray([20, 0, 30], jnp.int32)
    a = ops.grouped_linear(x, w, gs, fmt="fp8-block", backend="interpret")
    b = ops.grouped_linear(x, w, gs, fmt="fp8-block", backend="xla")
    assert R.rel_err(a, b) < 1e-6


@pytest.mark.parametrize("fmt", ["bf16", "mxfp8"])
def test_interpret_bf16_grouped_kernel_forward_and_grads_match_xla(fmt):
    """BF16 expert GEMMs (bf16, and the emulated formats' dequantized operands) through the BF16 grouped
    kernels: forward, data gradient and weight gradient."""
    x, w = _data(7, 150, 128, 256, e=3)
    gs = jnp.asarray([40, 0, 100], jnp.int32)
    c = jnp.asarray(np.random.default_rng(8).standard_normal((150, 128)), jnp.float32)
    fn = lambda x, w, be, bw: ops.grouped_linear(x, w, gs, fmt=fmt, backward=bw, backend=be)
    assert R.rel_err(fn(x, w, "interpret", "high_precision"), fn(x, w, "xla", "high_precision")) < 1e-6
    for a, b in zip(_grads(fn, x, w, c, "interpret", "high_precision"), _grads(fn, x, w, c, "xla", "high_precision")):
        assert R.rel_err(a, b) < 1e-6


def test_bf16_grouped_backend_resolution():
    from jaxrl_fp8.ops import backends

    assert backends.resolve_bf16_grouped("xla", 100, 100) == "xla"
    assert backends.resolve_bf16_grouped("interpret", 256, 192) == "interpret"
    with pytest.raises(ValueError, match="multiple of 128"):
        backends.resolve_bf16_grouped("interpret", 200, 128)
    if not backends.default_device_is_hopper():
        assert backends.resolve_bf16_grouped(None, 256, 256) == "xla"


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
def test_gpu_bf16_grouped_kernel_matches_xla(fmt):
    xg, wg = _data(9, 700, 384, 1024, e=16)
    gs = jnp.asarray([100, 0, 50, 50, 0, 200, 50, 10, 0, 0, 40, 60, 30, 20, 10, 30], jnp.int32)
    cg = jnp.asarray(np.random.default_rng(10).standard_normal((700, 384)), jnp.float32)
    gn = lambda x, w, be, bw: ops.grouped_linear(x, w, gs, fmt=fmt, backward=bw, backend=be)
    assert R.rel_err(gn(xg, wg, "mosaic", "high_precision"), gn(xg, wg, "xla", "high_precision")) < 1e-5
    for a, b in zip(_grads(gn, xg, wg, cg, "mosaic", "high_precision"), _grads(gn, xg, wg, cg, "xla", "high_precision")):
        assert R.rel_err(a, b) < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("backward", ["high_precision", "dequantized", "fp8"])
def test_gpu_mosaic_linear_and_grouped_match_xla(backward):
    x, w = _data(3, 300, 1024, 2048)
    c = jnp.asarray(np.random.default_rng(4).standard_normal((300, 1024)), jnp.float32)
    fn = lambda x, w, be, bw: ops.linear(x, w, fmt="fp8-block", backward=bw, backend=be)
    # H200 FP8 wgmma accumulates each 128-wide block with less than float32 precision (measured ~1e-4)
    for a, b in zip(_grads(fn, x, w, c, "mosaic", backward), _grads(fn, x, w, c, "xla", backward)):
        assert R.rel_err(a, b) < GPU_TOL
    xg, wg = _data(5, 500, 256, 512, e=8)
    gs = jnp.asarray([100, 0, 50, 50, 0, 200, 50, 10], jnp.int32)
    cg = jnp.asarray(np.random.default_rng(6).standard_normal((500, 256)), jnp.float32)
    gn = lambda x, w, be, bw: ops.grouped_linear(x, w, gs, fmt="fp8-block", backward=bw, backend=be)
    for a, b in zip(_grads(gn, xg, wg, cg, "mosaic", backward), _grads(gn, xg, wg, cg, "xla", backward)):
        assert R.rel_err(a, b) < GPU_TOL
