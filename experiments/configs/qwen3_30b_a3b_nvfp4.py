"""Unified NVFP4 for Qwen3-30B-A3B. Native on Blackwell; on Hopper/CPU it runs emulated (quantize -> dequantize ->
BF16 GEMM, the same values), which the recipe allows with emulate=True."""

from jaxrl_fp8.config import base_config


def get_config():
    c = base_config()
    c.workdir = "runs/qwen3_30b_a3b_nvfp4"
    c.recipe = "nvfp4"
    c.hardware = "auto"
    c.model.checkpoint = "/models/Qwen3-30B-A3B"
    c.model.dtype = "bfloat16"
    c.data.source = "jsonl"
    c.data.path = "/data/dapo-math-17k.jsonl"
    c.data.reward = "math"
    c.data.prompts_per_step = 32
    c.data.max_prompt_tokens = 1024
    c.rollout.n_samples = 8
    c.rollout.max_new_tokens = 4096
    c.rl.use_tis = True
    c.rl.learning_rate = 1e-6
    c.rl.num_minibatches = 4
    return c
