"""The continuous scheduler on the flash attention kernels (pages of 128 slots, the paged prefill and decode kernels;
Mosaic GPU interpreter on CPU): prefix sharing over a whole shared page plus the copied last page, slots refilled,
the static scheduler's bits. Slow on CPU (the interpreter); the H200 twin is test_flash_rollout_gpu.py."""

import numpy as np
import pytest

import jaxrl_fp8.model as M
from jaxrl_fp8.precision.kv import kv_cache_of
from jaxrl_fp8.rollout.embedded import EmbeddedEngine, EngineConfig
from jaxrl_fp8.rollout.types import SamplingParams
from tests.isolation import in_fresh_process

CFG = M.tiny_config(num_hidden_layers=1, mlp_only_layers=(), num_attention_heads=4, num_key_value_heads=2, head_dim=64, attention_impl="flash")


@pytest.mark.slow
@in_fresh_process
def test_flash_continuous_with_shared_pages_equals_static():
    _continuous_equals_static(M.random_policy(CFG, seed=4, dtype="bfloat16"))


@pytest.mark.slow
@in_fresh_process
def test_flash_continuous_over_fp8_pages_equals_static():
    """kv_cache "fp8": the continuous pool holds e4m3 pages and their scales (the copied last page takes its scales
    along) read by the FP8 paged kernel; the static engine's dense cache holds the dequantized values, read by the
    BF16 kernel: the same bits."""
    from jaxrl_fp8.precision import get_recipe

    _continuous_equals_static(M.random_policy(CFG, seed=4, dtype="bfloat16", recipe=get_recipe("bf16", kv_cache="fp8")),
                              fp8_pool=True)


def _continuous_equals_static(policy, fp8_pool=False):
    long = list(range(1, 131))  # 130 tokens: one shared page of 128, then the copied last page
    prompts = [long, long, [5, 6, 7]]  # the second request's samples join the first's pages (one of them late)
    params = [SamplingParams(max_new_tokens=5, seed=1), SamplingParams(max_new_tokens=2, n=2, seed=3),
              SamplingParams(max_new_tokens=3, n=2, seed=2)]
    kw = dict(max_batch=2, max_seq_len=140, refill_every=2)
    engine = EmbeddedEngine(policy, engine_config=EngineConfig(**kw))
    assert engine._attention == "flash" and engine._page_size == 128
    cont = engine.generate(prompts, params, return_routed_experts=True)
    assert (kv_cache_of(engine.precision) == "fp8") == fp8_pool
    assert engine.last_stats["shared_pages"] >= 2 and engine.last_stats["late_shares"] >= 1
    static = EmbeddedEngine(policy, engine_config=EngineConfig(scheduler="static", **kw)).generate(
        prompts, params, return_routed_experts=True)
    for a, b in zip(cont, static):
        np.testing.assert_array_equal(a.response_ids, b.response_ids)
        np.testing.assert_array_equal(a.rollout_logprobs.view(np.uint32), b.rollout_logprobs.view(np.uint32))
        np.testing.assert_array_equal(a.routed_experts, b.routed_experts)
