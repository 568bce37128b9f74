"""Advantage estimators for outcome-reward RL (one scalar reward per response).

All functions are pure `jnp` and jit-friendly. Rewards are laid out the way the rollout returns them:
`num_prompts * group_size` responses, the `group_size` samples of one prompt contiguous
(`[p0s0, p0s1, ..., p1s0, ...]`), which is the reference system's layout.

GRPO follows the reference system: `(r - mean_g) / (std_g + eps)` with the *unbiased* (Bessel, ddof=1)
group standard deviation, as `torch.Tensor.std` computes it there. One deliberate difference: a group of a
single sample has an undefined unbiased std (the reference produces NaN); here its advantage is 0, because
a lone sample carries no relative signal.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

GRPO_EPS = 1e-6


def _grouped(rewards: jax.Array, group_size: int) -> jax.Array:
    rewards = jnp.asarray(rewards, jnp.float32)
    if rewards.ndim != 1:
        raise ValueError(f"rewards must be 1-D [num_responses], got shape {rewards.shape}")
    if group_size < 1 or rewards.shape[0] % group_size:
        raise ValueError(
                f"group_size={group_size} must be >= 1 and divide the number of responses {rewards.shape[0]}"
        )
    return rewards.reshape(-1, group_size)


def grpo_advantages(
    rewards: jax.Array,
    group_size: int,
    *,
    std_normalize: bool = True,
    eps: float = GRPO_EPS,
    ddof: int = 1,
) -> jax.Array:
    """Per-response GRPO advantages `[N]` from rewards `[N]` grouped contiguously by prompt.

    `std_normalize=False` gives the plain group-mean baseline (Dr. GRPO / REINFORCE with group baseline).
    Groups whose rewards are all equal get advantage exactly 0 (no signal, no noise).
    """
    grouped = _grouped(rewards, group_size)
    centered = grouped - grouped.mean(axis=1, keepdims=True)
    if std_normalize:
        if group_size - ddof <= 0:
            # Unbiased std is undefined for one sample; centered is already 0 there.
            return jnp.zeros_like(centered).reshape(-1)
        std = jnp.sqrt(jnp.sum(centered * centered, axis=1, keepdims=True) / (group_size - ddof))
        centered = centered / (std + eps)
    return centered.reshape(-1)


def grpo_advantages_by_group(
    rewards: jax.Array,
    group_ids: jax.Array,
    num_groups: int,
    *,
    std_normalize: bool = True,
    eps: float = GRPO_EPS,
    ddof: int = 1,
) -> jax.Array:
    """GRPO for groups of unequal size (e.g. after dropping failed samples); `group_ids[i]` in `[0, num_groups)`.

    Groups with `size <= ddof` get advantage 0 when `std_normalize` (std undefined).
    """
    rewards = jnp.asarray(rewards, jnp.float32)
    group_ids = jnp.asarray(group_ids, jnp.int32)
    if rewards.shape != group_ids.shape or rewards.ndim != 1:
        raise ValueError(f"rewards {rewards.shape} and group_ids {group_ids.shape} must be equal 1-D shapes")
    count = jax.ops.segment_sum(jnp.ones_like(rewards), group_ids, num_groups)
    mean = jax.ops.segment_sum(rewards, group_ids, num_groups) / jnp.maximum(count, 1.0)
    centered = rewards - mean[group_ids]
    if not std_normalize:
        return centered
    sq = jax.ops.segment_sum(centered * centered, group_ids, num_groups)
    dof = count - ddof
    std = jnp.sqrt(sq / jnp.maximum(dof, 1.0))
    adv = centered / (std[group_ids] + eps)
    return jnp.where(dof[group_ids] > 0, adv, 0.0)


def rloo_advantages(rewards: jax.Array, group_size: int) -> jax.Array:
    """Leave-one-out baseline: `r_i - mean_{j != i} r_j` (0 for single-sample groups)."""
    grouped = _grouped(rewards, group_size)
    if group_size == 1:
        return jnp.zeros_like(grouped).reshape(-1)
    total = grouped.sum(axis=1, keepdims=True)
    return (grouped - (total - grouped) / (group_size - 1)).reshape(-1)


def reinforce_advantages(rewards: jax.Array) -> jax.Array:
    """Plain REINFORCE: the advantage is the reward itself (no baseline)."""
    return jnp.asarray(rewards, jnp.float32)


def broadcast_to_tokens(advantages: jax.Array, response_mask: jax.Array) -> jax.Array:
    """Sequence advantages `[N]` → token advantages `[N, T]`, zero outside the response mask."""
    advantages = jnp.asarray(advantages, jnp.float32)
    response_mask = jnp.asarray(response_mask)
    if advantages.ndim != 1 or response_mask.ndim != 2 or response_mask.shape[0] != advantages.shape[0]:
        raise ValueError(
                f"advantages {advantages.shape} must be [N] and response_mask {response_mask.shape} [N, T]"
        )
    return jnp.where(response_mask > 0, advantages[:, None], 0.0)
