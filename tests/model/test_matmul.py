"""`head_logits`: the rollout's logits bits forward, a backward in the compute dtype (one product per gradient)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_fp8.model.matmul import head_logits, high_precision_linear

F32, BF16 = jnp.float32, jnp.bfloat16
M, H, V = 9, 64, 131  # V and M not multiples of any tile


def _inputs(seed=0):
    k = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(k[0], (3, M // 3, H)).astype(BF16)
    w = (0.2 * jax.random.normal(k[1], (V, H))).astype(BF16)
    g = jax.random.normal(k[2], (3, M // 3, V), F32)
    return x, w, g


@pytest.mark.parametrize("master", [BF16, F32])
def test_forward_is_the_high_precision_product_in_the_compute_dtype(master):
    x, w, _ = _inputs()
    got = jax.jit(lambda x, w: head_logits(x, w, BF16))(x, w.astype(master))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(jax.jit(high_precision_linear)(x, w)))
    assert got.dtype == F32 and got.shape == (3, M // 3, V)


def test_backward_rounds_the_cotangent_to_bf16_once_and_multiplies_once():
    x, w, g = _inputs(1)
    _, vjp = jax.vjp(lambda x, w: head_logits(x, w, BF16), x, w.astype(F32))
    dx, dw = jax.jit(vjp)(g)
    assert dx.dtype == BF16 and dw.dtype == F32  # a float32 master copy gets a float32 gradient
    gb = g.astype(BF16).astype(F32).reshape(M, V)
    xf, wf = x.astype(F32).reshape(M, H), w.astype(F32)
    np.testing.assert_allclose(np.asarray(dx, np.float32).reshape(M, H),
                               np.asarray((gb @ wf).astype(BF16), np.float32), rtol=2**-8, atol=1e-6)
    np.testing.assert_allclose(np.asarray(dw), np.asarray(gb.T @ xf), rtol=1e-6, atol=1e-6)
    # the rounding is real: the float32 cotangent's product differs
    assert float(jnp.max(jnp.abs(dw - g.reshape(M, V).T @ xf))) > 0


def test_float32_compute_dtype_is_the_float32_gradient():
    x, w, g = _inputs(2)
    x, w = x.astype(F32), w.astype(F32)
    ours = jax.vjp(lambda x, w: head_logits(x, w, F32), x, w)[1](g)
    ref = jax.vjp(high_precision_linear, x, w)[1](g)
    for a, b in zip(ours, ref):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)


def test_bf16_backward_has_two_bf16_products_and_no_split():
    """Two dots in the backward, both of BF16 operands (no float32 x float32 dot, no head/tail split)."""
    x, w, g = _inputs(3)
    text = jax.jit(jax.vjp(lambda x, w: head_logits(x, w, BF16), x, w.astype(F32))[1]).lower(g).as_text()
    dots = [line for line in text.splitlines() if "dot_general" in line]
    assert len(dots) == 2
    for line in dots:
        operands = re.search(r":\s*\((.*?)\)\s*->", line).group(1)
        assert operands.count("bf16") == 2, line


def test_a_precast_compute_copy_gives_the_same_values_and_gradients():
    x, w, g = _inputs(4)
    w32 = w.astype(F32)
    plain = jax.vjp(lambda x_, w_: head_logits(x_, w_, BF16), x, w32)
    precast = jax.vjp(lambda x_, w_: head_logits(x_, w_, BF16, w_compute=w), x, w32)  # w closed over: no gradient path
    np.testing.assert_array_equal(np.asarray(plain[0]), np.asarray(precast[0]))
    for a, b in zip(plain[1](g), precast[1](g)):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match="w_compute"):
        head_logits(x, w32, BF16, w_compute=w32)
