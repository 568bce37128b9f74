"""On the H200, at the lengths RL runs: the embedded engine on the flash kernels (paged prefill + paged decode)
gives every response token the log-prob the trainer's recomputation gives it (the fused training forward over
prompt + response), bit for bit, for the unified bf16, fp8_block and fp8_block_kv (FP8 KV cache) recipes.

The slice is Qwen3-30B-A3B-shaped (hidden 2048, 32/4 heads of 128, 128 experts of 768, top-8; two layers), the
batch 64 rows of 4096-token responses after 64-token prompts (ignore_eos: every row runs the whole length).
Run with -s for the numbers.
"""

import time

import jax
import numpy as np
import pytest

from jaxrl_fp8.model import random_policy, tiny_config
from jaxrl_fp8.model.attention import resolve_impl
from jaxrl_fp8.precision import get_recipe
from jaxrl_fp8.rollout import sampling
from jaxrl_fp8.rollout.embedded import EmbeddedEngine
from jaxrl_fp8.rollout.types import SamplingParams

CFG = tiny_config(vocab_size=151936, hidden_size=2048, num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=4,
                  head_dim=128, intermediate_size=6144, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                  norm_topk_prob=True, rope_theta=1e6, max_position_embeddings=40960, attention_impl="flash")
ROWS, PROMPT, RESPONSE = 64, 64, 4096
SCORE_ROWS = 1  # rows per trainer forward (logits of 4160 x 151936 floats: 2.5 GB; 4 rows ran out of memory on an H100)


def _trainer_logprobs(policy, samples):
    out = []
    for start in range(0, len(samples), SCORE_ROWS):
        chunk = samples[start : start + SCORE_ROWS]
        ids = np.stack([s.token_ids for s in chunk]).astype(np.int32)
        logits = policy.forward(ids, precision="train").logits
        lp = np.asarray(sampling.token_logprobs(logits, np.roll(ids, -1, axis=1), np.ones(ids.shape, np.float32)))
        out.extend(lp[i, PROMPT - 1 : PROMPT - 1 + RESPONSE] for i in range(len(chunk)))
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["bf16", "fp8_block", "fp8_block_kv"])
def test_gpu_flash_rollout_equals_trainer_bitwise_at_4k(name):
    assert resolve_impl("auto", CFG.head_dim, np.dtype("bfloat16")) == "flash"
    policy = random_policy(CFG, seed=7, dtype="bfloat16", recipe=get_recipe(name))
    engine = EmbeddedEngine(policy, max_batch=ROWS, max_seq_len=PROMPT + RESPONSE)
    assert engine.paged and engine._attention == "flash"
    prompts = np.random.default_rng(1).integers(0, CFG.vocab_size, (ROWS, PROMPT)).tolist()
    t0 = time.perf_counter()
    samples = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=RESPONSE, ignore_eos=True, seed=5))
    rollout_s = time.perf_counter() - t0
    assert all(s.response_ids.size == RESPONSE for s in samples)
    t0 = time.perf_counter()
    trainer = _trainer_logprobs(policy, samples)
    score_s = time.perf_counter() - t0
    d = np.concatenate([t - s.rollout_logprobs for t, s in zip(trainer, samples)])
    bitwise = float(np.mean(d == 0))
    print(f"\n{name}: {d.size} response tokens, bit-identical {100 * bitwise:.3f} %, max |dlogp| {np.abs(d).max():.3e}; "
          f"rollout {rollout_s:.1f} s ({d.size / rollout_s:.0f} tok/s incl. compile), trainer scoring {score_s:.1f} s, "
          f"device {jax.devices()[0].device_kind}")
    assert bitwise == 1.0, (name, float(np.abs(d).max()), bitwise)
