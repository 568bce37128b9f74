"""Tiny random Qwen3-MoE checkpoints written by transformers (torch, CPU) and helpers for the converter tests.

Two shapes: `ckpt128` has every projection dimension a multiple of 128 (full blocks); `ckpt160` has hidden
160 / expert intermediate 96 (partial 128-blocks everywhere) and tied embeddings. Both are saved with a
200 KB shard limit (several shards, tensors of one expert spread over shards) and contain zero blocks:
layer 0 q_proj's first 128x128 block and the whole expert 1 of layer 0.
"""

from __future__ import annotations

import json
import os
import re

import numpy as np

from jaxrl_fp8.model.hf_io import iter_tensors

CONFIGS = {
    "ckpt128": dict(vocab_size=256, hidden_size=256, intermediate_size=384, moe_intermediate_size=128, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=64, tie_word_embeddings=False),
    "ckpt160": dict(vocab_size=300, hidden_size=160, intermediate_size=224, moe_intermediate_size=96, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=32, tie_word_embeddings=True),
}


def make_checkpoint(path: str, name: str, seed: int = 0) -> str:
    import torch
    import transformers

    cfg = transformers.Qwen3MoeConfig(
        num_hidden_layers=3, num_experts=4, num_experts_per_tok=2, mlp_only_layers=[1], max_position_embeddings=64,
        **CONFIGS[name],
    )
    torch.manual_seed(seed)
    model = transformers.Qwen3MoeForCausalLM(cfg).to(torch.bfloat16).eval()
    with torch.no_grad():
        sd = model.state_dict()
        for k, v in sd.items():  # wider spread than the default init, plus zero blocks
            if v.ndim >= 2 and "embed" not in k:
                v.copy_(torch.randn_like(v, dtype=torch.float32).mul(0.05).to(v.dtype))
        sd["model.layers.0.self_attn.q_proj.weight"][:128, :128] = 0
        for key in ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"):
            sd[key][1].zero_()  # transformers 5 keeps experts fused in memory; saved per expert
        model.load_state_dict(sd, strict=False)
    model.save_pretrained(path, max_shard_size="200KB")
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"model_max_length": 64, "tokenizer_class": "PreTrainedTokenizerFast"}, f)
    return path


def load_all(path: str) -> dict[str, np.ndarray]:
    return dict(iter_tensors(path))


def trainer_params(hf_tensors: dict[str, np.ndarray]) -> dict:
    """Nested {trainer path} dict (the shape of nnx.to_pure_dict(state)); experts stacked [E, N, K]."""
    from jaxrl_fp8.precision.names import hf_to_trainer

    flat, stacks = {}, {}
    for name, arr in hf_tensors.items():
        path, expert = hf_to_trainer(name)
        if expert is None:
            flat[path] = arr
        else:
            stacks.setdefault(path, {})[expert] = arr
    for path, by_e in stacks.items():
        flat[path] = np.stack([by_e[e] for e in sorted(by_e)])
    nested: dict = {}
    for path, arr in flat.items():
        node = nested
        parts = [int(p) if p.isdigit() else p for p in path.split(".")]
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = arr
    return nested


def natural(s):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", s)]
