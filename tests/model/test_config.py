"""HF config.json -> ModelConfig: supported fields, and clear errors naming unsupported ones."""

from __future__ import annotations

import pytest

import jaxrl_fp8.model as M
from jaxrl_fp8.model.config import to_hf_config

BASE = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 301, "hidden_size": 64,
    "intermediate_size": 96, "moe_intermediate_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "num_local_experts": 8, "num_experts_per_tok": 2,
    "norm_topk_prob": True, "mlp_only_layers": [1], "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "tie_word_embeddings": False,
}


def test_reads_transformers5_config_with_num_local_experts_alias():
    cfg = M.from_hf_config(BASE)
    assert cfg.num_experts == 8 and cfg.moe_layers == (0, 2) and cfg.q_per_kv == 2
    assert M.from_hf_config(to_hf_config(cfg)) == cfg


def test_legacy_rope_theta_and_rope_scaling():
    d = {**BASE, "rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2.0}}
    del d["rope_parameters"]
    cfg = M.from_hf_config(d)
    assert cfg.rope_theta == 5e5 and cfg.rope_scaling.rope_type == "linear" and cfg.rope_scaling.factor == 2.0


def test_head_dim_defaults_to_hidden_over_heads_and_sparse_step():
    d = {**BASE, "decoder_sparse_step": 2, "mlp_only_layers": []}
    del d["head_dim"]
    cfg = M.from_hf_config(d)
    assert cfg.head_dim == 16 and cfg.moe_layers == (1,)


def test_dense_qwen3():
    d = {k: v for k, v in BASE.items() if k not in ("num_local_experts", "num_experts_per_tok", "moe_intermediate_size")}
    d.update(architectures=["Qwen3ForCausalLM"], model_type="qwen3")
    cfg = M.from_hf_config(d)
    assert not cfg.is_moe and cfg.moe_layers == ()


@pytest.mark.parametrize(
    "change, field",
    [
        ({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}, "architectures"),
        ({"architectures": [], "model_type": "mistral"}, "model_type"),
        ({"attention_bias": True}, "attention_bias"),
        ({"use_sliding_window": True}, "use_sliding_window"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}}, "rope_scaling.rope_type"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}}, "partial_rotary_factor"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
        ({"mlp_only_layers": [7]}, "mlp_only_layers"),
        ({"vocab_size": 0}, "vocab_size"),
        ({"layer_types": ["full_attention", "sliding_attention", "full_attention"]}, "layer_types"),
    ],
)
def test_unsupported_values_name_the_field(change, field):
    with pytest.raises(M.ConfigError, match=field.replace(".", r"\.")):
        M.from_hf_config({**BASE, **change})


def test_missing_field_is_named():
    d = dict(BASE)
    del d["hidden_size"]
    with pytest.raises(M.ConfigError, match="hidden_size"):
        M.from_hf_config(d)


def test_tiny_config_vocab_not_multiple_of_128():
    cfg = M.tiny_config()
    assert cfg.vocab_size % 128 != 0 and cfg.moe_layers and cfg.mlp_only_layers
