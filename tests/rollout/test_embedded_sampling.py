"""Sampling functions of the embedded engine: exact conventions, distributions, batch independence."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_fp8.rollout import sampling as S


def _np_log_softmax(z):
    z = z.astype(np.float64)
    m = z.max(-1, keepdims=True)
    return z - m - np.log(np.exp(z - m).sum(-1, keepdims=True))


def _np_keep(z, top_k, top_p):
    """Independent statement of the top-k / top-p rule (float64 probabilities)."""
    v = z.shape[-1]
    out = np.zeros(z.shape, bool)
    for b in range(z.shape[0]):
        order = np.argsort(-z[b], kind="stable")
        k = v if top_k[b] <= 0 or top_k[b] > v else top_k[b]
        p = np.exp(_np_log_softmax(z[b][order]))
        before = np.concatenate([[0.0], np.cumsum(p)[:-1]])
        n_p = v if top_p[b] >= 1 else int(np.sum(before <= top_p[b]))
        n = max(1, min(k, n_p))
        out[b] = z[b] >= z[b][order[n - 1]]
    return out


def test_tempered_logits_is_ieee_division():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(5, 37)).astype(np.float32) * 7
    temps = np.array([0.7, 1.0, 0.0, 1.3, 0.3], np.float32)
    got = np.asarray(jax.jit(S.tempered_logits)(logits, temps))
    want = logits / np.where(temps > 0, temps, 1.0).astype(np.float32)[:, None]  # numpy: correctly rounded
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("temperature", [1.0, 0.0, 1, np.float32(1.0)])
def test_concrete_unit_temperature_skips_the_division_with_the_divided_bits(temperature):
    """A concrete T of 1 (or greedy 0) returns the logits as float32 without a division (no divisor tensor in the
    program) and with the bits the rollout's traced per-row division gives: x / 1 is exact, infinities and signed
    zeros included. A subnormal logit is the one difference (XLA:CPU's division flushes it to zero, the skip keeps
    it) and no later op sees it: they read subnormals as zero, so the log-probs keep their bits."""
    rng = np.random.default_rng(2)
    logits = (rng.normal(size=(6, 41)) * 9).astype(np.float32)
    logits[0, :4] = [np.inf, -np.inf, -0.0, 3e38]
    logits[1, :3] = [1e-42, -1e-45, 1.2e-38]
    ones = np.full(6, float(temperature), np.float32)
    got = np.asarray(jax.jit(lambda x: S.tempered_logits(x, temperature))(logits))
    traced = np.asarray(jax.jit(S.tempered_logits)(logits, ones))
    normal = np.abs(logits) >= np.finfo(np.float32).tiny
    np.testing.assert_array_equal(got.view(np.uint32)[normal | (logits == 0)], traced.view(np.uint32)[normal | (logits == 0)])
    np.testing.assert_array_equal(got.view(np.uint32), logits.view(np.uint32))
    finite, tokens = logits[1:], np.array([0, 1, 2, 5, 40])  # row 0's infinities make NaN rows
    lp = np.asarray(jax.jit(lambda x: S.token_logprobs(x, tokens, temperature))(finite))
    lp_traced = np.asarray(jax.jit(S.token_logprobs)(finite, tokens, ones[1:]))
    np.testing.assert_array_equal(lp.view(np.uint32), lp_traced.view(np.uint32))
    hlo = jax.jit(lambda x: S.tempered_logits(x, temperature)).lower(logits).as_text()
    assert "divide" not in hlo
    assert "divide" in jax.jit(lambda x: S.tempered_logits(x, 0.7)).lower(logits).as_text()


def test_token_logprobs_full_distribution_and_greedy_at_t1():
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(4, 50)).astype(np.float32) * 3
    tokens = np.array([3, 49, 0, 17])
    temps = np.array([0.5, 1.0, 0.0, 2.0], np.float32)
    got = np.asarray(S.token_logprobs(jnp.asarray(logits), jnp.asarray(tokens), jnp.asarray(temps)))
    t = np.where(temps > 0, temps, 1.0)
    want = _np_log_softmax(logits / t[:, None])[np.arange(4), tokens]
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6)


def test_token_logprobs_row_invariant():
    """A row's log-prob has the same bits in a batch of 1, of 9, and inside [B, T, V]."""
    rng = np.random.default_rng(2)
    logits = rng.normal(size=(9, 301)).astype(np.float32) * 4
    tokens = rng.integers(0, 301, size=9)
    temps = rng.uniform(0.2, 1.5, size=9).astype(np.float32)
    f = jax.jit(S.token_logprobs)
    full = np.asarray(f(logits, tokens, temps))
    for b in (0, 4, 8):
        one = np.asarray(f(logits[b : b + 1], tokens[b : b + 1], temps[b : b + 1]))
        assert one.view(np.uint32)[0] == full.view(np.uint32)[b]
    seq = np.asarray(f(logits.reshape(3, 3, 301), tokens.reshape(3, 3), temps.reshape(3, 3)))
    np.testing.assert_array_equal(seq.reshape(-1).view(np.uint32), full.view(np.uint32))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_keep_mask_matches_reference(seed):
    rng = np.random.default_rng(seed)
    b, v = 16, 97
    z = (rng.normal(size=(b, v)) * rng.uniform(0.5, 4)).astype(np.float32)
    top_k = rng.choice([-1, 1, 2, 5, 40, 97, 200], size=b)
    top_p = rng.choice([1.0, 0.9, 0.5, 0.1, 0.999], size=b).astype(np.float32)
    got = np.asarray(jax.jit(S.keep_mask)(z, top_k, top_p))
    np.testing.assert_array_equal(got, _np_keep(z, top_k, top_p))
    assert got.sum(-1).min() >= 1


def test_keep_mask_no_limits_keeps_everything():
    z = jnp.asarray(np.random.default_rng(3).normal(size=(3, 64)).astype(np.float32))
    assert bool(jnp.all(S.keep_mask(z, jnp.array([-1, 64, 0]), jnp.ones(3))))


def test_greedy_is_first_argmax():
    logits = jnp.array([[0.0, 2.0, 2.0, 1.0], [5.0, -1.0, 5.0, 0.0]])
    toks = S.sample_tokens(logits, jnp.zeros(2), jnp.array([-1, -1]), jnp.ones(2), jnp.array([1, 2]), jnp.zeros(2, jnp.int32))
    assert toks.tolist() == [1, 0]


def test_same_seed_same_token_regardless_of_batch():
    """Row r's draw depends on (logits, params, seed, step) only — not on the other rows or the batch size."""
    rng = np.random.default_rng(4)
    b, v = 12, 211
    logits = (rng.normal(size=(b, v)) * 2).astype(np.float32)
    temps = rng.uniform(0.3, 1.5, size=b).astype(np.float32)
    top_k = rng.choice([-1, 3, 50], size=b)
    top_p = rng.choice([1.0, 0.8], size=b).astype(np.float32)
    seeds = rng.integers(0, 2**31 - 1, size=b)
    steps = rng.integers(0, 1000, size=b)
    f = jax.jit(S.sample_tokens)
    full = np.asarray(f(logits, temps, top_k, top_p, seeds, steps))
    for r in range(b):
        # a batch of one, and a batch of 3 with r in the middle beside unrelated rows
        one = np.asarray(f(logits[r : r + 1], temps[r : r + 1], top_k[r : r + 1], top_p[r : r + 1], seeds[r : r + 1], steps[r : r + 1]))
        idx = [(r + 5) % b, r, (r + 7) % b]
        mid = np.asarray(f(logits[idx], temps[idx], np.array([-1, top_k[r], -1]), np.array([1.0, top_p[r], 1.0], np.float32), seeds[idx], steps[idx]))
        assert one[0] == full[r] == mid[1]
    # a different seed or step changes the draws (not a constant function)
    other = np.asarray(f(logits, temps, top_k, top_p, seeds + 1, steps))
    later = np.asarray(f(logits, temps, top_k, top_p, seeds, steps + 1))
    assert (other != full).any() and (later != full).any()


def test_unit_temperature_branch_gives_the_general_branchs_bits():
    """A batch at temperature 1 (or greedy) without filters takes `sample_with_logprobs`' branch with no division;
    each row must keep its tokens and log-prob bits when one more row (T = 0.7, or top-k) sends the batch down the
    general branch, and the log-probs are `token_logprobs`'. Edge logits: +-inf, NaN-free huge values, subnormals."""
    rng = np.random.default_rng(11)
    b, v = 6, 389
    logits = (rng.normal(size=(b + 1, v)) * 3).astype(np.float32)
    logits[1, 7] = np.inf
    logits[2, :5] = -np.inf
    logits[3, 10:20] = np.float32(1e-40)  # subnormals
    logits[4, 3] = np.float32(3e38)
    temps = np.array([1.0, 1.0, 0.0, 1.0, 0.0, 1.0, 0.7], np.float32)
    top_k = np.full(b + 1, -1)
    top_p = np.ones(b + 1, np.float32)
    seeds = rng.integers(0, 2**31 - 1, size=b + 1)
    steps = rng.integers(0, 1000, size=b + 1)
    f = jax.jit(S.sample_with_logprobs)
    unit_tok, unit_lp = map(np.asarray, f(logits[:b], temps[:b], top_k[:b], top_p[:b], seeds[:b], steps[:b]))
    gen_tok, gen_lp = map(np.asarray, f(logits, temps, top_k, top_p, seeds, steps))
    k_top = top_k.copy()
    k_top[-1] = 5
    filt_tok, filt_lp = map(np.asarray, f(logits, np.r_[temps[:b], 1.0].astype(np.float32), k_top, top_p, seeds, steps))
    np.testing.assert_array_equal(unit_tok, gen_tok[:b])
    np.testing.assert_array_equal(unit_tok, filt_tok[:b])
    for lp in (gen_lp[:b], filt_lp[:b]):
        np.testing.assert_array_equal(unit_lp.view(np.uint32), lp.view(np.uint32))
    ref = np.asarray(jax.jit(S.token_logprobs)(logits, gen_tok, temps))
    np.testing.assert_array_equal(gen_lp.view(np.uint32), ref.view(np.uint32))
    assert unit_tok[1] == 7  # an infinite logit is always drawn


def test_a_static_plain_flag_gives_the_conditionals_bits_without_a_conditional():
    """`plain=True` (every row checked with `plain_sampling` on the host) and `plain=False` take their branch with no
    `lax.cond` (on a GPU a conditional waits for its predicate on the host every decode step) and give the bits the
    device-side choice gives."""
    rng = np.random.default_rng(12)
    b, v = 5, 389
    logits = (rng.normal(size=(b, v)) * 3).astype(np.float32)
    logits[1, 7] = np.inf
    logits[3, 10:20] = np.float32(1e-40)
    temps = np.array([1.0, 0.0, 1.0, 1.0, 0.0], np.float32)
    top_k, top_p = np.full(b, -1), np.ones(b, np.float32)
    seeds, steps = rng.integers(0, 2**31 - 1, size=b), rng.integers(0, 1000, size=b)
    assert all(S.plain_sampling(float(t), -1, 1.0, v) for t in temps)
    assert not S.plain_sampling(0.7, -1, 1.0, v) and not S.plain_sampling(1.0, 5, 1.0, v) and not S.plain_sampling(1.0, -1, 0.9, v)
    assert S.plain_sampling(1.0, v, 1.0, v)  # top-k of the whole vocabulary filters nothing
    args = (logits, temps, top_k, top_p, seeds, steps)
    outs = {plain: tuple(map(np.asarray, jax.jit(lambda *a, plain=plain: S.sample_with_logprobs(*a, plain=plain))(*args)))
            for plain in (None, True, False)}
    for plain in (True, False):
        np.testing.assert_array_equal(outs[plain][0], outs[None][0])
        np.testing.assert_array_equal(outs[plain][1].view(np.uint32), outs[None][1].view(np.uint32))
    lowered = jax.jit(lambda *a: S.sample_with_logprobs(*a, plain=True)).lower(*args).as_text()
    assert "stablehlo.case" not in lowered and "stablehlo.if" not in lowered
    assert "stablehlo.case" in jax.jit(S.sample_with_logprobs).lower(*args).as_text()


def _draw_many(logits_row, temperature, top_k, top_p, n=4000):
    v = logits_row.shape[0]
    logits = jnp.broadcast_to(jnp.asarray(logits_row, jnp.float32), (n, v))
    toks = jax.jit(S.sample_tokens)(
        logits, jnp.full((n,), temperature, jnp.float32), jnp.full((n,), top_k), jnp.full((n,), top_p, jnp.float32),
        jnp.arange(n), jnp.zeros((n,), jnp.int32))
    return np.bincount(np.asarray(toks), minlength=v) / n


def _close(freq, p, n=4000):
    # 5 sigma binomial bound per token
    sigma = np.sqrt(p * (1 - p) / n)
    assert np.all(np.abs(freq - p) <= 5 * sigma + 1e-9), (freq, p)


def test_sampling_distribution_temperature():
    logits = np.log(np.array([0.5, 0.25, 0.15, 0.1]))
    for t in (1.0, 0.5, 2.0):
        p = np.exp(_np_log_softmax(logits / t))
        _close(_draw_many(logits, t, -1, 1.0), p)


def test_sampling_distribution_top_k_top_p():
    logits = np.log(np.array([0.45, 0.3, 0.15, 0.07, 0.03]))
    freq = _draw_many(logits, 1.0, 2, 1.0)
    _close(freq, np.array([0.6, 0.4, 0, 0, 0]))
    freq = _draw_many(logits, 1.0, -1, 0.8)  # mass before: 0, .45, .75, .9 -> keep 3
    _close(freq, np.array([0.45, 0.3, 0.15, 0, 0]) / 0.9)
    freq = _draw_many(logits, 1.0, 2, 0.8)  # top-k is the tighter rule
    _close(freq, np.array([0.6, 0.4, 0, 0, 0]))
    freq = _draw_many(logits, 1.0, -1, 0.3)  # only the top token
    np.testing.assert_array_equal(freq, [1, 0, 0, 0, 0])


@pytest.mark.parametrize("vocab", [1000, 20000])
def test_two_level_draw_samples_the_softmax_across_chunks(vocab):
    """The chunk is drawn by its mass, then the token inside it: tokens spread over several strided chunks (and, at
    20000, the long tree's cut kernels: 256 chunks of 128) are drawn with their softmax probabilities; a token of a
    chunk whose other members are negligible, and a negligible token beside a heavy one in its chunk, too."""
    p = 1 << (vocab - 1).bit_length()
    chunks = p >> 7
    probs = np.full(vocab, 1e-12)
    heavy = {3: 0.3, 3 + chunks: 0.2, 5: 0.15, chunks - 2: 0.1, vocab - 1: 0.1, 2 * chunks + 5: 0.1, chunks + 1: 0.05}
    for t, q in heavy.items():
        probs[t] = q
    logits = np.log(probs / probs.sum()).astype(np.float32)
    freq = _draw_many(logits, 1.0, -1, 1.0, n=20000)
    ref = np.exp(_np_log_softmax(logits[None])[0])
    n = 20000
    sigma = np.sqrt(ref * (1 - ref) / n)
    assert np.all(np.abs(freq - ref) <= 5 * sigma + 1e-9), {t: (freq[t], ref[t]) for t in heavy}
    assert abs(freq[list(heavy)].sum() - 1.0) < 1e-9


def test_two_level_draw_respects_the_keep_mask_in_every_chunk():
    """top-k over a vocabulary of many chunks: only the kept tokens are drawn, with their renormalized mass; a
    chunk whose members are all dropped is never drawn (its kept mass is zero)."""
    vocab = 1000
    rng = np.random.default_rng(21)
    logits = rng.normal(size=vocab).astype(np.float32)
    top = np.argsort(-logits, kind="stable")[:4]
    freq = _draw_many(logits, 1.0, 4, 1.0, n=20000)
    ref = np.zeros(vocab)
    ref[top] = np.exp(logits[top] - logits[top].max())
    ref /= ref.sum()
    sigma = np.sqrt(ref * (1 - ref) / 20000)
    assert np.all(np.abs(freq - ref) <= 5 * sigma + 1e-9)
    assert abs(freq[top].sum() - 1.0) < 1e-9


@pytest.mark.parametrize("vocab", [1, 2, 3])
def test_tiny_vocabularies_draw_valid_tokens(vocab):
    logits = np.log(np.arange(1, vocab + 1, dtype=np.float64) / (vocab * (vocab + 1) / 2)).astype(np.float32)
    freq = _draw_many(logits, 1.0, -1, 1.0)
    ref = np.arange(1, vocab + 1) / (vocab * (vocab + 1) / 2)
    assert np.all(np.abs(freq - ref) <= 5 * np.sqrt(ref * (1 - ref) / 4000) + 1e-9)


@pytest.mark.parametrize("vocab", [259, 301])
def test_gumbel_noise_row_invariant(vocab):
    """Odd vocabularies put a row's tail in XLA:CPU's scalar remainder loop unless log runs lane-wise."""
    keys = S.row_keys(jnp.arange(7) * 1000 + 5, jnp.arange(7))
    full = np.asarray(jax.jit(S.gumbel_noise, static_argnums=1)(keys, vocab))
    for r in (0, 3, 6):
        one = np.asarray(jax.jit(S.gumbel_noise, static_argnums=1)(keys[r : r + 1], vocab))
        np.testing.assert_array_equal(one[0].view(np.uint32), full[r].view(np.uint32))
    assert np.isfinite(full).all()
    assert abs(full.mean() - 0.5772) < 0.05  # Euler-Mascheroni: the Gumbel mean


def test_noise_bits_are_uniform_and_uncorrelated():
    """The counter-based bits, as a generator: each bit is 1 half the time, the open uniforms have the moments of
    U(0, 1) and a flat histogram, and neighbours (next index, next row, next step of one seed) are uncorrelated."""
    seeds = jnp.arange(64) * 7919 + 3
    bits = np.asarray(S.noise_bits(S.row_keys(seeds, jnp.zeros(64, jnp.int32)), 4096))
    n = bits.size
    ones = np.unpackbits(bits.view(np.uint8)).reshape(-1, 32).mean(axis=0)
    assert np.all(np.abs(ones - 0.5) < 5 * 0.5 / np.sqrt(n)), ones
    u = np.asarray(S.open_uniform(jnp.asarray(bits))).astype(np.float64)
    assert 0 < u.min() and u.max() < 1
    assert abs(u.mean() - 0.5) < 5 * np.sqrt(1 / 12 / n)
    assert abs(u.var() - 1 / 12) < 5 * np.sqrt(1 / 180 / n)
    counts = np.histogram(u, bins=64, range=(0, 1))[0]
    chi2 = ((counts - n / 64) ** 2 / (n / 64)).sum()
    assert chi2 < 63 + 6 * np.sqrt(2 * 63), chi2  # 6 sigma of chi-square with 63 degrees of freedom
    later = np.asarray(S.open_uniform(S.noise_bits(S.row_keys(seeds, jnp.ones(64, jnp.int32)), 4096))).astype(np.float64)
    bound = 5 / np.sqrt(n)
    for a, b in ((u[:, 1:], u[:, :-1]), (u[1:], u[:-1]), (u, later)):
        assert abs(np.corrcoef(a.ravel(), b.ravel())[0, 1]) < bound


def test_gumbel_noise_has_the_gumbel_moments():
    keys = S.row_keys(jnp.arange(32) + 11, jnp.full((32,), 5))
    g = np.asarray(S.gumbel_noise(keys, 8192)).astype(np.float64)
    assert np.isfinite(g).all()
    assert abs(g.mean() - 0.5772157) < 0.01  # Euler-Mascheroni
    assert abs(g.var() - np.pi**2 / 6) < 0.03
