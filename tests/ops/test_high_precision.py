"""ops.high_precision: the split-BF16 ("split3") form of the router / lm_head product, in interpret mode.

It exists to be row invariant on the GPU (the XLA form is a cuBLAS call there); on CPU the same kernel runs
interpreted, so here: its error against float64 stays inside the split's bound, a row alone equals the row in a
batch bit for bit, BF16 operands take the exact one-product path, the gradient splits the same way (within the
bound), and a bad setting of the switch names the variable."""

import numpy as np
import pytest

import jaxrl_fp8  # noqa: F401  (before JAX starts a backend: it sets the contract's XLA flags)
import jax
import jax.numpy as jnp

from jaxrl_fp8.ops import high_precision as H
from jaxrl_fp8.ops.xla_gemm import dot_nt_f32

FORM = "split3-interpret"


def _operands(m, n, k, seed=0):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((m, k)) * np.exp(rng.uniform(-3, 3, (m, 1)))).astype(np.float32)
    w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
    return x, w


@pytest.mark.parametrize("m,n,k", [(1, 8, 64), (37, 200, 128), (130, 128, 192)])
def test_split3_error_within_the_split_bound(m, n, k):
    x, w = _operands(m, n, k)
    y = np.asarray(jax.jit(lambda a, b: H.high_precision_dot(a, b, FORM))(x, w))
    ref = x.astype(np.float64) @ w.astype(np.float64).T
    # each operand's tail is rounded to bf16 (2^-16 relative each), lo.lo is dropped (2^-16 * 2^-8), plus f32 sums
    bound = 2.0 ** -15 * (np.abs(x).astype(np.float64) @ np.abs(w).astype(np.float64).T) + 1e-30
    assert y.shape == (m, n) and y.dtype == np.float32
    assert np.all(np.abs(y - ref) <= bound), float(np.max(np.abs(y - ref) / bound))


@pytest.mark.row_invariant_cpu
def test_split3_rows_do_not_depend_on_the_batch():
    x, w = _operands(70, 256, 128, seed=1)
    f = jax.jit(lambda a: H.high_precision_dot(a, jnp.asarray(w), FORM))
    full = np.asarray(f(x))
    for rows in (slice(0, 1), slice(0, 3), slice(5, 69)):
        part = np.asarray(f(x[rows]))
        assert part.tobytes() == full[rows].tobytes(), rows


def test_float32_by_bf16_skips_the_zero_tail_product():
    """A float32 router over BF16 weights: the weight has no tail, so two products instead of three, with the
    three-product form's bits (its hi.lo term is an exact zero) and the XLA form's float32 product on CPU."""
    x, w = _operands(21, 128, 128, seed=7)
    wb = jnp.asarray(w, jnp.bfloat16)
    two = np.asarray(H.high_precision_dot(jnp.asarray(x), wb, FORM))
    three = np.asarray(H.high_precision_dot(jnp.asarray(x), wb.astype(jnp.float32), FORM))
    assert two.tobytes() == three.tobytes()
    xla_mixed = np.asarray(H.high_precision_dot(jnp.asarray(x), wb, "xla"))
    assert xla_mixed.tobytes() == np.asarray(dot_nt_f32(jnp.asarray(x), wb.astype(jnp.float32))).tobytes()
    calls = []
    real = H.backends.bf16_grouped_matmul
    H.backends.bf16_grouped_matmul = lambda *a, **k: calls.append(1) or real(*a, **k)
    try:
        H._split3_forward(jnp.asarray(x), wb, "interpret")
        assert len(calls) == 1  # x's head and tail rows stacked into one call
        H._split3_forward(jnp.asarray(x), wb.astype(jnp.float32), "interpret")
        assert len(calls) == 1 + 2
    finally:
        H.backends.bf16_grouped_matmul = real


# M = 64 / 128 fill whole 64-row tiles, so the stacked call's tiles are the separate calls' tiles on any host; other
# M put rows at other positions of a partial tile, whose bits are the kernel's row invariance (on CPU: the host's)
@pytest.mark.parametrize("m", [1, 64, 128, pytest.param(37, marks=pytest.mark.row_invariant_cpu),
                               pytest.param(130, marks=pytest.mark.row_invariant_cpu)])
@pytest.mark.parametrize("w_dtype", [jnp.float32, jnp.bfloat16])
def test_stacked_head_and_tail_rows_keep_the_separate_products_bits(m, w_dtype):
    """x's head and tail rows go through the kernel in one call (stacked); each product keeps the bits of its own
    call, and the sum keeps the order hi.hi + (hi.lo + lo.hi)."""
    _check_stacked(m, w_dtype, FORM, "interpret")


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 37, 256, 2560])
@pytest.mark.parametrize("w_dtype", [jnp.float32, jnp.bfloat16])
def test_gpu_stacked_head_and_tail_rows_keep_the_separate_products_bits(m, w_dtype):
    """The same on the Hopper kernel, at decode's and the trainer's M."""
    assert H.effective_form() == "split3"
    _check_stacked(m, w_dtype, "split3", H._backend("split3", 128))


def _check_stacked(m, w_dtype, form, backend):
    x, w = _operands(m, 200, 128, seed=11)
    x, w = jnp.asarray(x), jnp.asarray(w, w_dtype)
    got = np.asarray(H.high_precision_dot(x, w, form))
    pad = (-w.shape[0]) % 128
    wp = jnp.pad(w, ((0, pad), (0, 0)))
    mm = lambda a, b: H.backends.bf16_grouped_matmul(a, b[None], jnp.asarray([a.shape[0]], jnp.int32), backend=backend)  # noqa: E731
    xh, xl = H.split_bf16(x)
    if w_dtype == jnp.bfloat16:
        ref = mm(xh, wp) + mm(xl, wp)
    else:
        wh, wl = H.split_bf16(wp)
        ref = mm(xh, wh) + (mm(xh, wl) + mm(xl, wh))
    assert got.tobytes() == np.asarray(ref[:, :200]).tobytes()


def test_bf16_operands_take_one_exact_product():
    x, w = _operands(9, 128, 64, seed=2)
    xb, wb = jnp.asarray(x, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16)
    y = np.asarray(H.high_precision_dot(xb, wb, FORM))
    xf, wf = np.asarray(xb, np.float64), np.asarray(wb, np.float64)
    ref = xf @ wf.T  # bf16 products are exact in f64; only the kernel's float32 sums round
    assert np.all(np.abs(y - ref) <= 64 * 2.0 ** -24 * (np.abs(xf) @ np.abs(wf).T))
    hi, lo = H.split_bf16(jnp.asarray(x))
    assert np.all(np.abs(np.asarray(hi, np.float64) + np.asarray(lo, np.float64) - x) <= 2.0 ** -16 * np.abs(x))


@pytest.mark.parametrize("w_dtype", [jnp.float32, jnp.bfloat16])
def test_gradient_is_the_split_products_within_the_bound(w_dtype):
    """The backward splits like the forward (BF16 tensor-core products, not a float32 SIMT dot on a GPU): both
    gradients stay inside the split's bound against float64, and no product in it has a float32 operand."""
    x, w = _operands(12, 128, 64, seed=3)
    w = np.asarray(jnp.asarray(w, w_dtype).astype(jnp.float32))  # a BF16 weight's values, exactly
    g = (np.random.default_rng(4).standard_normal((12, 128)) * np.exp(np.random.default_rng(5).uniform(-4, 4, (12, 1))))
    g = g.astype(np.float32)

    def loss(a, b):
        return jnp.sum(H.high_precision_dot(a, b, FORM) * g)

    wj = jnp.asarray(w, w_dtype)
    dx, dw = jax.grad(loss, argnums=(0, 1))(jnp.asarray(x), wj)
    g64, x64, w64 = g.astype(np.float64), x.astype(np.float64), w.astype(np.float64)
    dx_bound = 2.0 ** -15 * (np.abs(g64) @ np.abs(w64)) + 1e-30
    assert np.all(np.abs(np.asarray(dx, np.float64) - g64 @ w64) <= dx_bound)
    dw_ref, dw_abs = g64.T @ x64, np.abs(g64).T @ np.abs(x64)
    # a BF16 weight's gradient is rounded to BF16 once (2^-9), on top of the split's error
    rounding = 2.0 ** -8 if w_dtype == jnp.bfloat16 else 0.0
    assert np.all(np.abs(np.asarray(dw, np.float64) - dw_ref) <= 2.0 ** -15 * dw_abs + rounding * np.abs(dw_ref) + 1e-30)
    hlo = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(jnp.asarray(x), wj).as_text()
    operand_types = [line.rsplit(": (", 1)[1].split(") ->")[0] for line in hlo.splitlines() if "dot_general" in line]
    assert len(operand_types) == (2 + 3 if w_dtype == jnp.bfloat16 else 3 + 3), operand_types  # dx + dw
    assert all(t.count("xbf16>") == 2 for t in operand_types), operand_types


def test_split_dot_general_matches_the_float32_product_within_the_bound():
    rng = np.random.default_rng(9)
    a = (rng.standard_normal((33, 70)) * 1e3).astype(np.float32)
    b = rng.standard_normal((33, 50)).astype(np.float32)
    y = np.asarray(H.split_dot_general(jnp.asarray(a), jnp.asarray(b), (((0,), (0,)), ((), ()))), np.float64)
    ref = a.astype(np.float64).T @ b.astype(np.float64)
    assert y.shape == (70, 50)
    assert np.all(np.abs(y - ref) <= 2.0 ** -15 * (np.abs(a).astype(np.float64).T @ np.abs(b)) + 1e-30)


def test_form_switch(monkeypatch):
    x, w = _operands(3, 8, 64)
    monkeypatch.delenv(H.ENV, raising=False)
    assert H.selected_form() == "auto"
    assert H.effective_form() == ("split3" if H.backends.default_device_is_hopper() else "xla")
    assert H.effective_form("split3-interpret") == "split3-interpret"
    np.testing.assert_array_equal(np.asarray(H.high_precision_dot(x, w)), np.asarray(dot_nt_f32(x, w)))
    monkeypatch.setenv(H.ENV, "tf32")
    with pytest.raises(ValueError, match="JAXRL_FP8_HIGH_PRECISION='tf32'"):
        H.high_precision_dot(x, w)
    # a contraction the kernel does not take stays on the XLA form
    x2, w2 = _operands(3, 8, 40)
    np.testing.assert_array_equal(np.asarray(H.high_precision_dot(x2, w2, FORM)), np.asarray(dot_nt_f32(x2, w2)))


def test_float32_operands_ask_for_float32_not_tf32():
    """XLA's DEFAULT precision lets a GPU round float32 operands to TF32; the XLA form asks for HIGHEST when an
    operand is float32 (same bits on CPU) and leaves BF16 products at DEFAULT."""
    from jaxrl_fp8.ops.xla_gemm import dot_tn_f32

    f32 = jax.ShapeDtypeStruct((4, 64), jnp.float32)
    b16 = jax.ShapeDtypeStruct((4, 64), jnp.bfloat16)
    for fn in (dot_nt_f32, dot_tn_f32):
        assert "HIGHEST" in jax.jit(fn).lower(f32, f32).as_text()
        assert "HIGHEST" in jax.jit(fn).lower(b16, f32).as_text()
        assert "HIGHEST" not in jax.jit(fn).lower(b16, b16).as_text()
