"""Chunked head + log-softmax + entropy == the whole-batch computation (values and gradients)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_fp8.model.matmul import high_precision_linear
from jaxrl_fp8.rl.losses import entropy_from_logits
from jaxrl_fp8.rl.token_stats import balanced_chunk, chunked_token_stats, token_stats
from jaxrl_fp8.rollout.sampling import tempered_logits, token_logprobs

B, T, H, V = 3, 7, 32, 97


def _inputs(seed=0, dtype=jnp.float32):
    k = jax.random.split(jax.random.key(seed), 3)
    hidden = jax.random.normal(k[0], (B, T, H), dtype)
    head = (0.3 * jax.random.normal(k[1], (V, H))).astype(dtype)
    targets = jax.random.randint(k[2], (B, T), 0, V)
    return hidden, head, targets


def _whole(hidden, head, targets, temperature):
    logits = high_precision_linear(hidden, head, jnp.float32)
    return token_logprobs(logits, targets, temperature), entropy_from_logits(tempered_logits(logits, temperature))


@pytest.mark.parametrize("chunk", [1, 4, 7, 21, 64])  # dividing B*T or not, one chunk larger than everything
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_values_match_the_whole_batch(chunk, temperature):
    hidden, head, targets = _inputs()
    ref_logp, ref_ent = _whole(hidden, head, targets, temperature)
    logp, ent = jax.jit(chunked_token_stats, static_argnums=(4,))(hidden, head, targets, temperature, chunk)
    assert logp.shape == ent.shape == (B, T) and logp.dtype == jnp.float32
    np.testing.assert_allclose(logp, ref_logp, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(ent, ref_ent, rtol=1e-6, atol=1e-6)
    no_ent = chunked_token_stats(hidden, head, targets, temperature, chunk, with_entropy=False)
    assert no_ent[1] is None
    np.testing.assert_array_equal(no_ent[0], logp)


@pytest.mark.row_invariant_cpu
def test_values_are_bitwise_where_the_head_is_row_invariant():
    hidden, head, targets = _inputs(1, jnp.bfloat16)
    ref_logp, ref_ent = _whole(hidden, head, targets, 1.0)
    logp, ent = chunked_token_stats(hidden, head, targets, 1.0, 5)
    np.testing.assert_array_equal(logp, ref_logp)
    np.testing.assert_array_equal(ent, ref_ent)


def test_gradients_match_the_whole_batch():
    hidden, head, targets = _inputs(2)
    w = jax.random.normal(jax.random.key(9), (B, T))

    def loss(fn):
        def f(h, hd):
            logp, ent = fn(h, hd)
            return jnp.sum(w * logp) + 0.1 * jnp.sum(ent)
        return f

    ref = jax.grad(loss(lambda h, hd: _whole(h, hd, targets, 0.9)), argnums=(0, 1))(hidden, head)
    got = jax.jit(jax.grad(loss(lambda h, hd: chunked_token_stats(h, hd, targets, 0.9, 4)), argnums=(0, 1)))(hidden, head)
    for a, b in zip(ref, got):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(a))))


@pytest.mark.parametrize("n,chunk,expected", [
    (5116, 2048, 1706),  # a 4-row micro-batch of 1,279 positions: 3 chunks of 1,706 (5,118), not of 2,048 (6,144)
    (4096, 2048, 2048),  # divides: unchanged
    (21, 64, 21),  # one chunk: no padding
    (21, 4, 4),  # 6 chunks of 3.5 -> 4 = the bound
    (7, 5, 4),  # 2 chunks of 4
    (1, 1, 1),
])
def test_balanced_chunk(n, chunk, expected):
    size = balanced_chunk(n, chunk)
    assert size == expected and size <= chunk
    assert -(-n // size) == -(-n // chunk)  # never more chunks than the bound asks for
    assert -(-n // size) * size - n < -(-n // chunk)  # padding: fewer positions than chunks
    with pytest.raises(ValueError, match="must be >= 1"):
        balanced_chunk(0, chunk)


def test_bad_arguments_are_named():
    hidden, head, targets = _inputs()
    with pytest.raises(ValueError, match="targets"):
        chunked_token_stats(hidden, head, targets[:, 1:], 1.0, 4)
    with pytest.raises(ValueError, match="chunk must be >= 1"):
        chunked_token_stats(hidden, head, targets, 1.0, 0)


def test_bf16_head_gradient_is_summed_over_chunks_in_float32():
    """With a BF16 head (the trainer's compute dtype) each chunk's head gradient is one BF16 product of the logits'
    cotangent rounded to BF16 (`head_logits`); the chunks must add up in float32 and round once - not round to BF16
    after every chunk."""
    hidden, head, targets = _inputs(3, jnp.bfloat16)
    w = jax.random.normal(jax.random.key(4), (B, T))
    logits = high_precision_linear(hidden, head, jnp.float32)
    dlogits = jax.grad(lambda lg: jnp.sum(w * token_stats(lg, targets, 1.0)[0]))(logits)
    g = dlogits.astype(jnp.bfloat16).astype(jnp.float32).reshape(B * T, V)
    x = hidden.astype(jnp.float32).reshape(B * T, H)
    # chunks of one position: the float32 sum of every position's own product, rounded once
    expected = sum(jnp.outer(g[i], x[i]) for i in range(B * T)).astype(jnp.bfloat16).astype(jnp.float32)
    got = jax.jit(lambda: jax.grad(lambda hd: jnp.sum(w * chunked_token_stats(hidden, hd, targets, 1.0, 1)[0]))(head))()
    assert got.dtype == jnp.bfloat16
    # float32 sums of the same terms in another order: within one BF16 ulp
    ulp = jnp.abs(expected) * 2.0**-7 + 1e-30
    assert float(jnp.max(jnp.abs(got.astype(jnp.float32) - expected) / ulp)) <= 1.0


def _reference_stats(logits, targets, temperature):
    return token_logprobs(logits, targets, temperature), entropy_from_logits(tempered_logits(logits, temperature))


@pytest.mark.parametrize("backward", ["numerics", "xla"])  # the CPU's row-invariant log-softmax, the GPU's XLA one
@pytest.mark.parametrize("temperature", [1.0, 0.6, "rows"])
def test_token_stats_keep_the_forward_bits_and_differentiate_in_closed_form(temperature, backward, monkeypatch):
    """token_stats: the rollout's log-prob bits and the entropy's, and the gradient autodiff gives (closed form)."""
    import functools

    from jaxrl_fp8.model import numerics
    from jaxrl_fp8.rl import token_stats as TS

    chosen = numerics.log_softmax if backward == "numerics" else functools.partial(jax.nn.log_softmax, axis=-1)
    monkeypatch.setattr(TS, "_backward_log_softmax", lambda: chosen)
    k = jax.random.split(jax.random.key(11), 3)
    logits = 4.0 * jax.random.normal(k[0], (B, T, V))
    targets = jax.random.randint(k[1], (B, T), 0, V)
    if temperature == "rows":  # per-position temperatures, one greedy (0: measured at 1)
        temperature = jnp.asarray(np.r_[0.0, np.linspace(0.5, 1.5, B * T - 1)].reshape(B, T), jnp.float32)
    w_lp, w_ent = jax.random.normal(k[2], (2, B, T))
    logp, ent = jax.jit(lambda lg: token_stats(lg, targets, temperature))(logits)
    ref_logp, ref_ent = jax.jit(lambda lg: _reference_stats(lg, targets, temperature))(logits)
    np.testing.assert_array_equal(np.asarray(logp), np.asarray(ref_logp))
    np.testing.assert_array_equal(np.asarray(ent), np.asarray(ref_ent))

    def loss(fn):
        return lambda lg: jnp.sum(w_lp * fn(lg)[0]) + jnp.sum(w_ent * fn(lg)[1])

    got = jax.jit(jax.grad(loss(lambda lg: token_stats(lg, targets, temperature))))(logits)
    ref = jax.jit(jax.grad(loss(lambda lg: _reference_stats(lg, targets, temperature))))(logits)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=2e-6 * float(jnp.max(jnp.abs(ref))))
    # without the entropy: log-probs only, the same bits, the log-prob part of the gradient
    lp_only, none = token_stats(logits, targets, temperature, with_entropy=False)
    assert none is None
    np.testing.assert_array_equal(np.asarray(lp_only), np.asarray(ref_logp))
    g_lp = jax.grad(lambda lg: jnp.sum(w_lp * token_stats(lg, targets, temperature, False)[0]))(logits)
    g_lp_ref = jax.grad(lambda lg: jnp.sum(w_lp * _reference_stats(lg, targets, temperature)[0]))(logits)
    np.testing.assert_allclose(np.asarray(g_lp), np.asarray(g_lp_ref), rtol=1e-5, atol=2e-6 * float(jnp.max(jnp.abs(g_lp_ref))))


def test_token_stats_backward_has_no_pairwise_tree_or_scatter():
    """The point of the closed form: the backward neither differentiates the vocabulary-wide pairwise tree (pads of
    every level) nor scatters a one-hot; autodiff of the same forward does both."""
    logits = jax.ShapeDtypeStruct((4, 1000), jnp.float32)
    targets = jnp.zeros((4,), jnp.int32)

    def hlo(fn):
        g = jax.jit(jax.grad(lambda lg: jnp.sum(fn(lg)[0]) + jnp.sum(fn(lg)[1])))
        return g.lower(logits).as_text()

    ours = hlo(lambda lg: token_stats(lg, targets, 1.0))
    autodiff = hlo(lambda lg: _reference_stats(lg, targets, 1.0))
    assert "scatter" in autodiff and "scatter" not in ours
    assert ours.count("stablehlo.pad") < autodiff.count("stablehlo.pad")


def test_chunked_value_and_grad_evaluates_the_vocabulary_tree_once(monkeypatch):
    """Under the chunks' remat the rebuilt forward's log-probs are dead code with the closed-form backward, so the
    pairwise tree over the vocabulary (padded 1000 -> 1024 here) is compiled once, for the loss value (with the GPU's
    backward log-softmax; on CPU the backward has its own row-invariant one)."""
    import functools
    import re

    from jaxrl_fp8.rl import token_stats as TS

    monkeypatch.setattr(TS, "_backward_log_softmax", lambda: functools.partial(jax.nn.log_softmax, axis=-1))
    hidden, head = jnp.ones((2, 8, 32)), jnp.ones((1000, 32))
    targets = jnp.zeros((2, 8), jnp.int32)

    def loss(h, hd):
        logp, ent = chunked_token_stats(h, hd, targets, 1.0, 4)
        return jnp.sum(logp) + jnp.sum(ent)

    hlo = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(hidden, head).compile().as_text()
    assert len(re.findall(r"f32\[\d+,1024\]\{[^}]*\} pad\(", hlo)) == 1
