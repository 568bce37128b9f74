"""GRPO / RLOO / REINFORCE advantages against hand-computed values."""

import jax
import numpy as np
import pytest

from jaxrl_fp8.rl.advantages import (
    GRPO_EPS,
    broadcast_to_tokens,
    grpo_advantages,
    grpo_advantages_by_group,
    reinforce_advantages,
    rloo_advantages,
)


def test_grpo_hand_computed():
    rewards = np.array([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0], np.float32)
    adv = np.asarray(grpo_advantages(rewards, group_size=4))
    # group 0: mean 0.25, centered [.75, -.25, -.25, -.25], unbiased std sqrt(0.75 / 3) = 0.5
    expected0 = np.array([0.75, -0.25, -0.25, -0.25]) / (0.5 + GRPO_EPS)
    np.testing.assert_allclose(adv[:4], expected0, rtol=1e-6)
    # group 1: all rewards equal -> exactly zero
    assert (adv[4:] == 0).all()


def test_grpo_biased_std_option_and_no_std():
    rewards = np.array([3.0, 1.0], np.float32)
    # ddof=0: std = 1; ddof=1: std = sqrt(2)
    np.testing.assert_allclose(grpo_advantages(rewards, 2, ddof=0), [1 / (1 + GRPO_EPS), -1 / (1 + GRPO_EPS)], rtol=1e-6)
    np.testing.assert_allclose(grpo_advantages(rewards, 2), np.array([1, -1]) / (np.sqrt(2) + GRPO_EPS), rtol=1e-6)
    np.testing.assert_allclose(grpo_advantages(rewards, 2, std_normalize=False), [1.0, -1.0])


def test_grpo_single_sample_groups_are_zero():
    rewards = np.array([0.3, 1.0, -2.0], np.float32)
    for std in (True, False):
        adv = np.asarray(grpo_advantages(rewards, 1, std_normalize=std))
        assert (adv == 0).all() and np.isfinite(adv).all()


def test_grpo_rejects_bad_group_size():
    with pytest.raises(ValueError, match="group_size=3"):
        grpo_advantages(np.zeros(8), 3)
    with pytest.raises(ValueError, match="1-D"):
        grpo_advantages(np.zeros((2, 4)), 4)


def test_grpo_jits():
    rewards = np.random.default_rng(0).random(12).astype(np.float32)
    f = jax.jit(grpo_advantages, static_argnums=1)
    np.testing.assert_allclose(f(rewards, 4), grpo_advantages(rewards, 4), rtol=1e-6)


def test_grpo_by_group_matches_contiguous_and_handles_unequal_sizes():
    rng = np.random.default_rng(1)
    rewards = rng.random(12).astype(np.float32)
    ids = np.repeat(np.arange(3), 4)
    perm = rng.permutation(12)
    by_group = np.asarray(grpo_advantages_by_group(rewards[perm], ids[perm], 3))
    np.testing.assert_allclose(by_group, np.asarray(grpo_advantages(rewards, 4))[perm], rtol=1e-5, atol=1e-6)
    # unequal groups: {0: [1, 0, 0]}, {1: [5]} (single sample -> 0)
    adv = np.asarray(grpo_advantages_by_group(np.array([1.0, 0.0, 0.0, 5.0]), np.array([0, 0, 0, 1]), 2))
    std = np.sqrt(((2 / 3) ** 2 + 2 * (1 / 3) ** 2) / 2)
    np.testing.assert_allclose(adv[:3], np.array([2 / 3, -1 / 3, -1 / 3]) / (std + GRPO_EPS), rtol=1e-5)
    assert adv[3] == 0


def test_rloo_and_reinforce():
    np.testing.assert_allclose(rloo_advantages(np.array([1.0, 0.0, 0.0, 0.0]), 4), [1.0, -1 / 3, -1 / 3, -1 / 3], rtol=1e-6)
    assert (np.asarray(rloo_advantages(np.array([2.0, 3.0]), 1)) == 0).all()
    np.testing.assert_array_equal(reinforce_advantages(np.array([0.5, -1.0])), [0.5, -1.0])


def test_broadcast_to_tokens_respects_mask():
    mask = np.array([[0, 1, 1, 0], [1, 1, 1, 1]])
    out = np.asarray(broadcast_to_tokens(np.array([2.0, -1.0]), mask))
    np.testing.assert_array_equal(out, [[0, 2, 2, 0], [-1, -1, -1, -1]])
    with pytest.raises(ValueError):
        broadcast_to_tokens(np.array([1.0]), mask)
