"""`ops.backends.prepare_fp8_weight`: fp8-block operands made once (on the kernel backends with the scales in the GEMM
kernel's layout) give the bits of quantizing and laying out in every call, forward and fp8 backward."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_fp8 import ops
from jaxrl_fp8.ops.backends import prepare_fp8_weight
from jaxrl_fp8.ops.operands import PreparedWeight, fp8_weight, weight_values
from jaxrl_fp8.precision import formats as F, quantize_weight


def _bits(a):
    a = np.asarray(a)
    return a.view(np.uint8 if a.dtype.itemsize == 1 else np.uint32 if a.dtype.itemsize == 4 else np.uint16)


def _same(a, b):
    np.testing.assert_array_equal(_bits(a), _bits(b))


def _data(seed, m, n, k, e=None):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((n, k) if e is None else (e, n, k)) * 0.05, jnp.bfloat16)
    return x, w, jnp.asarray(rng.standard_normal((m, n)), jnp.float32)


def _value_and_grads(fn, x, w, c):
    def loss(x, w):
        return jnp.sum(fn(x, w).astype(jnp.float32) * c)

    y = fn(x, w)
    dx, dw = jax.grad(loss, argnums=(0, 1))(x, w)
    return y, dx, (dw.value if isinstance(dw, PreparedWeight) else dw)


@pytest.mark.parametrize("backend", ["xla", "interpret"])
def test_prepared_dense_weight_keeps_forward_and_fp8_backward_bits(backend):
    x, w, c = _data(0, 37, 384, 256)  # M not a multiple of the 128-row tile
    prepared = prepare_fp8_weight(w, backend, dgrad=True)
    kernel = backend != "xla"
    assert (prepared.scale_op is not None) == kernel and (prepared.scale_t_op is not None) == kernel
    fn = lambda x, w: ops.linear(x, w, fmt="fp8-block", backward="fp8", backend=backend)  # noqa: E731
    for a, b in zip(_value_and_grads(fn, x, w, c), _value_and_grads(fn, x, prepared, c)):
        _same(a, b)


@pytest.mark.parametrize("backend", ["xla", "interpret"])
def test_prepared_expert_weights_keep_forward_and_fp8_backward_bits(backend):
    x, w, c = _data(1, 150, 256, 128, e=4)
    gs = jnp.asarray([1, 0, 120, 9], jnp.int32)  # a one-row expert, an empty one, 20 padding rows past the groups
    prepared = prepare_fp8_weight(w, backend, dgrad=True)
    assert (prepared.scale_op is not None) == (backend != "xla")
    fn = lambda x, w: ops.grouped_linear(x, w, gs, fmt="fp8-block", backward="fp8", backend=backend)  # noqa: E731
    for a, b in zip(_value_and_grads(fn, x, w, c), _value_and_grads(fn, x, prepared, c)):
        _same(a, b)


@pytest.mark.parametrize("backend", ["xla", "interpret"])
@pytest.mark.parametrize("experts", [None, 3])
def test_operands_only_from_a_quantized_weight_keep_the_forward_bits(backend, experts):
    """The rollout engine's case: an fp8-block QuantizedWeight becomes operands without a value (decode loops)."""
    x, w, _ = _data(2, 1, 256, 256, e=experts)  # M = 1
    qw = quantize_weight(w.astype(jnp.float32), F.FP8_BLOCK)
    prepared = prepare_fp8_weight(qw, backend)
    assert prepared.value is None and prepared.shape == qw.shape
    _same(weight_values(prepared), qw.dequantize(jnp.float32))  # what a BF16 backward would multiply
    _same(prepared.q, qw.data)
    _same(prepared.scale, qw.scale)
    if experts is None:
        fn = lambda w: ops.linear(x, w, fmt="fp8-block", backend=backend)  # noqa: E731
    else:
        gs = jnp.asarray([0, 1, 0], jnp.int32)
        fn = lambda w: ops.grouped_linear(x, w, gs, fmt="fp8-block", backend=backend)  # noqa: E731
    _same(fn(qw), fn(prepared))


def test_prepared_operands_are_the_contract_quantizer_output():
    w = _data(3, 1, 256, 384)[1]
    prepared = prepare_fp8_weight(w, "xla")
    q, s = fp8_weight(w, "xla")
    _same(prepared.q, q)
    _same(prepared.scale, s)


def test_only_fp8_block_quantized_weights_are_prepared():
    w = jnp.ones((128, 128), jnp.float32)
    with pytest.raises(ValueError, match="mxfp8"):
        prepare_fp8_weight(quantize_weight(w, F.MXFP8))


def test_a_scale_layout_for_another_tiling_is_refused():
    """b_scale_op made for the default tiling, passed to a call under the narrow split: a clear error, no launch."""
    from pallas_kernels import gemm_grouped

    x, w, _ = _data(4, 8, 256, 128, e=2)
    qw = quantize_weight(w.astype(jnp.float32), F.FP8_BLOCK)
    xq = jnp.zeros((8, 128), jnp.float8_e4m3fn)
    sa = jnp.ones((8, 1), jnp.float32)
    op = gemm_grouped.weight_scale_operand(qw.scale)
    with pytest.raises(ValueError, match="b_scale_op"):
        gemm_grouped.grouped_block_scaled_matmul(xq, sa, qw.data, qw.scale, jnp.asarray([4, 4], jnp.int32), interpret=True,
                                                 config=gemm_grouped.NARROW_CONFIG, b_scale_op=op)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 64, 2560])
def test_gpu_prepared_weights_keep_the_kernels_bits(rows):
    """On the H200's Mosaic kernels, Qwen3-30B-A3B shapes: a q_proj-sized dense weight and gate-sized experts give the
    same forward and fp8-backward bits prepared (scales laid out once) as quantized in the call."""
    x, w, c = _data(5, rows, 4096, 2048)
    fn = lambda x, w: ops.linear(x, w, fmt="fp8-block", backward="fp8")  # noqa: E731
    prepared = prepare_fp8_weight(w, dgrad=True)
    assert prepared.scale_op is not None and prepared.scale_t_op is not None
    for a, b in zip(_value_and_grads(jax.jit(fn), x, w, c), _value_and_grads(jax.jit(fn), x, prepared, c)):
        _same(a, b)
    xe, we, ce = _data(6, rows * 8, 768, 2048, e=128)
    gs = jnp.asarray(np.random.default_rng(7).multinomial(rows * 8, np.ones(128) / 128), jnp.int32)
    fe = lambda x, w: ops.grouped_linear(x, w, gs, fmt="fp8-block", backward="fp8")  # noqa: E731
    for a, b in zip(_value_and_grads(jax.jit(fe), xe, we, ce), _value_and_grads(jax.jit(fe), xe, prepare_fp8_weight(we, dgrad=True), ce)):
        _same(a, b)
