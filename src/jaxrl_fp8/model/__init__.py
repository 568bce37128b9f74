"""Flax NNX Qwen3-MoE (and dense Qwen3) policy: HF config + safetensors I/O, precision-aware forward, KV cache.

Design notes: docs/decisions/0003-model.md.
"""

from jaxrl_fp8.model.cache import KVCache, init_cache
from jaxrl_fp8.model.config import ConfigError, ModelConfig, RopeScaling, from_hf_config, tiny_config, to_hf_config
from jaxrl_fp8.model.hf_io import CheckpointError
from jaxrl_fp8.model.policy import Policy, from_pretrained, parse_dtype, random_policy, token_logprobs
from jaxrl_fp8.model.qwen3 import ModelOutput, Qwen3, segment_positions

__all__ = [
    "CheckpointError",
    "ConfigError",
    "KVCache",
    "ModelConfig",
    "ModelOutput",
    "Policy",
    "Qwen3",
    "RopeScaling",
    "from_hf_config",
    "from_pretrained",
    "init_cache",
    "parse_dtype",
    "random_policy",
    "segment_positions",
    "tiny_config",
    "to_hf_config",
    "token_logprobs",
]
