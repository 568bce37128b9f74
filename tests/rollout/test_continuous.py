"""Continuous batching (the embedded engine's default scheduler): slot refill, prefix sharing, page exhaustion and
weight updates give the bits of the static scheduler and of each row alone; every request is served once.

Shapes follow tests/rollout/test_embedded.py (tiny model, 4 slots, 24 tokens, static shapes) so the programs
compile few times."""

import collections
import threading

import numpy as np
import pytest

from jaxrl_fp8.model import random_policy, tiny_config
from jaxrl_fp8.precision import get_recipe
from jaxrl_fp8.rollout import programs, scheduler
from jaxrl_fp8.rollout.embedded import EmbeddedEngine, EngineConfig
from jaxrl_fp8.rollout.types import SamplingParams

CFG = tiny_config(num_hidden_layers=2, mlp_only_layers=(1,))
KW = dict(max_batch=4, max_seq_len=24, static_shapes=True)
STOP = tuple(range(0, CFG.vocab_size, 5))  # ~20% of the vocabulary: rows stop at scattered lengths

# 10 rows for 4 slots, long-tailed lengths (0 .. 18 new tokens), prompt lengths not multiples of a page
PROMPTS = [[1, 2, 3], [9, 8, 7, 6, 5, 4], [100], [33, 44], [250, 251, 252, 253, 254], [7] * 9, [11, 12, 13, 14, 15, 16, 17],
           [5, 4], [200, 201, 202, 203], [60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70]]
MAX_NEW = [18, 2, 1, 12, 0, 3, 16, 5, 1, 9]
PARAMS = [SamplingParams(temperature=[1.0, 0.7, 0.0, 1.3][i % 4], top_k=[-1, 20][i % 2], max_new_tokens=m, seed=40 + i,
                         stop_token_ids=STOP if i in (1, 3, 7, 9) else ())
          for i, m in enumerate(MAX_NEW)]


@pytest.fixture(scope="module")
def policy():
    return random_policy(CFG, seed=0, dtype="float32", recipe=get_recipe("fp8_block"))


def _engine(policy, **kw):
    return EmbeddedEngine(policy, engine_config=EngineConfig(**{**KW, **kw}))


def _same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert (x.prompt_index, x.sample_index, x.seed) == (y.prompt_index, y.sample_index, y.seed)
        np.testing.assert_array_equal(x.response_ids, y.response_ids)
        np.testing.assert_array_equal(x.rollout_logprobs.view(np.uint32), y.rollout_logprobs.view(np.uint32))
        assert x.finish_reason == y.finish_reason
        assert (x.routed_experts is None) == (y.routed_experts is None)
        if x.routed_experts is not None:
            np.testing.assert_array_equal(x.routed_experts, y.routed_experts)


@pytest.fixture(scope="module")
def static_reference(policy):
    return _engine(policy, scheduler="static").generate(PROMPTS, PARAMS, return_routed_experts=True)


def test_config_knobs_are_validated():
    for bad, field in ((dict(scheduler="eager"), "scheduler"), (dict(refill_every=0), "refill_every"),
                       (dict(max_prefill_tokens=0), "max_prefill_tokens"), (dict(prefix_sharing=1), "prefix_sharing"),
                       (dict(progress="yes"), "progress"), (dict(kv_pages=-1), "kv_pages"),
                       (dict(refill_batch=-1), "refill_batch")):
        with pytest.raises(ValueError, match=f"EngineConfig.{field}"):
            EngineConfig(**bad)
    assert EngineConfig().scheduler == "continuous" and EngineConfig().refill_every == 64
    assert EngineConfig(max_batch=256).effective_refill_batch == 8 and EngineConfig(max_batch=4).effective_refill_batch == 1
    assert EngineConfig(max_batch=4, refill_batch=3).effective_refill_batch == 3


def test_refill_batch_gives_the_same_bits_with_fewer_refills(policy, static_reference):
    """Waiting for 3 finished slots before a refill (instead of each one) changes when rows enter, not their bits."""
    one = _engine(policy, refill_batch=1)
    _same(one.generate(PROMPTS, PARAMS, return_routed_experts=True), static_reference)
    three = _engine(policy, refill_batch=3)
    _same(three.generate(PROMPTS, PARAMS, return_routed_experts=True), static_reference)
    assert three.last_stats["decode_calls"] < one.last_stats["decode_calls"]


def test_slot_refill_matches_static_and_each_row_alone(policy, static_reference):
    """More rows than slots, long-tailed lengths and stop ids; a refill every 3 steps at most."""
    eng = _engine(policy, refill_every=3)
    sizes = [f._cache_size() for f in (programs.decode_slots, programs.prefill_prompts, programs.place_rows)]
    out = eng.generate(PROMPTS, PARAMS, return_routed_experts=True)
    _same(out, static_reference)
    st = eng.last_stats
    assert st["slots"] == 4 and st["decode_calls"] > 3 and st["prefill_calls"] > 1  # rows were inserted late
    assert {s.finish_reason for s in out} == {"stop", "length"} and len({s.response_ids.size for s in out}) > 4
    for i, (p, sp) in enumerate(zip(PROMPTS, PARAMS)):
        alone = eng.generate([p], sp, return_routed_experts=True)
        alone[0].prompt_index = i
        _same(alone, [out[i]])
    # fixed shapes per engine: refills and later calls reuse the programs (one compile each, at most)
    grown = [f._cache_size() - n for f, n in zip((programs.decode_slots, programs.prefill_prompts, programs.place_rows), sizes)]
    # (stop-id width 1 and 64; decode_slots and place_rows also per `plain` flag: rows all at T = 1 / greedy without
    # filters or not)
    assert grown[0] <= 4 and grown[1] <= 2 and grown[2] <= 4, grown
    other = _engine(policy, refill_every=64)  # a refill only when a slot frees: same bits
    _same(other.generate(PROMPTS, PARAMS, return_routed_experts=True), out)
    longest = max(s.response_ids.size for s in out)
    assert st["decode_calls"] >= (longest - 1) / 3 > other.last_stats["decode_calls"] / 2


@pytest.mark.parametrize("page_size,static_shapes", [(4, False), (16, True)])
def test_prefix_sharing_gives_the_bits_of_unshared_rows(policy, page_size, static_shapes):
    """n = 6 samples per prompt on 4 slots (samples join their prompt's pages late, while others decode); pages of 4
    slots with shapes bucketed per call, pages of 16 with the module's static shapes."""
    prompts = [[3, 1, 4, 1, 5, 9, 2], [8] * 18, [2, 7, 1, 8, 2]]  # 7, 18 and 5 tokens: never whole pages
    params = [SamplingParams(temperature=1.0, max_new_tokens=m, n=6, seed=s, stop_token_ids=STOP)
              for m, s in ((12, 1), (5, 2), (16, 3))]
    # (bucketed shapes: at most 32 prompt slots per prefill call, i.e. one 18-token prompt, or four of 5-7 tokens)
    budget = dict(static_shapes=static_shapes, max_prefill_tokens=8192 if static_shapes else 32)
    shared = _engine(policy, page_size=page_size, refill_every=4, **budget)
    out = shared.generate(prompts, params, return_routed_experts=True)
    st = shared.last_stats
    assert st["page_copies"] > 0 and st["late_shares"] > 0
    assert st["shared_pages"] > 0 and st["prefill_tokens"] < sum(len(p) * 6 for p in prompts)
    unshared = _engine(policy, page_size=page_size, refill_every=4, prefix_sharing=False, **budget)
    _same(unshared.generate(prompts, params, return_routed_experts=True), out)
    assert unshared.last_stats.get("page_copies", 0) == 0
    assert unshared.last_stats["prefill_tokens"] == sum(len(p) * 6 for p in prompts)
    if not static_shapes:  # every prefill call within max_prefill_tokens
        st = unshared.last_stats
        assert st["prefill_calls"] > 4 and st["prefill_padded_tokens"] <= 32 * st["prefill_calls"]
    if not static_shapes:
        return
    # identical prompts of different requests share too, and give the bits of the n-sample request
    again = shared.generate([prompts[0], prompts[0]], [params[0].for_sample(0), params[0].for_sample(2)])
    assert shared.last_stats["prefill_tokens"] == len(prompts[0]) and shared.last_stats["page_copies"] == 1
    _same(again, [_relabel(out[0], 0), _relabel(out[2], 1)])


def _relabel(sample, prompt_index):
    import dataclasses

    return dataclasses.replace(sample, prompt_index=prompt_index, sample_index=0, routed_experts=None)


def test_page_exhaustion_rows_wait_and_every_request_runs_once(policy, static_reference):
    """A pool of 8 pages of 4 slots (a row needs up to 6): rows wait for pages, none is lost or run twice."""
    eng = _engine(policy, page_size=4, kv_pages=8, refill_every=2)
    out = eng.generate(PROMPTS, PARAMS, return_routed_experts=True)
    _same(out, static_reference)
    st = eng.last_stats
    assert st["pool_pages"] == 8 and 6 <= st["pages_in_use_max"] <= 8
    assert st["mean_active_slots"] < 4  # slots idled for want of pages
    many = eng.generate(PROMPTS[:3], SamplingParams(max_new_tokens=6, n=5, seed=9))
    assert collections.Counter((s.prompt_index, s.sample_index) for s in many) == collections.Counter(
        (i, j) for i in range(3) for j in range(5))
    small = _engine(policy, page_size=4, kv_pages=3)
    with pytest.raises(ValueError, match="need 4 KV pages of 4 slots; EngineConfig.kv_pages=3 can never hold"):
        small.generate([[1] * 6], SamplingParams(max_new_tokens=8))
    _same(small.generate([PROMPTS[0]], PARAMS[2]), _engine(policy, scheduler="static").generate([PROMPTS[0]], PARAMS[2]))


def test_progress_bar_and_stats(policy, capsys):
    eng = _engine(policy, progress=True)
    out = eng.generate(PROMPTS[:5], PARAMS[:5])
    assert "rollout" in capsys.readouterr().err
    assert eng.last_stats["response_tokens"] == sum(s.response_ids.size for s in out)
    assert eng.last_stats["rows"] == 5 and eng.last_stats["decode_steps"] >= max(MAX_NEW[:5]) - 1
    assert 0 < eng.last_stats["decode_seconds"] <= eng.last_stats["seconds"]  # wall inside the decode loops
    outside = [eng.last_stats[k] for k in ("sync_seconds", "collect_seconds", "admit_seconds")]  # and outside them
    assert min(outside) > 0 and eng.last_stats["decode_seconds"] + sum(outside) <= eng.last_stats["seconds"]
    assert eng.generate([], PARAMS[0]) == [] and eng.last_stats["rows"] == 0


def test_weight_update_during_generate_waits(policy, monkeypatch):
    """An update issued while generate runs waits for it: that call's samples are all the old version, the
    update lands after it, and the next generate uses the new weights. No row is lost or run twice."""
    new = random_policy(CFG, seed=1, dtype="float32", recipe=get_recipe("fp8_block"))
    eng = _engine(policy, refill_every=2)
    events, started, updating = [], threading.Event(), threading.Event()
    runs = []
    run = scheduler.ContinuousScheduler.run

    def traced(self):
        runs.append(len(self.rows))
        events.append("run_start")
        started.set()
        updating.wait(30)
        out = run(self)
        events.append("run_end")
        return out

    monkeypatch.setattr(scheduler.ContinuousScheduler, "run", traced)
    result = {}
    gen = threading.Thread(target=lambda: result.setdefault("old", eng.generate(PROMPTS, PARAMS)))
    gen.start()
    assert started.wait(60)

    def update():
        events.append("update_start")
        updating.set()
        eng.update_params(new, "v1")
        events.append("update_done")

    upd = threading.Thread(target=update)
    upd.start()
    gen.join(120)
    upd.join(120)
    assert events == ["run_start", "update_start", "run_end", "update_done"], events
    old = result["old"]
    assert runs == [len(PROMPTS)] and {s.weight_version for s in old} == {"0"}
    assert [s.prompt_index for s in old] == list(range(len(PROMPTS)))
    _same(old, _engine(policy, scheduler="static").generate(PROMPTS, PARAMS))
    after = eng.generate(PROMPTS, PARAMS)
    assert {s.weight_version for s in after} == {"v1"}
    _same(after, _engine(new, scheduler="static").generate(PROMPTS, PARAMS))
