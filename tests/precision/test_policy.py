import json

import pytest

from jaxrl_fp8.precision import PrecisionPolicy, load_precision_config
from jaxrl_fp8.precision.names import TABLE, fused_group_of_hf, hf_to_trainer, trainer_to_hf

L, E = 6, 4


def all_names(num_layers=L, num_experts=E, dense_layers=(1,)):
    names = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    for layer in range(num_layers):
        p = f"model.layers.{layer}"
        names += [f"{p}.input_layernorm.weight", f"{p}.post_attention_layernorm.weight"]
        names += [f"{p}.self_attn.{x}_proj.weight" for x in "qkvo"] + [f"{p}.self_attn.{x}_norm.weight" for x in "qk"]
        if layer in dense_layers:
            names += [f"{p}.mlp.{x}_proj.weight" for x in ("gate", "up", "down")]
        else:
            names += [f"{p}.mlp.gate.weight"] + [f"{p}.mlp.experts.{e}.{x}_proj.weight" for e in range(num_experts) for x in ("gate", "up", "down")]
    return names


def test_name_table_roundtrip_every_tensor():
    for name in all_names():
        trainer, expert = hf_to_trainer(name)
        assert trainer_to_hf(trainer, expert) == name
    with pytest.raises(KeyError, match="not a Qwen3"):
        hf_to_trainer("model.layers.0.mlp.shared_expert.up_proj.weight")
    assert len(TABLE) == 10


def test_high_precision_roles_never_quantized():
    pol = PrecisionPolicy("fp8-block", num_layers=L, num_experts=E)
    for name in all_names():
        fmt = pol.format_for(name)
        if any(t in name for t in ("norm", "embed", "lm_head", "mlp.gate.weight")):
            assert fmt == "bf16", name
        else:
            assert fmt == "fp8-block", name


def test_first_last_layers():
    pol = PrecisionPolicy("fp8-block", num_layers=L, num_experts=E, num_layers_at_start_in_bf16=1, num_layers_at_end_in_bf16=2)
    assert pol.format_for("model.layers.0.self_attn.q_proj.weight") == "bf16"
    assert pol.format_for("model.layers.1.mlp.down_proj.weight") == "fp8-block"
    assert pol.format_for("model.layers.3.mlp.experts.2.up_proj.weight") == "fp8-block"
    assert pol.format_for("model.layers.4.mlp.experts.2.up_proj.weight") == "bf16"
    assert pol.format_for_trainer("layers.5.attn.o_proj.weight") == "bf16"
    with pytest.raises(ValueError, match="num_layers_at_end_in_bf16"):
        PrecisionPolicy("fp8-block", num_layers=2, num_layers_at_end_in_bf16=3)


def test_hf_and_trainer_regexes_select_the_same_tensors():
    a = PrecisionPolicy("fp8-block", num_layers=L, num_experts=E, extra_high_precision_hf=(r"model\.layers\.2\.self_attn\.o_proj",))
    b = PrecisionPolicy("fp8-block", num_layers=L, num_experts=E, extra_high_precision_trainer=(r"layers\.2\.attn\.o_proj",))
    for name in all_names():
        assert a.format_for(name) == b.format_for(name), name
    assert a.format_for("model.layers.2.self_attn.o_proj.weight") == "bf16"


def test_fused_groups_extend_or_error():
    pol = PrecisionPolicy("fp8-block", num_layers=L, num_experts=E, extra_high_precision_hf=(r"layers\.2\.self_attn\.q_proj", r"experts\.3\.down", r"layers\.1\.mlp\.up"))
    for x in "qkv":
        assert pol.format_for(f"model.layers.2.self_attn.{x}_proj.weight") == "bf16"
    assert pol.format_for("model.layers.2.self_attn.o_proj.weight") == "fp8-block"  # o_proj is not fused with qkv
    for e in range(E):  # one expert's exception spreads to every expert of that layer (SGLang's fused MoE)
        for x in ("gate", "up", "down"):
            assert pol.format_for(f"model.layers.0.mlp.experts.{e}.{x}_proj.weight") == "bf16"
    assert pol.format_for("model.layers.1.mlp.gate_proj.weight") == "bf16"
    assert pol.format_for("model.layers.1.mlp.down_proj.weight") == "fp8-block"
    strict = PrecisionPolicy("fp8-block", num_layers=L, num_experts=E, extra_high_precision_hf=(r"layers\.2\.self_attn\.q_proj",), on_split_group="error")
    with pytest.raises(ValueError, match=r"splits SGLang's fused module model\.layers\.2\.self_attn\.qkv_proj"):
        strict.format_for("model.layers.2.self_attn.k_proj.weight")
    assert fused_group_of_hf("model.layers.2.self_attn.o_proj.weight") is None


def test_precision_config_file(tmp_path):
    cfg = tmp_path / "p.json"
    cfg.write_text(json.dumps({"rules": [{"pattern": r"model\.layers\.3\.", "format": "bf16"}, {"trainer_pattern": r"layers\.\d+\.moe\.", "format": "nvfp4"}]}))
    pol = PrecisionPolicy.for_format("nvfp4", num_layers=L, num_experts=E, precision_config=str(cfg))
    assert pol.format_for("model.layers.3.mlp.experts.0.up_proj.weight") == "bf16"
    assert pol.format_for("model.layers.2.mlp.experts.0.up_proj.weight") == "nvfp4"
    yml = tmp_path / "p.yaml"
    yml.write_text("rules:\n  - pattern: 'self_attn'\n    format: bf16\n")
    pol = PrecisionPolicy.for_format("fp8-block", num_layers=L, num_experts=E, precision_config=str(yml))
    assert pol.format_for("model.layers.2.self_attn.v_proj.weight") == "bf16"
    assert pol.format_for("model.layers.2.mlp.experts.1.down_proj.weight") == "fp8-block"
    bad = tmp_path / "bad.json"
    for text, msg in [("{", "is not valid JSON"), ('{"rules": [{"pattern": "x"}]}', r"rules\[0\]: each rule needs"),
                      ('{"rules": [{"pattern": "x", "format": "fp6"}]}', "format 'fp6'"), ('{"rules": [{"pattern": "(", "format": "bf16"}]}', "bad regex")]:
        bad.write_text(text)
        with pytest.raises(ValueError, match=msg) as ei:
            load_precision_config(str(bad))
        assert "bad.json" in str(ei.value)
    with pytest.raises(FileNotFoundError):
        load_precision_config(str(tmp_path / "missing.json"))
    mixed = tmp_path / "mixed.json"
    mixed.write_text(json.dumps({"rules": [{"pattern": "x", "format": "mxfp8"}]}))
    with pytest.raises(ValueError, match="one quantized format per checkpoint"):
        PrecisionPolicy.for_format("fp8-block", num_layers=L, precision_config=str(mixed))


def test_modules_to_not_convert():
    pol = PrecisionPolicy("fp8-block", num_layers=L, num_experts=E, num_layers_at_start_in_bf16=1)
    mods = pol.high_precision_modules(all_names())
    assert "model.layers.0.self_attn.q_proj" in mods and "model.layers.0.mlp.experts.3.down_proj" in mods
    assert not any(m.startswith("model.layers.2.") for m in mods)
    assert not any("norm" in m or "embed" in m or "lm_head" in m for m in mods)  # never quantized anyway
    assert PrecisionPolicy("bf16", num_layers=L).high_precision_modules(all_names()) == []


def test_projection_format_names_projections_only():
    pol = PrecisionPolicy("fp8-block", num_layers=L, num_experts=E, num_layers_at_start_in_bf16=1)
    assert pol.projection_format("layers.2.attn.q_proj.weight") == "fp8-block"
    assert pol.projection_format("layers.3.moe.gate_proj.weight") == "fp8-block"  # an expert stack
    assert pol.projection_format("layers.0.attn.q_proj.weight") == "bf16"  # a projection kept high precision
    for other in ("layers.3.moe.router.weight", "lm_head.weight", "embed.embedding", "layers.2.input_norm.scale",
                  "layers.2.attn.q_norm.scale", "not.a.parameter"):
        assert pol.projection_format(other) is None, other


def test_nvfp4_quantizes_experts_only_unless_dense_asked():
    pol = PrecisionPolicy("nvfp4", num_layers=L, num_experts=E)
    assert pol.format_for("model.layers.2.mlp.experts.1.up_proj.weight") == "nvfp4"
    assert pol.format_for("model.layers.2.self_attn.q_proj.weight") == "bf16"
    assert pol.format_for("model.layers.1.mlp.down_proj.weight") == "bf16"  # dense MLP layer
    dense = PrecisionPolicy("nvfp4", num_layers=L, num_experts=E, nvfp4_dense=True)
    assert dense.format_for("model.layers.2.self_attn.q_proj.weight") == "nvfp4"
    # the same object answers for the trainer and, through with_format, for the other side of a recipe
    assert pol.with_format("fp8-block").format_for("model.layers.2.self_attn.q_proj.weight") == "fp8-block"
    assert pol.format_for_trainer("layers.2.attn.q_proj.weight") == "bf16"
