"""PPO clip (both sides, dual clip), TIS, KL estimators, entropy and aggregation against hand-computed values."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_fp8.rl.losses import (
    PolicyLossConfig,
    aggregate,
    combine_micro_metrics,
    approx_kl,
    entropy_from_logits,
    policy_loss,
    ppo_clip_loss,
    tis_weights,
)

from jaxrl_fp8.rollout.sampling import token_logprobs  # the one log-prob definition (sampler and learner)

NO_TIS = PolicyLossConfig(use_tis=False)


def _row(*values):
    return jnp.asarray([values], jnp.float32)


def test_ppo_clip_both_sides_hand_computed():
    # ratio, advantage -> expected per-token loss, clipped?
    cases = [
        (1.5, +1.0, -1.28, 1.0),  # above 1+eps_high with A>0: clipped at 1.28
        (0.5, +1.0, -0.5, 0.0),  # below 1-eps with A>0: the unclipped (larger) loss wins, no clip
        (0.5, -1.0, 0.8, 1.0),  # below 1-eps with A<0: clipped at 0.8
        (1.5, -1.0, 1.5, 0.0),  # above 1+eps_high with A<0: unclipped wins
        (1.1, +1.0, -1.1, 0.0),  # inside the trust region
        (0.9, -2.0, 1.8, 0.0),
    ]
    old = np.zeros((1, len(cases)), np.float32)
    logp = np.log([[c[0] for c in cases]]).astype(np.float32)
    adv = np.array([[c[1] for c in cases]], np.float32)
    loss, clipped, dual = ppo_clip_loss(logp, old, adv, 0.2, 0.28)
    np.testing.assert_allclose(loss[0], [c[2] for c in cases], rtol=1e-6)
    np.testing.assert_array_equal(clipped[0], [c[3] for c in cases])
    assert (np.asarray(dual) == 0).all()


def test_dual_clip_caps_negative_advantages():
    logp = np.log([[5.0, 2.0, 5.0]]).astype(np.float32)
    adv = np.array([[-1.0, -1.0, 1.0]], np.float32)
    loss, clipped, dual = ppo_clip_loss(logp, np.zeros_like(logp), adv, 0.2, 0.28, dual_clip_c=3.0)
    # ratio 5, A=-1: max(5, 1.28) = 5 capped at 3; ratio 2: 2 < 3 stays; A>0 untouched (-1.28)
    np.testing.assert_allclose(loss[0], [3.0, 2.0, -1.28], rtol=1e-6)
    np.testing.assert_array_equal(dual[0], [1.0, 0.0, 0.0])
    np.testing.assert_array_equal(clipped[0], [0.0, 0.0, 1.0])


def test_ratio_log_is_clamped_to_20():
    loss, _, _ = ppo_clip_loss(_row(50.0), _row(0.0), _row(-1.0), 0.2, 0.28)
    np.testing.assert_allclose(loss, [[math.exp(20.0)]], rtol=1e-5)
    assert np.isfinite(loss).all()


def test_policy_gradient_is_zero_on_clipped_tokens():
    old = np.zeros((1, 3), np.float32)
    adv = _row(1.0, 1.0, -1.0)
    logp = jnp.log(_row(1.1, 1.5, 1.5))
    mask = np.ones((1, 3))
    grad = jax.grad(lambda lp: policy_loss(lp, old, adv, mask, NO_TIS)[0])(logp)
    # d/dlogp of -r*A/3 = -r*A/3 on unclipped tokens; 0 where the clipped branch is active
    np.testing.assert_allclose(grad[0], [-1.1 / 3, 0.0, 1.5 / 3], rtol=1e-5)


def test_tis_weights_clamp_and_clipfrac():
    old = np.log([[3.0, 0.5, 0.5, 1.0]]).astype(np.float32)
    rollout = np.zeros_like(old)
    w, ratio, clipped = tis_weights(old, rollout, 0.0, 2.0)
    np.testing.assert_allclose(w[0], [2.0, 0.5, 0.5, 1.0], rtol=1e-6)
    np.testing.assert_allclose(ratio[0], [3.0, 0.5, 0.5, 1.0], rtol=1e-6)
    np.testing.assert_array_equal(clipped[0], [1, 0, 0, 0])
    w, _, clipped = tis_weights(old, rollout, 0.6, 2.0)
    np.testing.assert_allclose(w[0], [2.0, 0.6, 0.6, 1.0], rtol=1e-6)
    np.testing.assert_array_equal(clipped[0], [1, 1, 1, 0])


def test_tis_multiplies_the_per_token_loss_and_reports_metrics():
    old = np.log([[3.0, 0.5, 1.0, 7.0]]).astype(np.float32)
    rollout = np.zeros_like(old)
    logp = old.copy()  # ratio 1: per-token pg loss = -A
    adv = _row(1.0, 2.0, -1.0, 100.0)
    mask = np.array([[1, 1, 1, 0]])
    cfg = PolicyLossConfig(tis_clip=2.0, tis_clip_low=0.0)
    loss, m = policy_loss(logp, old, adv, mask, cfg, rollout_logp=rollout)
    # weights [2, 0.5, 1] -> per-token [-2, -1, 1] -> token mean -2/3; masked token ignored
    np.testing.assert_allclose(loss, -2 / 3, rtol=1e-6)
    np.testing.assert_allclose(m["tis"], (3 + 0.5 + 1) / 3, rtol=1e-6)
    np.testing.assert_allclose(m["tis_weight"], (2 + 0.5 + 1) / 3, rtol=1e-6)
    np.testing.assert_allclose(m["tis_clipfrac"], 1 / 3, rtol=1e-6)
    np.testing.assert_allclose(m["tis_abs"], (2 + 0.5 + 0) / 3, rtol=1e-6)
    # gradient: TIS weight is a constant multiplier (stop-gradient), so grads scale by w
    g_tis = jax.grad(lambda lp: policy_loss(lp, old, adv, mask, cfg, rollout_logp=rollout)[0])(jnp.asarray(logp))
    g_plain = jax.grad(lambda lp: policy_loss(lp, old, adv, mask, NO_TIS)[0])(jnp.asarray(logp))
    np.testing.assert_allclose(g_tis[0, :3], np.asarray(g_plain[0, :3]) * [2.0, 0.5, 1.0], rtol=1e-6)


def test_tis_requires_rollout_logp():
    with pytest.raises(ValueError, match="rollout_logp"):
        policy_loss(_row(0.0), _row(0.0), _row(1.0), np.ones((1, 1)), PolicyLossConfig(use_tis=True))


def test_kl_estimators_hand_computed():
    logp, ref = _row(math.log(0.5)), _row(math.log(0.25))
    np.testing.assert_allclose(approx_kl(logp, ref, "k1"), [[math.log(2)]], rtol=1e-6)
    np.testing.assert_allclose(approx_kl(logp, ref, "k2"), [[0.5 * math.log(2) ** 2]], rtol=1e-6)
    k3 = 0.5 + math.log(2) - 1  # exp(ref-logp) - (ref-logp) - 1 with ref-logp = -log 2
    np.testing.assert_allclose(approx_kl(logp, ref, "k3"), [[k3]], rtol=1e-5)
    np.testing.assert_allclose(approx_kl(logp, ref, "low_var_kl"), [[k3]], rtol=1e-5)
    # low_var_kl clamps at 10 (k3 of ref-logp = 30 is ~1e13); and stays finite for absurd gaps
    np.testing.assert_allclose(approx_kl(_row(0.0), _row(30.0), "low_var_kl"), [[10.0]])
    np.testing.assert_allclose(approx_kl(_row(0.0), _row(-1e4), "low_var_kl"), [[10.0]])
    # gradient of k3 wrt logp: 1 - exp(ref - logp)
    g = jax.grad(lambda lp: approx_kl(lp, ref, "k3").sum())(logp)
    np.testing.assert_allclose(g, [[1 - 0.5]], rtol=1e-5)
    with pytest.raises(ValueError):
        approx_kl(logp, ref, "k9")


def test_kl_and_entropy_terms_in_total_loss():
    logp, old, ref = _row(math.log(0.5)), _row(math.log(0.5)), _row(math.log(0.25))
    adv, mask, ent = _row(0.0), np.ones((1, 1)), _row(1.5)
    cfg = PolicyLossConfig(use_tis=False, kl_coef=0.1, kl_type="k3", entropy_coef=0.01)
    loss, m = policy_loss(logp, old, adv, mask, cfg, ref_logp=ref, entropy=ent)
    k3 = 0.5 + math.log(2) - 1
    np.testing.assert_allclose(loss, 0.1 * k3 - 0.01 * 1.5, rtol=1e-5)
    np.testing.assert_allclose(m["kl_loss"], k3, rtol=1e-5)
    np.testing.assert_allclose(m["entropy"], 1.5)
    with pytest.raises(ValueError, match="ref_logp"):
        policy_loss(logp, old, adv, mask, cfg, entropy=ent)
    with pytest.raises(ValueError, match="entropy"):
        policy_loss(logp, old, adv, mask, cfg, ref_logp=ref)


def test_aggregation_modes():
    x = jnp.asarray([[1.0, 2.0, 3.0], [4.0, 99.0, 99.0], [7.0, 7.0, 7.0]])
    mask = np.array([[1, 1, 1], [1, 0, 0], [0, 0, 0]])
    np.testing.assert_allclose(aggregate(x, mask, "token_mean"), 10 / 4)
    np.testing.assert_allclose(aggregate(x, mask, "seq_mean_token_mean"), (2 + 4) / 2)
    np.testing.assert_allclose(aggregate(x, mask, "token_mean", num_tokens=8), 10 / 8)
    np.testing.assert_allclose(aggregate(x, mask, "seq_mean_token_mean", num_sequences=4), 6 / 4)
    assert float(aggregate(x, np.zeros((3, 3)), "token_mean")) == 0.0
    with pytest.raises(ValueError):
        aggregate(x, mask, "sum")


def test_micro_batches_sum_to_global_loss():
    rng = np.random.default_rng(0)
    logp = rng.normal(size=(4, 5)).astype(np.float32) * 0.1 - 1
    old = logp + rng.normal(size=(4, 5)).astype(np.float32) * 0.1
    adv = rng.normal(size=(4,)).astype(np.float32)
    mask = (rng.random((4, 5)) > 0.3).astype(np.float32)
    full, _ = policy_loss(logp, old, adv, mask, NO_TIS)
    n = mask.sum()
    parts = sum(policy_loss(logp[i:i + 2], old[i:i + 2], adv[i:i + 2], mask[i:i + 2], NO_TIS, num_tokens=n)[0]
                for i in (0, 2))
    np.testing.assert_allclose(parts, full, rtol=1e-5)


def test_masked_nan_does_not_leak_into_loss_or_grad():
    logp = jnp.asarray([[-1.0, jnp.nan], [-0.5, jnp.inf]])
    old = jnp.asarray([[-1.1, jnp.nan], [-0.4, 0.0]])
    rollout = jnp.asarray([[-1.0, jnp.nan], [-0.4, -jnp.inf]])
    mask = np.array([[1, 0], [1, 0]])
    cfg = PolicyLossConfig(dual_clip_c=3.0)
    loss, metrics = policy_loss(logp, old, np.array([1.0, -1.0]), mask, cfg, rollout_logp=rollout)
    assert np.isfinite(loss) and all(np.isfinite(v) for v in metrics.values())
    grad = jax.grad(lambda lp: policy_loss(lp, old, np.array([1.0, -1.0]), mask, cfg, rollout_logp=rollout)[0])(logp)
    assert np.isfinite(grad).all() and grad[0, 1] == 0 and grad[1, 1] == 0


def test_metrics_ppo_kl_and_clipfrac():
    logp = np.log([[1.5, 1.0, 0.5]]).astype(np.float32)
    old = np.zeros_like(logp)
    _, m = policy_loss(logp, old, _row(1.0, 1.0, -1.0), np.ones((1, 3)), NO_TIS)
    np.testing.assert_allclose(m["ppo_kl"], -np.log([1.5, 1.0, 0.5]).mean(), rtol=1e-6)
    np.testing.assert_allclose(m["pg_clipfrac"], 2 / 3, rtol=1e-6)


def test_logprobs_and_entropy_from_logits():
    logits = jnp.asarray([[[0.0, 0.0, 0.0, 0.0], [1.0, 2.0, 3.0, 4.0]]])
    lp = token_logprobs(logits, jnp.asarray([[2, 3]]))
    ref = np.log(np.exp([1, 2, 3, 4]) / np.exp([1, 2, 3, 4]).sum())
    np.testing.assert_allclose(lp, [[math.log(0.25), ref[3]]], rtol=1e-6)
    ent = entropy_from_logits(logits)
    np.testing.assert_allclose(ent[0, 0], math.log(4), rtol=1e-6)
    p = np.exp(ref)
    np.testing.assert_allclose(ent[0, 1], -(p * ref).sum(), rtol=1e-5)


@pytest.mark.parametrize("kwargs, field", [
    (dict(eps_clip=0.0), "eps_clip"),
    (dict(dual_clip_c=1.0), "dual_clip_c"),
    (dict(tis_clip=0.5, tis_clip_low=1.0), "tis_clip_low"),
    (dict(kl_type="k4"), "kl_type"),
    (dict(loss_agg="mean"), "loss_agg"),
])
def test_config_validation_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        PolicyLossConfig(**kwargs)


def test_policy_loss_jits():
    rng = np.random.default_rng(2)
    logp = rng.normal(size=(3, 4)).astype(np.float32) - 1
    args = (logp, logp + 0.05, rng.normal(size=(3,)).astype(np.float32), np.ones((3, 4)))
    cfg = PolicyLossConfig(dual_clip_c=3.0)
    f = jax.jit(lambda *a: policy_loss(*a, cfg, rollout_logp=logp - 0.1))
    loss, _ = f(*args)
    np.testing.assert_allclose(loss, policy_loss(*args, cfg, rollout_logp=logp - 0.1)[0], rtol=1e-6)


def test_combine_micro_metrics_sums_losses_and_weights_means_by_tokens():
    per_micro = {"loss": jnp.array([0.5, 0.25]), "pg_loss": jnp.array([0.1, 0.2]), "kl_loss": jnp.array([1.0, 2.0]),
                 "entropy": jnp.array([1.0, 4.0]), "tis": jnp.array([2.0, 0.0])}
    out = combine_micro_metrics(per_micro, jnp.array([3.0, 1.0]))
    np.testing.assert_allclose([out["loss"], out["pg_loss"], out["kl_loss"]], [0.75, 0.3, 3.0], rtol=1e-6)
    np.testing.assert_allclose([out["entropy"], out["tis"]], [(3 + 4) / 4, 6 / 4], rtol=1e-6)
    empty = combine_micro_metrics({"entropy": jnp.array([0.0, 0.0])}, jnp.array([0.0, 0.0]))
    assert float(empty["entropy"]) == 0.0
