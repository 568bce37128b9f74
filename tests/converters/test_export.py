"""Live export == CLI output bit for bit; layer exceptions identical in both; buckets; NNX parameters."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from jaxrl_fp8.precision import FP8_BLOCK, MXFP8, NVFP4, get_recipe

from converters import hf_to_fp8
from converters.export import export_weights, save_exported
from converters.policy_flags import build_policy
from converters.quantize import ConversionError
from converters.reference import ParamsReference
from converters.verify import verify
from tests.converters.helpers import load_all, natural, trainer_params

FMT_TOOL = {FP8_BLOCK: "hf_to_fp8", MXFP8: "hf_to_mxfp8", NVFP4: "hf_to_nvfp4"}


def _config(path):
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)


def _exported(params, recipe_or_fmt, policy, bucket_bytes=1 << 16):
    out = {}
    for bucket in export_weights(params, recipe_or_fmt, policy, bucket_bytes=bucket_bytes):
        for name, arr in bucket:
            assert name not in out
            out[name] = arr
    return out


def assert_same_tensors(a: dict, b: dict):
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        assert a[name].tobytes() == b[name].tobytes(), name


@pytest.mark.parametrize("name,fmt", [("ckpt160", FP8_BLOCK), ("ckpt128", MXFP8), ("ckpt128", NVFP4), ("ckpt160", NVFP4)])
def test_export_equals_cli(request, convert, tmp_path, name, fmt):
    ckpt = request.getfixturevalue(name)
    cli_dir = convert(ckpt, FMT_TOOL[fmt])
    params = trainer_params(load_all(ckpt))
    policy = build_policy(fmt, _config(ckpt))
    assert_same_tensors(_exported(params, fmt, policy), load_all(cli_dir))
    # the disk path of the weight sync writes the same checkpoint (config included)
    save_exported(params, fmt, policy, str(tmp_path / "exp"), hf_config=_config(ckpt), shard_bytes=1 << 18, side_files_from=ckpt)
    assert_same_tensors(load_all(str(tmp_path / "exp")), load_all(cli_dir))
    assert _config(str(tmp_path / "exp")) == _config(cli_dir)
    assert verify(str(tmp_path / "exp"), ckpt).ok


def test_export_from_recipe_uses_rollout_side(ckpt128, convert):
    """A Recipe exports its rollout format with its options (pow2 scales here)."""
    recipe = get_recipe("bf16_train_fp8_rollout", pow2_scale=True)
    policy = build_policy(FP8_BLOCK, _config(ckpt128))
    params = trainer_params(load_all(ckpt128))
    assert_same_tensors(_exported(params, recipe, policy.with_format("bf16")), load_all(convert(ckpt128, "hf_to_fp8", "--pow2-scale")))


EXCEPTIONS = ("--num-layers-at-start-in-bf16", "1", "--extra-high-precision-layers-hf", r"layers\.2\.self_attn\.q_proj", r"layers\.2\.mlp\.experts\.1\.")


def test_layer_exceptions_identical_in_converter_and_export(ckpt128, convert):
    out = convert(ckpt128, "hf_to_fp8", *EXCEPTIONS)
    got = load_all(out)
    policy = build_policy(FP8_BLOCK, _config(ckpt128), num_layers_at_start_in_bf16=1, extra_high_precision_hf=EXCEPTIONS[3:])
    assert_same_tensors(_exported(trainer_params(load_all(ckpt128)), FP8_BLOCK, policy), got)
    quantized = {n[: -len("_scale_inv")] for n in got if n.endswith("weight_scale_inv")}
    # layer 0 entirely high precision; the q_proj exception took k/v along (fused qkv_proj); o_proj still FP8
    assert not [n for n in quantized if n.startswith("model.layers.0.")]
    assert not [n for n in quantized if n.startswith("model.layers.2.self_attn.") and "o_proj" not in n]
    assert "model.layers.2.self_attn.o_proj.weight" in quantized
    # one expert's exception took every expert of the layer along (one fused MoE module)
    assert not [n for n in quantized if n.startswith("model.layers.2.mlp.experts.")]
    assert "model.layers.1.mlp.gate_proj.weight" in quantized
    excluded = _config(out)["quantization_config"]["modules_to_not_convert"]
    for module in ("model.layers.2.self_attn.qkv_proj", "model.layers.2.self_attn.k_proj", "model.layers.2.mlp.experts",
                   "model.layers.2.mlp.experts.3.down_proj", "model.layers.0.self_attn.qkv_proj", "model.layers.0.mlp.experts"):
        assert module in excluded, module
    assert "model.layers.2.self_attn.o_proj" not in excluded and excluded == sorted(excluded, key=natural)
    report = verify(out, ckpt128)  # the policy rebuilt from modules_to_not_convert reproduces every tensor
    assert report.ok and sum(c.fmt == "bf16" for c in report.checks) > 17


def test_trainer_regex_equals_hf_regex(ckpt128, convert):
    """Exceptions written on trainer names pick the same tensors as on HF names (one name table)."""
    hf = convert(ckpt128, "hf_to_fp8", "--extra-high-precision-layers-hf", r"layers\.1\.mlp\.up_proj")
    tr = convert(ckpt128, "hf_to_fp8", "--extra-high-precision-layers-trainer", r"layers\.1\.mlp\.up_proj")
    assert_same_tensors(load_all(hf), load_all(tr))
    assert "model.layers.1.mlp.gate_proj.weight_scale_inv" not in load_all(hf)  # gate/up kept together


def test_split_group_can_be_refused(ckpt128, tmp_path, capsys):
    rc = hf_to_fp8.main(["--model-dir", ckpt128, "--save-dir", str(tmp_path / "o"), "--no-progress", "--on-split-group", "error",
                         "--extra-high-precision-layers-hf", r"layers\.0\.self_attn\.k_proj"])
    assert rc == 1 and "qkv_proj" in capsys.readouterr().err and not os.path.exists(tmp_path / "o")


def test_buckets_respect_the_byte_limit(ckpt160):
    params = trainer_params(load_all(ckpt160))
    policy = build_policy(NVFP4, {"num_hidden_layers": 3, "num_experts": 4})
    limit = 20_000
    buckets = list(export_weights(params, NVFP4, policy, bucket_bytes=limit))
    for b in buckets:
        assert sum(a.nbytes for _, a in b) <= limit or len(b) == 1
    assert any(len(b) == 1 and b[0][1].nbytes > limit for b in buckets)  # the embedding travels alone
    flat = [(n, a.tobytes()) for b in buckets for n, a in b]
    one = [(n, a.tobytes()) for b in export_weights(params, NVFP4, policy, bucket_bytes=1 << 40) for n, a in b]
    assert flat == one and len(buckets) > 5


def test_export_from_nnx_module(tmp_path):
    """An NNX model's parameters export (experts unstacked) and verify against themselves."""
    import jax.numpy as jnp

    from jaxrl_fp8.model.config import tiny_config, to_hf_config
    from jaxrl_fp8.model.qwen3 import Qwen3

    cfg = tiny_config()
    model = Qwen3(cfg, dtype=jnp.bfloat16)
    hf_config = to_hf_config(cfg)
    for fmt in (FP8_BLOCK,):  # NVFP4 stacks are covered by test_export_equals_cli
        policy = build_policy(fmt, hf_config, num_layers_at_end_in_bf16=1)
        save_exported(model, fmt, policy, str(tmp_path / fmt), hf_config=hf_config, shard_bytes=1 << 16)
        report = verify(str(tmp_path / fmt), ParamsReference(model))
        assert report.ok, [c for c in report.checks if not c.ok]
        n_experts = sum(".mlp.experts." in c.name for c in report.checks)
        assert n_experts == len(cfg.moe_layers) * cfg.num_experts * 3


def test_export_refuses_non_finite(ckpt160):
    params = trainer_params(load_all(ckpt160))
    bad = params["layers"][2]["moe"]["down_proj"]["weight"].copy()
    bad[3, 5, 7] = np.nan
    params["layers"][2]["moe"]["down_proj"]["weight"] = bad
    with pytest.raises(ConversionError, match=r"model\.layers\.2\.mlp\.experts\.3\.down_proj\.weight.*layers\.2\.moe\.down_proj\.weight\[3\]"):
        _exported(params, FP8_BLOCK, build_policy(FP8_BLOCK, {"num_hidden_layers": 3, "num_experts": 4}))
