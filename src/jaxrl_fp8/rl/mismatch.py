"""Train–rollout mismatch metrics: how far the trainer's log-probs of the sampled tokens are from the
rollout engine's. This is the number the unified low-precision contract drives to zero.

Sign convention (Miles', the system this project re-implements): `Δ = train_logp - rollout_logp` per token.
- `train_rollout_logprob_abs_diff` = masked mean `|Δ|`.
- `train_rollout_kl` = masked mean of K3 `exp(Δ) - 1 - Δ`. Samples come from the rollout policy μ and
  `exp(Δ) = π_train/μ`, so this is the unbiased, non-negative estimator of `KL(μ ‖ π_train)`. As in the
  reference (its `low_var_kl`), each token's value is clamped to at most 10; we also clamp `Δ` to ±20 before
  `exp` so that one broken token gives a large-but-finite value instead of inf. Neither clamp changes any
  token whose K3 is below 10 (|Δ| ≲ 2.5 on the positive side, ≲ 11 on the negative side).
- `tis_clipfrac` = share of tokens whose TIS ratio `exp(Δ)` falls outside `[tis_clip_low, tis_clip]`.
Non-finite values at masked-out positions never reach a metric (reductions use `where`, not multiply).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_fp8.rl.losses import LOG_RATIO_CLAMP, LOW_VAR_KL_CLAMP, masked_mean

__all__ = [
    "logprob_delta",
    "train_rollout_logprob_abs_diff",
    "train_rollout_kl",
    "tis_clipfrac",
    "per_sequence_max_abs_diff",
    "mismatch_metrics",
]


def logprob_delta(train_logp: jax.Array, rollout_logp: jax.Array) -> jax.Array:
    """`Δ = train - rollout` in float32 (the sign every metric here uses)."""
    train_logp = jnp.asarray(train_logp, jnp.float32)
    rollout_logp = jnp.asarray(rollout_logp, jnp.float32)
    if train_logp.shape != rollout_logp.shape:
        raise ValueError(f"train_logp {train_logp.shape} and rollout_logp {rollout_logp.shape} differ in shape")
    return train_logp - rollout_logp


def k3_per_token(delta: jax.Array) -> jax.Array:
    """`exp(Δ) - 1 - Δ` with Δ clamped to ±20 and the result clamped to ≤ 10 (see module doc)."""
    d = jnp.clip(delta, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return jnp.minimum(jnp.exp(d) - 1.0 - d, LOW_VAR_KL_CLAMP)


def train_rollout_logprob_abs_diff(train_logp: jax.Array, rollout_logp: jax.Array, mask: jax.Array) -> jax.Array:
    """Masked mean of `|train_logp - rollout_logp|`."""
    return masked_mean(jnp.abs(logprob_delta(train_logp, rollout_logp)), mask)


def train_rollout_kl(train_logp: jax.Array, rollout_logp: jax.Array, mask: jax.Array) -> jax.Array:
    """Masked mean of K3 of `Δ = train - rollout` (estimates KL(rollout ‖ train))."""
    return masked_mean(k3_per_token(logprob_delta(train_logp, rollout_logp)), mask)


def tis_clipfrac(
    train_logp: jax.Array, rollout_logp: jax.Array, mask: jax.Array, tis_clip_low: float = 0.0,
    tis_clip: float = 2.0,
) -> jax.Array:
    """Share of valid tokens whose TIS ratio `exp(Δ)` is clamped by `[tis_clip_low, tis_clip]`."""
    ratio = jnp.exp(jnp.clip(logprob_delta(train_logp, rollout_logp), -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    clipped = ((ratio < tis_clip_low) | (ratio > tis_clip)).astype(jnp.float32)
    return masked_mean(clipped, mask)


def per_sequence_max_abs_diff(train_logp: jax.Array, rollout_logp: jax.Array, mask: jax.Array) -> jax.Array:
    """`[B]`: the largest `|Δ|` over each sequence's valid tokens (0 for a sequence without one)."""
    diff = jnp.abs(logprob_delta(train_logp, rollout_logp))
    return jnp.max(jnp.where(jnp.asarray(mask) > 0, diff, 0.0), axis=-1)


def mismatch_metrics(
    train_logp: jax.Array, rollout_logp: jax.Array, mask: jax.Array, tis_clip_low: float = 0.0,
    tis_clip: float = 2.0,
) -> dict[str, jax.Array]:
    """All mismatch metrics of one batch, under the names the trainer logs."""
    per_seq = per_sequence_max_abs_diff(train_logp, rollout_logp, mask)
    return {
        "train_rollout_logprob_abs_diff": train_rollout_logprob_abs_diff(train_logp, rollout_logp, mask),
        "train_rollout_kl": train_rollout_kl(train_logp, rollout_logp, mask),
        "train_rollout_tis_clipfrac": tis_clipfrac(train_logp, rollout_logp, mask, tis_clip_low, tis_clip),
        "train_rollout_max_abs_diff": jnp.max(per_seq, initial=0.0),
        "train_rollout_seq_max_abs_diff_mean": jnp.mean(per_seq) if per_seq.size else jnp.float32(0.0),
    }
