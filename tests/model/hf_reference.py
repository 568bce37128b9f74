"""transformers (torch, CPU, fp32) reference models for the model tests. torch is a test-only dependency."""

from __future__ import annotations

import numpy as np
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

BASE_MOE = dict(
    vocab_size=301, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
    max_position_embeddings=256,
)


def make_hf_model(seed: int = 0, dense: bool = False, **overrides):
    """A randomly initialised HF model; norm scales randomised too (HF initialises them to 1)."""
    torch.manual_seed(seed)
    kw = {**BASE_MOE, **overrides}
    if dense:
        for key in ("moe_intermediate_size", "num_experts", "num_experts_per_tok", "mlp_only_layers", "norm_topk_prob", "decoder_sparse_step"):
            kw.pop(key, None)
        model = Qwen3ForCausalLM(Qwen3Config(**kw))
    else:
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**kw))
    model.eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif "mlp.gate.weight" in name:
                p.mul_(20.0)  # spread router logits so top-k picks are far from ties
    return model


def hf_logits(model, ids: np.ndarray, **kw) -> np.ndarray:
    with torch.no_grad():
        return model(torch.as_tensor(ids), **kw).logits.float().numpy()


def random_ids(vocab: int, shape, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, shape)
