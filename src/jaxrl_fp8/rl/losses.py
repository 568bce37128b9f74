"""Policy-gradient loss of the trainer: PPO clip (asymmetric, optional dual clip) × TIS weight, plus an
optional KL penalty to a frozen reference and an entropy bonus. Pure `jnp`, masked by the response mask.

Conventions follow Miles' defaults (the RL system this project re-implements):
- `ppo_kl = old_logp - logp` (reported as a metric); ratio `r = exp(clamp(logp - old_logp, ±20))`.
- Per-token PPO loss `max(-r·A, -clip(r, 1-eps_clip, 1+eps_clip_high)·A)`; `pg_clipfrac` is the share of
  tokens where the clipped term is strictly larger. Dual clip (`dual_clip_c` > 1): for A < 0 the loss is
  additionally capped at `-c·A`.
- TIS: `w = clamp(exp(old_logp_train - rollout_logp), tis_clip_low, tis_clip)` under stop-gradient,
  multiplying the per-token policy loss; `tis` reports the *unclipped* ratio mean, `tis_clipfrac` the share
  of tokens where clamping changed it.
- KL to the reference: with `d = ref_logp - logp`, k1 = `-d` (= logp - ref), k2 = `d²/2`,
  k3 = `exp(d) - d - 1`, low_var_kl = k3 clamped to [-10, 10].
- Total: `loss = pg_loss - entropy_coef·entropy + kl_coef·kl`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxrl_fp8.model import numerics

LOG_RATIO_CLAMP = 20.0
LOW_VAR_KL_CLAMP = 10.0
KL_TYPES = ("k1", "k2", "k3", "low_var_kl")
LOSS_AGG_MODES = ("token_mean", "seq_mean_token_mean")


@dataclasses.dataclass(frozen=True)
class PolicyLossConfig:
    """Hyper-parameters of `policy_loss`; defaults are the reference recipes' values."""

    eps_clip: float = 0.2
    eps_clip_high: float = 0.28
    dual_clip_c: float | None = None  # e.g. 3.0; None disables dual clip
    use_tis: bool = True
    tis_clip: float = 2.0
    tis_clip_low: float = 0.0
    kl_coef: float = 0.0  # 0 disables the reference-KL term (ref_logp may then be None)
    kl_type: str = "low_var_kl"
    entropy_coef: float = 0.0
    loss_agg: str = "token_mean"

    def __post_init__(self):
        if not self.eps_clip > 0 or not self.eps_clip_high > 0:
            raise ValueError(f"eps_clip={self.eps_clip} and eps_clip_high={self.eps_clip_high} must be > 0")
        if self.eps_clip >= 1:
            raise ValueError(f"eps_clip={self.eps_clip} must be < 1 (the lower ratio bound is 1 - eps_clip)")
        if self.dual_clip_c is not None and not self.dual_clip_c > 1:
            raise ValueError(f"dual_clip_c={self.dual_clip_c} must be > 1 (or None to disable dual clip)")
        if not 0 <= self.tis_clip_low < self.tis_clip:
            raise ValueError(f"need 0 <= tis_clip_low ({self.tis_clip_low}) < tis_clip ({self.tis_clip})")
        if self.kl_type not in KL_TYPES:
            raise ValueError(f"kl_type={self.kl_type!r} must be one of {KL_TYPES}")
        if self.loss_agg not in LOSS_AGG_MODES:
            raise ValueError(f"loss_agg={self.loss_agg!r} must be one of {LOSS_AGG_MODES}")
        if self.kl_coef < 0 or self.entropy_coef < 0:
            raise ValueError(f"kl_coef={self.kl_coef} and entropy_coef={self.entropy_coef} must be >= 0")


# ---------------------------------------------------------------------------------------------------------
# masked reductions


def _valid(mask: jax.Array) -> jax.Array:
    return jnp.asarray(mask) > 0


def masked_sum(x: jax.Array, mask: jax.Array) -> jax.Array:
    """Sum of `x` over valid tokens; NaN/inf outside the mask do not leak in (where, not multiply)."""
    return jnp.sum(jnp.where(_valid(mask), x, 0.0))


def masked_mean(x: jax.Array, mask: jax.Array) -> jax.Array:
    """Mean over valid tokens; 0 when the mask is empty."""
    count = jnp.sum(_valid(mask).astype(jnp.float32))
    return masked_sum(x, mask) / jnp.maximum(count, 1.0)


def aggregate(
    x: jax.Array,
    mask: jax.Array,
    mode: str = "token_mean",
    *,
    num_tokens: jax.Array | float | None = None,
    num_sequences: jax.Array | float | None = None,
) -> jax.Array:
    """Reduce a per-token `[B, T]` quantity to a scalar.

    - `token_mean`: Σ over valid tokens / number of valid tokens (every token weighs the same).
    - `seq_mean_token_mean`: mean over sequences of each sequence's token mean (every sequence weighs the
      same); sequences without a valid token are left out.
    `num_tokens` / `num_sequences` override the denominators, so that micro-batches of one global batch
    can be summed to the global-batch value (gradient accumulation).
    """
    valid = _valid(mask)
    if x.ndim != 2 or valid.shape != x.shape:
        raise ValueError(f"per-token values {x.shape} and mask {valid.shape} must both be [B, T]")
    xv = jnp.where(valid, x, 0.0)
    if mode == "token_mean":
        denom = jnp.sum(valid.astype(jnp.float32)) if num_tokens is None else num_tokens
        return jnp.sum(xv) / jnp.maximum(denom, 1.0)
    if mode == "seq_mean_token_mean":
        per_seq_count = jnp.sum(valid.astype(jnp.float32), axis=1)
        per_seq = jnp.sum(xv, axis=1) / jnp.maximum(per_seq_count, 1.0)
        denom = jnp.sum((per_seq_count > 0).astype(jnp.float32)) if num_sequences is None else num_sequences
        return jnp.sum(per_seq) / jnp.maximum(denom, 1.0)
    raise ValueError(f"loss aggregation mode {mode!r} must be one of {LOSS_AGG_MODES}")


# ---------------------------------------------------------------------------------------------------------
# per-token pieces


def entropy_from_logits(logits: jax.Array) -> jax.Array:
    """Entropy of softmax(logits) per position, float32: `[..., V]` → `[...]`, through the row-invariant log-softmax
    the log-probs use (`numerics.log_softmax`), so that beside `token_logprobs` of the same logits it needs one
    vocabulary pass of its own (XLA shares the max and the normaliser)."""
    return entropy_from_log_softmax(numerics.log_softmax(logits))


def entropy_from_log_softmax(logp: jax.Array) -> jax.Array:
    """-sum(p log p) over the last axis of float32 log-probabilities `logp` `[..., V]`."""
    return -jnp.sum(jnp.exp(logp) * logp, axis=-1)


def ppo_clip_loss(
    logp: jax.Array,
    old_logp: jax.Array,
    advantages: jax.Array,
    eps_clip: float,
    eps_clip_high: float,
    dual_clip_c: float | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per-token PPO clip loss. Returns `(loss, clipped, dual_clipped)`, the latter two as float 0/1."""
    log_ratio = jnp.clip(logp - old_logp, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = jnp.exp(log_ratio)
    loss_unclipped = -ratio * advantages
    loss_clipped = -jnp.clip(ratio, 1.0 - eps_clip, 1.0 + eps_clip_high) * advantages
    loss = jnp.maximum(loss_unclipped, loss_clipped)
    clipped = (loss_clipped > loss_unclipped).astype(jnp.float32)
    dual_clipped = jnp.zeros_like(clipped)
    if dual_clip_c is not None:
        cap = -dual_clip_c * advantages
        negative = advantages < 0
        dual_clipped = (negative & (cap < loss)).astype(jnp.float32)
        loss = jnp.where(negative, jnp.minimum(loss, cap), loss)
    return loss, clipped, dual_clipped


def tis_weights(
    old_logp: jax.Array, rollout_logp: jax.Array, tis_clip_low: float, tis_clip: float
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Truncated importance weight (train-old vs rollout), stop-gradient.

    Returns `(weight, ratio, clipped)`: the clamped weight, the unclamped ratio and a 0/1 clip indicator.
    The log-ratio is clamped to ±20 before `exp` so that a wild rollout logprob cannot produce inf.
    """
    log_ratio = jnp.clip(old_logp - rollout_logp, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = jax.lax.stop_gradient(jnp.exp(log_ratio))
    weight = jnp.clip(ratio, tis_clip_low, tis_clip)
    clipped = (weight != ratio).astype(jnp.float32)
    return weight, ratio, clipped


def approx_kl(logp: jax.Array, ref_logp: jax.Array, kl_type: str) -> jax.Array:
    """Per-token estimator of KL(π_θ ‖ π_ref) from samples of π_θ (Schulman's k1/k2/k3)."""
    log_ratio = logp - ref_logp
    if kl_type == "k1":
        return log_ratio
    if kl_type == "k2":
        return 0.5 * log_ratio * log_ratio
    if kl_type in ("k3", "low_var_kl"):
        d = jnp.clip(-log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP) if kl_type == "low_var_kl" else -log_ratio
        kl = jnp.exp(d) - d - 1.0
        if kl_type == "low_var_kl":
            kl = jnp.clip(kl, -LOW_VAR_KL_CLAMP, LOW_VAR_KL_CLAMP)
        return kl
    raise ValueError(f"kl_type={kl_type!r} must be one of {KL_TYPES}")


# ---------------------------------------------------------------------------------------------------------
# the loss


def policy_loss(
    logp: jax.Array,
    old_logp: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    config: PolicyLossConfig = PolicyLossConfig(),
    *,
    rollout_logp: jax.Array | None = None,
    ref_logp: jax.Array | None = None,
    entropy: jax.Array | None = None,
    num_tokens: jax.Array | float | None = None,
    num_sequences: jax.Array | float | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Total loss and metrics for one (micro-)batch. All per-token inputs are `[B, T]`.

    `logp` carries the gradient (current policy, training format); `old_logp` is the policy that generated
    the batch recomputed in the training format (constant); `rollout_logp` is what the rollout engine
    reported (needed when `config.use_tis`); `ref_logp` the frozen reference (needed when `kl_coef > 0`);
    `entropy` per token (optional; needed when `entropy_coef > 0`). `advantages` may be `[B]` (broadcast
    over tokens) or `[B, T]`. Metric values are masked token means (whatever `loss_agg` is), so they are
    comparable across aggregation modes.
    """
    logp = jnp.asarray(logp, jnp.float32)
    old_logp = jax.lax.stop_gradient(jnp.asarray(old_logp, jnp.float32))
    shape = logp.shape
    if logp.ndim != 2:
        raise ValueError(f"logp must be [B, T], got {shape}")
    for name, value in (("old_logp", old_logp), ("mask", mask), ("rollout_logp", rollout_logp),
                        ("ref_logp", ref_logp), ("entropy", entropy)):
        if value is not None and jnp.shape(value) != shape:
            raise ValueError(f"{name} has shape {jnp.shape(value)}, expected {shape} like logp")
    advantages = jax.lax.stop_gradient(jnp.asarray(advantages, jnp.float32))
    if advantages.shape == shape[:1]:
        advantages = jnp.broadcast_to(advantages[:, None], shape)
    elif advantages.shape != shape:
        raise ValueError(f"advantages has shape {advantages.shape}, expected {shape[:1]} or {shape}")

    # Zero every input outside the mask first: padding may hold NaN/inf, and a `where` placed only after the
    # math would still let NaN into the gradient (0 · NaN); cutting it at the input keeps gradients clean.
    valid = _valid(mask)
    clean = lambda x: None if x is None else jnp.where(valid, jnp.asarray(x, jnp.float32), 0.0)
    logp, old_logp, advantages = clean(logp), clean(old_logp), clean(advantages)
    rollout_logp, ref_logp, entropy = clean(rollout_logp), clean(ref_logp), clean(entropy)

    agg = lambda x: aggregate(x, mask, config.loss_agg, num_tokens=num_tokens, num_sequences=num_sequences)
    metrics: dict[str, jax.Array] = {}

    pg, clipped, dual_clipped = ppo_clip_loss(
        logp, old_logp, advantages, config.eps_clip, config.eps_clip_high, config.dual_clip_c
    )
    if config.use_tis:
        if rollout_logp is None:
            raise ValueError("config.use_tis=True needs rollout_logp (the rollout engine's logprobs)")
        weight, ratio, tis_clipped = tis_weights(
            old_logp, jnp.asarray(rollout_logp, jnp.float32), config.tis_clip_low, config.tis_clip
        )
        pg = pg * weight
        metrics["tis"] = masked_mean(ratio, mask)
        metrics["tis_weight"] = masked_mean(weight, mask)
        metrics["tis_abs"] = masked_mean(jnp.abs(ratio - 1.0), mask)
        metrics["tis_clipfrac"] = masked_mean(tis_clipped, mask)

    pg_loss = agg(pg)
    loss = pg_loss
    metrics["pg_loss"] = pg_loss
    metrics["pg_clipfrac"] = masked_mean(clipped, mask)
    if config.dual_clip_c is not None:
        metrics["pg_clipfrac_dual"] = masked_mean(dual_clipped, mask)
    metrics["ppo_kl"] = masked_mean(old_logp - logp, mask)

    if entropy is not None:
        entropy = jnp.asarray(entropy, jnp.float32)
        metrics["entropy"] = masked_mean(jax.lax.stop_gradient(entropy), mask)
        if config.entropy_coef > 0:
            loss = loss - config.entropy_coef * agg(entropy)
    elif config.entropy_coef > 0:
        raise ValueError(f"entropy_coef={config.entropy_coef} > 0 needs the per-token entropy")

    if config.kl_coef > 0:
        if ref_logp is None:
            raise ValueError(f"kl_coef={config.kl_coef} > 0 needs ref_logp (the frozen reference's logprobs)")
        kl = approx_kl(logp, jax.lax.stop_gradient(jnp.asarray(ref_logp, jnp.float32)), config.kl_type)
        kl_loss = agg(kl)
        metrics["kl_loss"] = kl_loss
        loss = loss + config.kl_coef * kl_loss

    metrics["loss"] = loss
    metrics = {k: jax.lax.stop_gradient(v) for k, v in metrics.items()}
    return loss, metrics


# policy_loss metrics aggregated with the caller's denominators (num_tokens / num_sequences): a batch's value is the
# sum of its micro-batches'; every other metric is a masked token mean
SUMMED_METRICS = frozenset({"loss", "pg_loss", "kl_loss"})


def combine_micro_metrics(per_micro: dict, counts: jax.Array) -> dict:
    """A minibatch's `policy_loss` metrics from its micro-batches' (`[n]` each): loss terms summed, masked token means
    weighted by each micro-batch's valid-token count (what the unsplit minibatch reports, up to float32 summation
    order)."""
    total = jnp.maximum(jnp.sum(counts), 1.0)
    return {k: jnp.sum(v) if k in SUMMED_METRICS else jnp.sum(v * counts) / total for k, v in per_micro.items()}
