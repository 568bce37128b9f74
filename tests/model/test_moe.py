"""model.moe: the dispatch / combine row movement keeps the values of the scatter formulation bit for bit, and its
derivative is made of gathers (no scatter over the [N*k, H] rows)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_fp8.model import moe
from jaxrl_fp8.model.numerics import rounded_product

N, K, H, E = 37, 4, 16, 8


def _case(seed=0, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    experts = jnp.asarray(np.stack([rng.permutation(E)[:K] for _ in range(N)]), jnp.int32)
    x = jnp.asarray(rng.standard_normal((N, H)), dtype)
    weights = jnp.asarray(rng.random((N, K)), jnp.float32)
    return moe.dispatch(experts, E), x, weights


def _scatter_combine(rows_sorted, d, weights):
    """The scatter formulation: rows written back to (token, slot) order by `.at[order].set`."""
    unsorted = jnp.zeros_like(rows_sorted).at[d.order].set(rows_sorted)
    per_slot = unsorted.reshape(N, K, -1).astype(jnp.float32)
    out = rounded_product(weights[:, 0, None], per_slot[:, 0])
    for j in range(1, K):
        out = out + rounded_product(weights[:, j, None], per_slot[:, j])
    return out


def test_inverse_permutation():
    d, _, _ = _case()
    order, inverse = np.asarray(d.order), np.asarray(d.inverse)
    np.testing.assert_array_equal(inverse[order], np.arange(N * K))
    np.testing.assert_array_equal(order[inverse], np.arange(N * K))


@pytest.mark.parametrize("tokens,k,experts", [(1, 1, 8), (1, 8, 128), (37, 4, 8), (256, 8, 128), (512, 8, 128),
                                               (300, 8, 4), (64, 2, 128)])
def test_counting_dispatch_is_the_stable_sort(tokens, k, experts):
    """Decode-sized batches rank (token, expert) pairs by counting: the same order, inverse and group sizes as the
    stable argsort, with empty experts, one-pair experts, every pair on one expert; 512 x 8 = 4096 pairs is the
    largest counted batch."""
    rng = np.random.default_rng(tokens * k)
    cases = [rng.integers(0, experts, size=(tokens, k)), np.full((tokens, k), experts - 1)]
    if tokens * k >= experts:  # some experts empty, some with a single pair
        skewed = rng.integers(0, 3, size=(tokens, k))
        skewed[0, 0] = experts - 1
        cases.append(skewed)
    for ids in cases:
        ids = jnp.asarray(ids, jnp.int32)
        counted = jax.jit(moe.dispatch, static_argnums=1)(ids, experts)
        assert "= sort[" not in str(jax.make_jaxpr(moe.dispatch, static_argnums=1)(ids, experts))
        assert "= sort[" in str(jax.make_jaxpr(moe.dispatch, static_argnums=(1, 2))(ids, experts, False))
        sorted_ = jax.jit(moe.dispatch, static_argnums=(1, 2))(ids, experts, False)
        assert tokens * k <= moe.COUNTING_DISPATCH_MAX_PAIRS
        np.testing.assert_array_equal(np.asarray(counted.order), np.argsort(np.asarray(ids).reshape(-1), kind="stable"))
        for field in ("order", "group_sizes", "token_of_row", "inverse"):
            np.testing.assert_array_equal(np.asarray(getattr(counted, field)), np.asarray(getattr(sorted_, field)))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_rows_and_combine_keep_the_scatter_formulation_bits(dtype):
    d, x, weights = _case(1, dtype)
    rows = moe.sorted_rows(x, d)
    np.testing.assert_array_equal(np.asarray(rows), np.asarray(x[d.token_of_row]))
    y = jnp.tanh(rows.astype(jnp.float32)).astype(dtype)
    got = jax.jit(moe.combine)(y, d, weights)
    ref = jax.jit(_scatter_combine)(y, d, weights)
    assert got.tobytes() == ref.tobytes()


def test_gradients_are_gathers_with_the_autodiff_values():
    d, x, weights = _case(2)
    g = jax.random.normal(jax.random.key(3), (N, H))

    def loss(fn_rows, fn_combine):
        def f(x):
            rows = fn_rows(x)
            return jnp.sum(g * fn_combine(jnp.tanh(rows) * rows, d, weights))
        return f

    ours = loss(lambda x: moe.sorted_rows(x, d), moe.combine)
    autodiff = loss(lambda x: x[d.token_of_row], _scatter_combine)
    got, ref = jax.grad(ours)(x), jax.grad(autodiff)(x)
    # the same terms; a token's k slot contributions are summed in slot order instead of the scatter's
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-6, atol=1e-6)
    hlo = jax.jit(jax.grad(ours)).lower(x).as_text()
    assert "scatter" not in hlo
    assert "scatter" in jax.jit(jax.grad(autodiff)).lower(x).as_text()


def test_bf16_row_gradient_is_summed_in_float32():
    """A token's gradient is the float32 sum of its k rows' gradients, rounded once to the activations' dtype."""
    d, x, _ = _case(4, jnp.bfloat16)
    g = jax.random.normal(jax.random.key(5), (N * K, H), jnp.bfloat16)
    dx = jax.grad(lambda x: jnp.sum(moe.sorted_rows(x, d).astype(jnp.float32) * g.astype(jnp.float32)))(x)
    token = np.asarray(d.token_of_row)
    expected = np.zeros((N, H), np.float32)
    gf = np.asarray(g.astype(jnp.float32))
    for q in range(N * K):  # pair q = (token q // K, slot q % K), at sorted position inverse[q]
        expected[q // K] += gf[int(d.inverse[q])]
    assert np.all(token[np.asarray(d.inverse)] == np.arange(N * K) // K)
    np.testing.assert_array_equal(np.asarray(dx), expected.astype(jnp.bfloat16))
