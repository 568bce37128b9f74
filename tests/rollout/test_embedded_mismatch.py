"""THE zero-mismatch test: in unified recipes the embedded engine's rollout log-probs equal the trainer's
recomputation (the model's full forward over prompt + response, same format, same temperature rule) BIT
FOR BIT; in BF16-train / FP8-rollout they differ, and the measured mean |Δ| is printed (run with -s).

The batch mixes prompt lengths, temperatures (one row greedy), and response lengths (a dense stop-id set ends some rows
early); the trainer re-scores all samples in one right-padded batch of another shape than the rollout's.
The returned routed experts must equal the trainer forward's routing, and replaying them (R3) must not
change a bit either. Each program compiles once per module (the rollouts are memoized).
"""

import numpy as np
import pytest

from jaxrl_fp8.model import random_policy, tiny_config
from jaxrl_fp8.precision import get_recipe
from jaxrl_fp8.rollout import sampling
from jaxrl_fp8.rollout.embedded import EmbeddedEngine
from jaxrl_fp8.rollout.types import SamplingParams

# The configuration and engine shapes of tests/rollout/test_embedded.py, so the programs compile once per run.
CFG = tiny_config(num_hidden_layers=2, mlp_only_layers=(1,))
ENGINE_KW = dict(max_batch=4, max_seq_len=24, static_shapes=True)
PROMPTS = [[5, 17, 33, 2, 9], [100, 101, 102, 103, 104, 105, 106, 107, 108, 109, 110], [7, 250], [42] * 8]
STOP = tuple(range(0, CFG.vocab_size, 5))  # ~20% of the vocabulary: some rows stop early
PARAMS = [
    SamplingParams(temperature=1.0, max_new_tokens=12, stop_token_ids=STOP, seed=11),
    SamplingParams(temperature=0.7, top_k=20, max_new_tokens=6, seed=12),
    SamplingParams(temperature=1.3, top_p=0.9, max_new_tokens=12, stop_token_ids=STOP, seed=13),
    SamplingParams(temperature=0.0, top_k=20, max_new_tokens=9, stop_token_ids=STOP, seed=14),  # greedy
]


def _trainer_logprobs(policy, samples, temperatures, precision="train", replay=False):
    """The trainer's recomputation: one right-padded batch, the model's full forward, then the rule."""
    length = max(s.token_ids.size for s in samples) + 3  # another shape than any rollout program
    ids = np.zeros((len(samples), length), np.int32)
    routed = None
    if replay:
        k = max(CFG.num_experts_per_tok, 1)
        routed = np.full((len(samples), length, CFG.num_hidden_layers, k), -1, np.int32)
    for i, s in enumerate(samples):
        ids[i, : s.token_ids.size] = s.token_ids
        if replay:
            routed[i, : s.routed_experts.shape[0]] = s.routed_experts
    out = policy.forward(ids, precision=precision, routed_experts=routed)
    temps = np.broadcast_to(np.asarray(temperatures, np.float32)[:, None], ids.shape)
    next_lp = np.asarray(sampling.token_logprobs(out.logits, np.roll(ids, -1, axis=1), temps))  # [B, L]: position -> next
    result = []
    for i, s in enumerate(samples):
        p, t = s.prompt_ids.size, s.response_ids.size
        result.append(next_lp[i, p - 1 : p - 1 + t])
    return result, np.asarray(out.routed_experts), np.asarray(out.logits)


_CACHE = {}


def _rollout(recipe_name, dtype="float32"):
    """(policy, samples) per (recipe, parameter dtype); memoized so the module compiles each program once."""
    if (recipe_name, dtype) not in _CACHE:
        policy = random_policy(CFG, seed=3, dtype=dtype, recipe=get_recipe(recipe_name))
        engine = EmbeddedEngine(policy, **ENGINE_KW)
        assert engine.scheduler == "continuous"  # the default: slots refilled as rows stop (4 rows, 4 slots here)
        _CACHE[recipe_name, dtype] = policy, engine.generate(PROMPTS, PARAMS, return_routed_experts=True)
    return _CACHE[recipe_name, dtype]


def _bits(x):
    return np.asarray(x, np.float32).view(np.uint32)


@pytest.mark.parametrize("recipe,dtype", [("bf16", "float32"), ("fp8_block", "float32"), ("bf16", "bfloat16"),
                                          ("fp8_block_kv", "float32"), ("fp8_block_kv", "bfloat16")])
def test_unified_rollout_logprobs_equal_trainer_bitwise(recipe, dtype):
    """float32 masters (the trainer's default) and bfloat16 parameters (a BF16 checkpoint served as is)."""
    policy, samples = _rollout(recipe, dtype)
    lengths = [s.response_ids.size for s in samples]
    reasons = [s.finish_reason for s in samples]
    assert "stop" in reasons and "length" in reasons, reasons
    assert len(set(lengths)) > 1, lengths
    temps = [p.temperature for p in PARAMS]
    train, routed, logits = _trainer_logprobs(policy, samples, temps)
    for s, lp in zip(samples, train):
        np.testing.assert_array_equal(_bits(s.rollout_logprobs), _bits(lp))
    # the routing the engine reports is the trainer forward's routing, position by position
    for i, s in enumerate(samples):
        assert s.routed_experts.shape == (s.prompt_ids.size + s.response_ids.size - 1, CFG.num_hidden_layers, 2)
        np.testing.assert_array_equal(s.routed_experts, routed[i, : s.routed_experts.shape[0]])
        assert (s.routed_experts[:, 1] == -1).all() and (s.routed_experts[:, 0] >= 0).all()  # layer 1 is dense
    # the greedy row follows the trainer's argmax (and reports log-probs at temperature 1)
    g = samples[3]
    p = g.prompt_ids.size
    np.testing.assert_array_equal(g.response_ids, logits[3, p - 1 : p - 1 + g.response_ids.size].argmax(-1))


def test_r3_replay_and_model_logprob_method_agree_bitwise():
    policy, samples = _rollout("fp8_block")
    temps = [p.temperature for p in PARAMS]
    # R3: replaying the rollout's routing in the trainer changes nothing
    replayed, _, _ = _trainer_logprobs(policy, samples, temps, replay=True)
    for s, lp in zip(samples, replayed):
        np.testing.assert_array_equal(_bits(s.rollout_logprobs), _bits(lp))
    # at temperature 1 the model's own per-token log-prob method gives the same bits
    length = max(s.token_ids.size for s in samples) + 3
    ids = np.zeros((len(samples), length), np.int32)
    for i, s in enumerate(samples):
        ids[i, : s.token_ids.size] = s.token_ids
    direct = np.asarray(policy.token_logprobs(ids, np.roll(ids, -1, axis=1)))
    for i, (s, p) in enumerate(zip(samples, PARAMS)):
        if p.temperature in (0.0, 1.0):  # greedy rows report temperature-1 log-probs
            n, t = s.prompt_ids.size, s.response_ids.size
            np.testing.assert_array_equal(_bits(s.rollout_logprobs), _bits(direct[i, n - 1 : n - 1 + t]))
    # the trainer may re-score a sequence alone, without padding: same bits
    s = samples[0]
    alone = np.asarray(policy.token_logprobs(s.token_ids[None, :-1], s.token_ids[None, 1:]))[0, s.prompt_ids.size - 1 :]
    np.testing.assert_array_equal(_bits(s.rollout_logprobs), _bits(alone))


def test_bf16_train_fp8_rollout_mismatch_is_real():
    policy, samples = _rollout("bf16_train_fp8_rollout")
    temps = [p.temperature for p in PARAMS]
    train, _, _ = _trainer_logprobs(policy, samples, temps)  # train = the BF16 forward
    rollout_again, _, _ = _trainer_logprobs(policy, samples, temps, precision="rollout")
    for s, lp in zip(samples, rollout_again):  # the rollout side is still exact against its own format
        np.testing.assert_array_equal(_bits(s.rollout_logprobs), _bits(lp))
    diffs = np.concatenate([np.abs(lp - s.rollout_logprobs) for s, lp in zip(samples, train)])
    print(f"\nbf16-train / fp8-rollout: mean |dlogp| = {diffs.mean():.3e}, max = {diffs.max():.3e} "
          f"over {diffs.size} tokens")
    assert diffs.mean() > 0
    assert (diffs > 0).mean() > 0.5  # nearly every token differs, not a fluke


@pytest.mark.slow
def test_split3_router_and_head_keep_rollout_equal_trainer_bitwise(monkeypatch):
    """The candidate GPU fix for row invariance (ops.high_precision "split3": router and lm_head on the Pallas BF16
    kernel, interpreted here) keeps the unified rollout bitwise with the trainer. Own shapes: traced programs
    keep the form they were traced with, so none of the programs above may be reused."""
    from jaxrl_fp8.ops import high_precision

    monkeypatch.setenv(high_precision.ENV, "split3-interpret")
    traced = []  # the split form is what runs: count its traces (router + lm_head, rollout and trainer programs)
    split_forward = high_precision._split3_forward
    monkeypatch.setattr(high_precision, "_split3_forward", lambda *a: traced.append(1) or split_forward(*a))
    cfg = tiny_config(num_hidden_layers=2, mlp_only_layers=(1,), hidden_size=128, vocab_size=384)
    policy = random_policy(cfg, seed=4, dtype="float32", recipe=get_recipe("fp8_block"))
    engine = EmbeddedEngine(policy, max_batch=2, max_seq_len=20, static_shapes=True)
    params = [SamplingParams(temperature=1.0, max_new_tokens=3, seed=21), SamplingParams(temperature=0.8, max_new_tokens=2, seed=22)]
    samples = engine.generate([[5, 17, 33], [100, 101, 102, 103, 104]], params)
    rollout_traces = len(traced)
    assert rollout_traces > 0
    length = max(s.token_ids.size for s in samples) + 2
    ids = np.zeros((len(samples), length), np.int32)
    for i, s in enumerate(samples):
        ids[i, : s.token_ids.size] = s.token_ids
    out = policy.forward(ids, precision="train")
    assert len(traced) > rollout_traces
    temps = np.broadcast_to(np.asarray([p.temperature for p in params], np.float32)[:, None], ids.shape)
    next_lp = np.asarray(sampling.token_logprobs(out.logits, np.roll(ids, -1, axis=1), temps))
    for i, s in enumerate(samples):
        p, t = s.prompt_ids.size, s.response_ids.size
        np.testing.assert_array_equal(_bits(s.rollout_logprobs), _bits(next_lp[i, p - 1 : p - 1 + t]))
