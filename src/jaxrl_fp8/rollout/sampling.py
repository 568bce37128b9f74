"""Token sampling for the embedded engine: temperature, top-k, top-p and per-request seeds. Pure functions.

Conventions (the trainer must use the same ones, see docs/decisions/0008-embedded-engine.md):

- Tempered logits `z = logits / T` per row, as a correctly rounded float32 division (`precision.ieee_div`;
  a plain `/` by a constant may be compiled into a multiply by the reciprocal). `T == 0` means greedy, and
  then `z = logits` (log-probs are reported at temperature 1, as SGLang does).
- The rollout log-prob of a token is `log_softmax(z)[token]` over the FULL vocabulary: top-k / top-p only
  restrict which tokens may be drawn, never the distribution the log-prob is measured under. This is the
  policy the trainer's importance ratio refers to; `token_logprobs` is the one implementation.
- Randomness: the token drawn for row b at response step t depends only on (its logits, its parameters,
  `seed_b`, t) — the noise is a counter-based hash of an index under `fold_in(key(seed_b), t)` — so a sample
  does not depend on the batch it ran in. Drawing is a two-level Gumbel-max over the kept tokens (`draw_token`),
  which samples exactly the renormalized top-k/top-p distribution.
- Every reduction here is exact (max, argmax, sort, integer counts) or row invariant (`numerics`' pairwise
  sums and a fixed associative-scan prefix sum), so a row's result never depends on the batch shape.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxrl_fp8.model.numerics import (exp, lanewise, log_normalized, log_softmax, pick_logprobs, softmax,
                                     strided_partial_sums)
from jaxrl_fp8.precision.arith import ieee_div

F32 = jnp.float32

__all__ = [
    "effective_temperature",
    "tempered_logits",
    "token_logprobs",
    "keep_threshold",
    "keep_mask",
    "row_keys",
    "noise_bits",
    "noise_bits_at",
    "open_uniform",
    "gumbel_noise",
    "gumbel_noise_at",
    "draw_token",
    "plain_sampling",
    "sample_with_logprobs",
    "sample_tokens",
]


def effective_temperature(temperature):
    """The divisor of the logits: T, or 1 for greedy rows (T == 0). A Python / NumPy scalar gives a Python float
    (static: a divisor of exactly 1 can then be skipped), anything else a float32 array."""
    if isinstance(temperature, (int, float, np.number)):
        return float(temperature) if temperature > 0 else 1.0
    temperature = jnp.asarray(temperature, F32)
    return jnp.where(temperature > 0, temperature, F32(1.0))


def tempered_logits(logits: jax.Array, temperature) -> jax.Array:
    """float32 `logits / T` with IEEE division; `temperature` broadcasts against `logits.shape[:-1]`. A Python /
    NumPy scalar stays one, so that at T = 1 (or greedy 0) `ieee_div` skips its exact division by 1."""
    t = effective_temperature(temperature)
    return ieee_div(logits.astype(F32), t if isinstance(t, float) else t[..., None])


def token_logprobs(logits: jax.Array, tokens: jax.Array, temperature=1.0) -> jax.Array:
    """log_softmax(logits / T)[token] over the full vocabulary: `[..., V]`, `[...]` -> float32 `[...]`.

    The rollout log-prob convention; bit-identical whether `logits` has one row or many (row invariant).
    """
    return pick_logprobs(log_softmax(tempered_logits(logits, temperature)), tokens)


def _inclusive_prefix_sum(x: jax.Array) -> jax.Array:
    """Prefix sum along the last axis as a fixed tree of elementwise adds (row invariant)."""
    return lax.associative_scan(jnp.add, x, axis=x.ndim - 1)


def keep_threshold(z: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """float32 [B, 1]: the smallest tempered logit a token of z [B, V] may have and still be drawn under top-k then
    top-p (`keep_mask` is `z >= keep_threshold`).

    top_k int [B] (<= 0 or >= V: no limit); top_p float [B] in (0, 1] (>= 1: no limit). The top-p rule is
    SGLang's: in descending order, a token is dropped when the probability mass strictly before it exceeds
    top_p (so the most likely token is always kept). Both rules become one logit threshold; a token tied
    with the threshold logit is kept with it.
    """
    v = z.shape[-1]
    z_sorted = -jnp.sort(-z, axis=-1)  # descending; negation is exact
    top_k = jnp.asarray(top_k, jnp.int32)
    k = jnp.where((top_k <= 0) | (top_k > v), v, top_k)
    probs = softmax(z_sorted)
    mass_before = jnp.concatenate([jnp.zeros_like(probs[:, :1]), _inclusive_prefix_sum(probs)[:, :-1]], axis=-1)
    top_p = jnp.asarray(top_p, F32)[:, None]
    over = (mass_before > top_p) & (top_p < 1.0)
    n_p = jnp.where(jnp.any(over, axis=-1), jnp.argmax(over, axis=-1), v)
    n_keep = jnp.maximum(jnp.minimum(k, n_p), 1)
    return jnp.take_along_axis(z_sorted, (n_keep - 1)[:, None], axis=-1)


def keep_mask(z: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """bool [B, V]: tokens of tempered logits z [B, V] that may be drawn under top-k then top-p (`keep_threshold`)."""
    return z >= keep_threshold(z, top_k, top_p)


def row_keys(seeds: jax.Array, steps: jax.Array) -> jax.Array:
    """One PRNG key per row: fold_in(key(seed_b), step_b). seeds/steps int [B]."""
    return jax.vmap(lambda s, t: jax.random.fold_in(jax.random.key(s), t))(
        jnp.asarray(seeds, jnp.uint32), jnp.asarray(steps, jnp.uint32)
    )


def _fmix32(h: jax.Array) -> jax.Array:
    """murmur3's 32-bit finaliser: a bijection of uint32 in which every input bit flips each output bit with
    probability ~1/2."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def noise_bits_at(keys: jax.Array, index: jax.Array) -> jax.Array:
    """uint32 [B, n]: row b's bits at counter index[b, i] (uint32 [B or 1, n]), fmix32(fmix32(index * golden + k0) ^
    k1) with (k0, k1) the words of its key. Counter-based (a pure function of the key and the index: no state, any
    batch), ~14 integer operations an element: threefry's 20 rounds (`jax.random.bits`) made the noise over the
    whole vocabulary the decode step's largest XLA kernel (H100, results/vocab_side_h100.json)."""
    words = jax.random.key_data(keys).reshape(keys.shape[0], -1).astype(jnp.uint32)
    index = jnp.asarray(index).astype(jnp.uint32)
    return _fmix32(_fmix32(index * jnp.uint32(0x9E3779B9) + words[:, :1]) ^ words[:, 1:2])


def noise_bits(keys: jax.Array, vocab: int) -> jax.Array:
    """uint32 [B, vocab]: `noise_bits_at` the indices 0 .. vocab - 1."""
    return noise_bits_at(keys, jnp.arange(vocab, dtype=jnp.uint32)[None, :])


def open_uniform(bits: jax.Array) -> jax.Array:
    """float32 in (0, 1) from the top 23 of uint32 bits: (k + 1/2) / 2^23, exact, symmetric about 1/2, never 0 or 1
    (so both logs of the Gumbel transform are finite)."""
    one_to_two = lax.bitcast_convert_type((bits >> 9) | jnp.uint32(0x3F800000), F32)
    return (one_to_two - F32(1.0)) + F32(2.0**-24)


def gumbel_noise_at(keys: jax.Array, index: jax.Array) -> jax.Array:
    """float32 standard Gumbel noise -log(-log u) at counter indices index [B or 1, n] (`noise_bits_at`).

    The bits are integer work (batch independent); the two logs run through `numerics.lanewise`,
    because XLA:CPU's scalar remainder loop computes `log` differently from its vector body, which would
    make the noise of a row's last entries depend on the batch size.
    """
    u = open_uniform(noise_bits_at(keys, index))
    return -lanewise(jnp.log, -lanewise(jnp.log, u))


def gumbel_noise(keys: jax.Array, vocab: int) -> jax.Array:
    """float32 [B, vocab]: `gumbel_noise_at` the indices 0 .. vocab - 1, one independent stream per row key."""
    return gumbel_noise_at(keys, jnp.arange(vocab, dtype=jnp.uint32)[None, :])


def draw_token(z: jax.Array, keep, keys: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One token per row drawn with probability softmax(z) renormalized over `keep`, and the row's log-partition
    pieces: (int32 [B], m float32 [B, 1], total float32 [B]) with log_softmax(z) = z - m - log(total) (the bits of
    `numerics.log_softmax`, which `token_logprobs` picks from).

    Two-level Gumbel-max. The log-softmax tree's first kernel already sums exp(z - m) into C partial sums of
    strided chunks (chunk j = tokens j, j + C, j + 2C, ...; C = 2048 at a 151,936 vocabulary,
    `numerics.strided_partial_sums`). A chunk is drawn by Gumbel-max over the log of its kept mass (noise at
    counter 2^ceil(log2 V) + j), then a token inside it by Gumbel-max over its kept logits (noise at the token's
    index). P(token) = P(chunk) x P(token | chunk) = its renormalized probability, as one Gumbel-max over the whole
    vocabulary gives, but with two logs for 2,048 chunks and 128 chunk members a row instead of for 151,936 tokens:
    that noise was the decode step's largest XLA kernel (0.15 ms of a 3.75 ms step at 256 rows on an H100, compute
    bound). The bounded noise (u in [2^-24, 1 - 2^-24]: Gumbel in [-2.8, 16.7]) leaves out a chunk or token ~19.5
    nats below the best one, as the one-level draw does; float32 chunk masses round to 2^-24 of themselves.
    keep: True or bool [B, V]."""
    v = z.shape[-1]
    m = jnp.max(z, axis=-1, keepdims=True)
    e = exp(z - m)
    if keep is not True:
        e = jnp.where(keep, e, F32(0.0))
    total, chunk_mass = strided_partial_sums(e)
    chunks = chunk_mass.shape[-1]
    members = -(-v // chunks)  # a chunk's tokens below v (the rest of it is the tree's zero padding)
    first_chunk_counter = 1 << (v - 1).bit_length()  # past every token's counter
    chunk_noise = gumbel_noise_at(keys, jnp.arange(chunks, dtype=jnp.uint32)[None, :] + jnp.uint32(first_chunk_counter))
    chunk = jnp.argmax(lanewise(jnp.log, chunk_mass) + chunk_noise, axis=-1).astype(jnp.int32)
    token_of = chunk[:, None] + chunks * jnp.arange(members, dtype=jnp.int32)[None, :]
    inside = token_of < v
    token_of = jnp.minimum(token_of, v - 1)
    zc = jnp.take_along_axis(z, token_of, axis=-1)
    allowed = inside if keep is True else inside & jnp.take_along_axis(keep, token_of, axis=-1)
    pick = jnp.argmax(jnp.where(allowed, zc + gumbel_noise_at(keys, token_of), -jnp.inf), axis=-1)
    token = jnp.take_along_axis(token_of, pick[:, None], axis=-1)[:, 0]
    return token, m, total


def plain_sampling(temperature: float, top_k: int, top_p: float, vocab: int) -> bool:
    """Host check of one request's parameters: temperature 1 or greedy (0), no top-k / top-p filter, RL's usual
    setting. A batch whose every row is plain may call `sample_with_logprobs(plain=True)`."""
    return temperature in (0.0, 1.0) and (top_k <= 0 or top_k >= vocab) and top_p >= 1.0


def sample_with_logprobs(logits, temperature, top_k, top_p, seeds, steps, *, plain: bool | None = None) -> tuple[jax.Array, jax.Array]:
    """Draw one token per row from logits [B, V] and give its rollout log-prob: (int32 [B], float32 [B]).

    temperature f32 [B] (0: greedy = first argmax of the logits), top_k int [B], top_p f32 [B], seeds int [B],
    steps int [B] (the response index of the token being drawn). The log-prob has `token_logprobs`' bits.

    The tempered logits are computed once for both. When every row runs at temperature 1 (or greedy) without
    top-k / top-p, RL's usual setting, one branch skips the division: x / 1 = x exactly, so it gives the other
    branch's bits without writing the [B, V] divisor and quotient that `ieee_div` must materialise (a decode step
    of 256 rows: 2 x 156 MB). Only a batch in which some row filters sorts the vocabulary.

    plain: None decides on the device (a `lax.cond`, which on a GPU waits for its predicate on the host: one
    synchronisation per decode step); True (the caller checked every row with `plain_sampling`) or False take their
    branch with no conditional. The three give the same bits.
    """
    logits = logits.astype(F32)
    b, v = logits.shape
    temperature = jnp.broadcast_to(jnp.asarray(temperature, F32), (b,))
    top_k = jnp.asarray(top_k, jnp.int32)
    top_p = jnp.asarray(top_p, F32)
    filters = jnp.any(((top_k > 0) & (top_k < v)) | (top_p < 1.0))
    keys = row_keys(seeds, steps)

    def draw(z, keep):
        drawn, m, total = draw_token(z, keep, keys)
        greedy = jnp.argmax(logits, axis=-1)
        tokens = jnp.where(temperature > 0, drawn, greedy).astype(jnp.int32)
        if keep is True:  # the draw's tree is log_softmax's: its total gives token_logprobs' bits, no second pass
            return tokens, pick_logprobs(log_normalized(z - m, total[:, None]), tokens)
        return tokens, token_logprobs(z, tokens)  # z is tempered already: the host temperature 1 divides nothing

    def unit_unfiltered():
        return draw(logits, True)

    def general():
        z = tempered_logits(logits, temperature)
        threshold = lax.cond(filters, lambda: keep_threshold(z, top_k, top_p), lambda: jnp.full((b, 1), -jnp.inf, F32))
        return draw(z, jnp.where(filters, z >= threshold, True))

    if plain is not None:
        return unit_unfiltered() if plain else general()
    unit = jnp.all(effective_temperature(temperature) == 1.0)
    return lax.cond(unit & ~filters, unit_unfiltered, general)


def sample_tokens(logits, temperature, top_k, top_p, seeds, steps) -> jax.Array:
    """The tokens of `sample_with_logprobs` (int32 [B])."""
    return sample_with_logprobs(logits, temperature, top_k, top_p, seeds, steps)[0]
