"""model.rope.apply_rope: both products in one rounded op keep the bits of two separately rounded products."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_fp8.model.numerics import rounded_product
from jaxrl_fp8.model.rope import apply_rope


def _two_products(x, cos, sin):
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return rounded_product(x, cos[:, :, None, :]) + rounded_product(rotated, sin[:, :, None, :])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_apply_rope_keeps_the_two_rounded_products_bits(dtype):
    k = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(k[0], (2, 5, 4, 64), dtype)
    cos = jax.random.normal(k[1], (2, 5, 64), dtype)
    sin = jax.random.normal(k[2], (2, 5, 64), dtype)
    got, ref = jax.jit(apply_rope)(x, cos, sin), jax.jit(_two_products)(x, cos, sin)
    assert got.dtype == ref.dtype == dtype
    np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), np.asarray(ref.astype(jnp.float32)))
