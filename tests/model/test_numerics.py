"""model.numerics: the row-invariant sum's closed-form gradient equals autodiff of its tree, bit for bit; the
RMSNorm keeps its roundings."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_fp8.model import numerics
from jaxrl_fp8.precision.arith import ieee_div


def _tree_by_autodiff(x, axis, keepdims):
    """The pairwise tree without the custom VJP (what `row_sum` differentiated before)."""
    return numerics._pairwise_tree(x, axis % x.ndim, keepdims)


def _bits(a):
    return np.asarray(a, np.float32).view(np.uint32)


@pytest.mark.parametrize("shape,axis", [((3, 2048), -1), ((5, 7), 1), ((6, 97, 2), 1), ((1, 1), -1), ((4, 3, 128), 0)])
@pytest.mark.parametrize("keepdims", [False, True])
def test_row_sum_values_and_gradient_equal_the_trees(shape, axis, keepdims):
    k = jax.random.split(jax.random.key(0), 2)
    x = jax.random.normal(k[0], shape, jnp.float32)
    out_shape = jax.eval_shape(lambda v: numerics.row_sum(v, axis, keepdims), x).shape
    w = jax.random.normal(k[1], out_shape, jnp.float32)
    got, got_vjp = jax.vjp(lambda v: numerics.row_sum(v, axis, keepdims), x)
    ref, ref_vjp = jax.vjp(lambda v: _tree_by_autodiff(v, axis, keepdims), x)
    np.testing.assert_array_equal(_bits(got), _bits(ref))
    (g,), (g_ref,) = got_vjp(w), ref_vjp(w)
    assert g.shape == x.shape and g.dtype == x.dtype
    np.testing.assert_array_equal(np.asarray(g), np.asarray(g_ref))


def test_rms_norm_gradient_is_unchanged_by_the_closed_form():
    """The trainer's RMSNorm backward (BF16 activations): the same bits as autodiff through the tree."""
    x = jax.random.normal(jax.random.key(1), (16, 256), jnp.bfloat16)
    scale = (1.0 + 0.1 * jax.random.normal(jax.random.key(2), (256,))).astype(jnp.bfloat16)

    def loss(norm):
        return lambda v, s: jnp.sum(norm(v, s).astype(jnp.float32) * jnp.arange(256, dtype=jnp.float32))

    got = jax.jit(jax.grad(loss(lambda v, s: numerics.rms_norm(v, s, 1e-6)), argnums=(0, 1)))(x, scale)
    orig = numerics.row_sum
    try:
        numerics.row_sum = lambda v, axis=-1, keepdims=False: _tree_by_autodiff(v, axis, keepdims)
        ref = jax.jit(jax.grad(loss(lambda v, s: numerics.rms_norm(v, s, 1e-6)), argnums=(0, 1)))(x, scale)
    finally:
        numerics.row_sum = orig
    for a, b in zip(got, ref):
        np.testing.assert_array_equal(_bits(a.astype(jnp.float32)), _bits(b.astype(jnp.float32)))


def test_long_tree_cut_into_kernels_keeps_every_add(monkeypatch):
    """A vocabulary-long row sum (2^18 leaves) is cut by optimization barriers; the cut stores partial sums only, so
    the sum equals the uncut tree bit for bit, and the tree is still a pairwise one (float64 check)."""
    x = jnp.exp(jax.random.normal(jax.random.key(0), (3, 151936), jnp.float32) * 4)
    cut = np.asarray(jax.jit(numerics.row_sum)(x))
    monkeypatch.setattr(numerics, "SPLIT_FROM", 1 << 62)
    uncut = np.asarray(jax.jit(numerics.row_sum)(x))
    np.testing.assert_array_equal(cut.view(np.uint32), uncut.view(np.uint32))
    np.testing.assert_allclose(cut, np.asarray(x, np.float64).sum(-1), rtol=1e-6)


@pytest.mark.parametrize("n,levels", [(151936, 7), (20000, 7), (389, 7), (389, 3), (128, 7), (5, 7), (1, 7), (4096, 0)])
def test_strided_partial_sums_are_the_trees_of_strided_chunks(n, levels):
    """One tree gives `row_sum`'s bits and, after `levels` levels, partial j = the tree sum of the chunk x[j::C] of
    the zero-padded row (the pairing of x[:h] + x[h:] keeps a chunk's members together), bit for bit."""
    x = jnp.exp(jax.random.normal(jax.random.key(n), (3, n), jnp.float32) * 3)
    total, partials = jax.jit(numerics.strided_partial_sums, static_argnums=1)(x, levels)
    np.testing.assert_array_equal(_bits(total), _bits(jax.jit(numerics.row_sum)(x)))
    p = 1 << (n - 1).bit_length()
    chunks = p >> min(levels, p.bit_length() - 1)
    assert partials.shape == (3, chunks)
    padded = jnp.pad(x, ((0, 0), (0, p - n)))
    for j in sorted({0, min(1, chunks - 1), chunks // 2, chunks - 1}):
        np.testing.assert_array_equal(_bits(partials[:, j]), _bits(jax.jit(numerics.row_sum)(padded[:, j::chunks])))
    np.testing.assert_allclose(np.asarray(partials, np.float64).sum(-1), np.asarray(x, np.float64).sum(-1), rtol=1e-5)


@pytest.mark.parametrize("width", [128, 2048, 96])
def test_rms_norm_equals_the_form_with_every_product_rounded(width):
    """Power-of-two widths skip the barrier after the multiply by 1/H (exact, so an FMA with + eps rounds the same);
    the norm must equal the form that rounds that product first, on ordinary, tiny (sums of squares far below
    float32's normal range) and huge rows, for float32 and BF16 inputs, jitted as the model runs it."""
    rng = np.random.default_rng(width)
    rows = [rng.normal(size=width), rng.normal(size=width) * 1e-25, rng.normal(size=width) * 1e18,
            np.where(rng.random(width) < 0.9, 0.0, rng.normal(size=width) * 1e-30)]
    x = jnp.asarray(np.stack(rows), jnp.float32)
    scale = jnp.asarray(rng.normal(size=width), jnp.float32)

    def barrier_form(x, scale, eps):
        xf = x.astype(jnp.float32)
        var = numerics.rounded_product(numerics.row_sum(xf * xf, keepdims=True), jnp.float32(1.0 / width))
        inv = ieee_div(jnp.float32(1.0), jnp.sqrt(var + jnp.float32(eps)))
        return scale.astype(x.dtype) * (xf * inv).astype(x.dtype)

    for dtype in (jnp.float32, jnp.bfloat16):
        xd, sd = x.astype(dtype), scale.astype(dtype)
        got = jax.jit(numerics.rms_norm, static_argnums=2)(xd, sd, 1e-6)
        want = jax.jit(barrier_form, static_argnums=2)(xd, sd, 1e-6)
        np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), np.asarray(want.astype(jnp.float32)))
