"""Unified block-wise FP8 (DeepSeek-style 128x128) for Qwen3-30B-A3B, with TIS and R3: the seed's Hopper recipe.

Point model.checkpoint at an HF Qwen3-30B-A3B directory (BF16 or the block-FP8 release) and data.path at a
JSONL math dataset ({"prompt": ..., "label": ...}).
"""

from jaxrl_fp8.config import base_config


def get_config():
    c = base_config()
    c.workdir = "runs/qwen3_30b_a3b_fp8"
    c.recipe = "fp8_block"
    c.hardware = "hopper"
    c.total_steps = 200
    c.model.checkpoint = "/models/Qwen3-30B-A3B"
    c.model.dtype = "bfloat16"
    c.data.source = "jsonl"
    c.data.path = "/data/dapo-math-17k.jsonl"
    c.data.prompt_key = "prompt"
    c.data.answer_key = "label"
    c.data.reward = "math"
    c.data.prompts_per_step = 32
    c.data.max_prompt_tokens = 1024
    c.rollout.n_samples = 8
    c.rollout.max_new_tokens = 4096
    c.rollout.routing_replay = True
    c.rl.use_tis = True
    c.rl.eps_clip_high = 0.28
    c.rl.learning_rate = 1e-6
    c.rl.num_minibatches = 4
    c.rl.weight_decay = 0.1
    c.checkpoint.every_steps = 20
    return c
