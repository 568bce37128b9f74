"""Train–rollout mismatch metrics: sign convention, clamps and masking against hand-computed values."""

import math

import numpy as np

from jaxrl_fp8.rl.mismatch import (
    k3_per_token,
    mismatch_metrics,
    per_sequence_max_abs_diff,
    tis_clipfrac,
    train_rollout_kl,
    train_rollout_logprob_abs_diff,
)


def _k3(d):
    return math.exp(d) - 1 - d


def test_abs_diff_and_k3_hand_computed():
    rollout = np.array([[-1.0, -2.0, -0.5, -3.0]], np.float32)
    train = rollout + np.array([[0.1, -0.2, 0.0, 5.0]], np.float32)
    mask = np.array([[1, 1, 1, 0]])
    np.testing.assert_allclose(train_rollout_logprob_abs_diff(train, rollout, mask), (0.1 + 0.2) / 3, rtol=1e-5)
    np.testing.assert_allclose(train_rollout_kl(train, rollout, mask), (_k3(0.1) + _k3(-0.2)) / 3, rtol=1e-4)


def test_k3_sign_convention_is_train_minus_rollout():
    # K3 is asymmetric: exp(Δ)-1-Δ with Δ = train - rollout = +0.5, not -0.5
    train, rollout, mask = np.array([[0.0]]), np.array([[-0.5]]), np.ones((1, 1))
    np.testing.assert_allclose(train_rollout_kl(train, rollout, mask), _k3(0.5), rtol=1e-5)
    assert abs(_k3(0.5) - _k3(-0.5)) > 1e-2


def test_k3_clamps_to_ten_and_stays_finite():
    d = np.array([3.0, -50.0, 1e4, -1e4, 1.0], np.float32)
    out = np.asarray(k3_per_token(d))
    np.testing.assert_allclose(out, [10.0, 10.0, 10.0, 10.0, _k3(1.0)], rtol=1e-6)


def test_identical_logprobs_give_exact_zero():
    lp = np.random.default_rng(0).normal(size=(3, 7)).astype(np.float32)
    m = mismatch_metrics(lp, lp.copy(), np.ones((3, 7)))
    assert all(float(v) == 0.0 for v in m.values())


def test_tis_clipfrac_and_per_sequence_max():
    rollout = np.zeros((2, 3), np.float32)
    train = np.log(np.array([[3.0, 0.5, 1.0], [1.0, 1.0, 9.0]], np.float32))
    mask = np.array([[1, 1, 1], [1, 1, 0]])
    np.testing.assert_allclose(tis_clipfrac(train, rollout, mask, 0.0, 2.0), 1 / 5, rtol=1e-6)
    np.testing.assert_allclose(tis_clipfrac(train, rollout, mask, 0.6, 2.0), 2 / 5, rtol=1e-6)
    np.testing.assert_allclose(per_sequence_max_abs_diff(train, rollout, mask), [math.log(3), 0.0], rtol=1e-6)


def test_masked_nan_is_ignored():
    train = np.array([[-1.0, np.nan]], np.float32)
    rollout = np.array([[-1.5, -np.inf]], np.float32)
    m = mismatch_metrics(train, rollout, np.array([[1, 0]]))
    assert all(np.isfinite(float(v)) for v in m.values())
    np.testing.assert_allclose(m["train_rollout_logprob_abs_diff"], 0.5)
    np.testing.assert_allclose(m["train_rollout_kl"], _k3(0.5), rtol=1e-5)
