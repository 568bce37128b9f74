"""KV-cache decoding, batching and packing are bitwise equal to the full forward; routing replay (R3).

All forwards share the shapes [2, 8] (full), [2, 4] (prefill) and [2] (decode) so each compiles once.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxrl_fp8.model as M
from jaxrl_fp8.model import moe
from jaxrl_fp8.precision import get_recipe

CFG = M.tiny_config(num_hidden_layers=2)  # layer 0 MoE, layer 1 dense
B, T, PROMPT, MAX_LEN = 2, 8, 4, 16
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def policy():
    return M.random_policy(CFG, seed=1, dtype="float32")


def _ids(seed):
    return np.random.default_rng(seed).integers(0, CFG.vocab_size, (B, T))


def decode_all(policy, ids, precision="rollout"):
    """Prefill PROMPT tokens, then decode the rest one by one; logits [B, T, V], routed [B, T, L, k]."""
    cache = policy.init_cache(B, MAX_LEN)
    out, cache = policy.prefill(ids[:, :PROMPT], np.full(B, PROMPT), cache, precision=precision)
    logits, routed = [np.asarray(out.logits)], [np.asarray(out.routed_experts)]
    for i in range(PROMPT, T):
        lg, r, cache = policy.decode_step(ids[:, i], cache, precision=precision)
        logits.append(np.asarray(lg)[:, None])
        routed.append(np.asarray(r)[:, None])
    return np.concatenate(logits, 1), np.concatenate(routed, 1)


def test_decode_equals_full_forward_bitwise(policy):
    ids = _ids(0)
    full = policy.forward(ids, precision="rollout")
    logits, routed = decode_all(policy, ids)
    np.testing.assert_array_equal(logits, np.asarray(full.logits))
    np.testing.assert_array_equal(routed, np.asarray(full.routed_experts))


def test_decode_equals_full_forward_bitwise_fp8_recipe():
    """The fp8-block recipe (f32 masters, FP8 GEMMs through ops) keeps decode == forward bitwise."""
    policy = M.random_policy(CFG, seed=2, dtype="float32", recipe=get_recipe("fp8_block"))
    ids = _ids(1)
    full = np.asarray(policy.forward(ids, precision="rollout").logits)
    logits, _ = decode_all(policy, ids)
    np.testing.assert_array_equal(logits, full)


def test_row_result_independent_of_batch_companions(policy):
    ids = _ids(2)
    other = ids.copy()
    other[0] = _ids(3)[0]  # change row 0 only
    a, b = np.asarray(policy.logits(ids)), np.asarray(policy.logits(other))
    np.testing.assert_array_equal(a[1], b[1])


def test_right_padded_prompts_of_different_lengths(policy):
    ids = _ids(4)
    lengths = np.array([PROMPT, 2])
    prompts = ids[:, :PROMPT].copy()
    prompts[1, 2:] = 0  # padding after row 1's 2-token prompt
    cache = policy.init_cache(B, MAX_LEN)
    out, cache = policy.prefill(prompts, lengths, cache)
    nxt = np.array([ids[0, PROMPT], ids[1, 2]])
    lg, _, cache = policy.decode_step(nxt, cache)
    full = np.asarray(policy.logits(ids))
    np.testing.assert_array_equal(np.asarray(out.logits[1, 1]), full[1, 1])
    np.testing.assert_array_equal(np.asarray(lg[0]), full[0, PROMPT])
    np.testing.assert_array_equal(np.asarray(lg[1]), full[1, 2])
    np.testing.assert_array_equal(np.asarray(cache.lengths), lengths + 1)


def test_packed_sequences_equal_separate_sequences_bitwise(policy):
    ids = _ids(5)
    packed = np.concatenate([ids[0, :3], ids[1, :5]])[None].repeat(B, 0)
    seg = np.array([[1] * 3 + [2] * 5] * B)
    out = np.asarray(policy.logits(packed, segment_ids=seg))
    sep = np.asarray(policy.logits(ids))
    np.testing.assert_array_equal(out[0, :3], sep[0, :3])
    np.testing.assert_array_equal(out[0, 3:], sep[1, :5])
    np.testing.assert_array_equal(np.asarray(M.segment_positions(jnp.asarray(seg)))[0], [0, 1, 2, 0, 1, 2, 3, 4])


def test_xla_attention_impl_close_to_exact(policy):
    ids = _ids(6)
    fast = M.Policy(M.Qwen3(M.tiny_config(num_hidden_layers=2, attention_impl="xla"), dtype=jnp.float32, rngs=nnx.Rngs(0)))
    nnx.update(fast.model, nnx.state(policy.model))
    np.testing.assert_allclose(np.asarray(fast.logits(ids)), np.asarray(policy.logits(ids)), atol=2e-5)


def test_bf16_decode_bitwise_without_excess_precision():
    """bf16 activations are bitwise only with XLA_FLAGS=--xla_allow_excess_precision=false (a subprocess)."""
    code = textwrap.dedent(
        """
        import numpy as np, jaxrl_fp8.model as M
        from tests.model.test_decode import CFG, _ids, decode_all
        policy = M.random_policy(CFG, seed=5, dtype="bfloat16")
        ids = _ids(7)
        full = np.asarray(policy.forward(ids, precision="rollout").logits)
        logits, _ = decode_all(policy, ids)
        print("MISMATCH", int((logits != full).sum()))
        """
    )
    env = {**os.environ, "XLA_FLAGS": "--xla_allow_excess_precision=false", "JAX_PLATFORMS": "cpu"}
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(REPO, "src"), REPO, env.get("PYTHONPATH", "")])
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "MISMATCH 0" in res.stdout, res.stdout


# ------------------------------------------------------------------------------------------- routing replay


def test_replay_of_own_routing_is_bitwise_identity(policy):
    ids = _ids(8)
    out = policy.forward(ids)
    replayed = policy.forward(ids, routed_experts=out.routed_experts)
    np.testing.assert_array_equal(np.asarray(replayed.logits), np.asarray(out.logits))


def test_replay_forces_selection_and_minus_one_falls_back(policy):
    ids = _ids(9)
    out = policy.forward(ids)
    routed = np.asarray(out.routed_experts).copy()
    layer = CFG.moe_layers[0]
    forced = np.array([(e + 3) % CFG.num_experts for e in routed[0, 0, layer]])
    replay = np.full_like(routed, -1)
    replay[0, 0, layer] = forced
    got = policy.forward(ids, routed_experts=replay)
    used = np.asarray(got.routed_experts)
    np.testing.assert_array_equal(used[0, 0, layer], forced)
    np.testing.assert_array_equal(used[:, 1:, layer], routed[:, 1:, layer])  # -1 rows: computed routing
    np.testing.assert_array_equal(used[1, 0, layer], routed[1, 0, layer])
    assert not np.array_equal(np.asarray(got.logits[0, 0]), np.asarray(out.logits[0, 0]))
    with pytest.raises(ValueError, match="num_hidden_layers"):
        policy.forward(ids, routed_experts=replay[:, :, :1])
    with pytest.raises(ValueError, match="num_experts"):
        policy.forward(ids, routed_experts=np.full_like(routed, CFG.num_experts))


@pytest.mark.parametrize("norm", [True, False])
def test_replayed_gate_weights_come_from_own_router(norm):
    logits = jnp.asarray(np.random.default_rng(7).standard_normal((4, 6)), jnp.float32)
    replay = jnp.asarray([[5, 0], [-1, -1], [2, 3], [1, 4]])
    r = moe.route(logits, 2, norm, replay)
    probs = np.asarray(jax.nn.softmax(logits, axis=-1))
    want = np.array([[5, 0], np.argsort(-probs[1])[:2], [2, 3], [1, 4]])
    np.testing.assert_array_equal(np.asarray(r.experts), want)
    w = np.take_along_axis(probs, want, 1)
    if norm:
        w = w / w.sum(1, keepdims=True)
    np.testing.assert_allclose(np.asarray(r.weights), w, rtol=1e-6)


@pytest.mark.row_invariant_cpu
def test_logits_at_equals_full_logits_bitwise(policy):
    """The prefill's last-position-only head gives the same bits as the full forward's logits there."""
    ids = jnp.asarray(_ids(3), jnp.int32)
    full = np.asarray(policy.forward(ids, precision="rollout").logits)
    at = jnp.asarray([T - 1, 2], jnp.int32)
    graphdef, state = nnx.split(policy.model)
    model = nnx.merge(graphdef, state)
    part = np.asarray(model(ids, policy=policy.resolve_precision("rollout"), logits_at=at).logits)
    assert part.shape == (B, 1, CFG.vocab_size)
    np.testing.assert_array_equal(part[:, 0], full[np.arange(B), np.asarray(at)])
