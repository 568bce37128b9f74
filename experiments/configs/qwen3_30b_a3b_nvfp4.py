"""Unified NVFP4 for Qwen3-30B-A3B. Native on Blackwell; on Hopper/CPU it runs emulated (quantize -> dequantize ->
BF16 GEMM, the same values), which the recipe allows with emulate=True."""

from jaxrl_fp8.config import math_rl_config


def get_config():
    return math_rl_config(workdir="runs/qwen3_30b_a3b_nvfp4", recipe="nvfp4", checkpoint="/models/Qwen3-30B-A3B")
