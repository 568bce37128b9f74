"""Unified block-wise FP8 (DeepSeek-style 128x128) for Qwen3-30B-A3B, with TIS and R3: Miles' Hopper recipe.

Point model.checkpoint at an HF Qwen3-30B-A3B directory (BF16 or the block-FP8 release) and data.path at a
JSONL math dataset ({"prompt": ..., "label": ...}).
"""

from jaxrl_fp8.config import math_rl_config


def get_config():
    c = math_rl_config(workdir="runs/qwen3_30b_a3b_fp8", recipe="fp8_block", checkpoint="/models/Qwen3-30B-A3B", hardware="hopper")
    c.rl.weight_decay = 0.1
    return c
