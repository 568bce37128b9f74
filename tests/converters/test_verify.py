"""converters.verify catches every kind of difference; FP8 -> BF16 -> FP8 is a fixed point; Orbax reference;
the FP8 checkpoint loads into our model (and its BF16 round trip into transformers) with logits close to BF16."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

from converters import verify as verify_cli
from converters.fp8_to_bf16 import convert_to_bf16
from jaxrl_fp8.model.hf_io import write_safetensors
from converters.verify import verify
from tests.converters.helpers import load_all, trainer_params


@pytest.mark.parametrize(
    "name,tool,flags",
    [
        ("ckpt160", "hf_to_fp8", ("--strategy", "tensor")),
        ("ckpt160", "hf_to_fp8", ("--strategy", "channel")),
        ("ckpt128", "hf_to_fp8", ("--pow2-scale",)),
        ("ckpt160", "hf_to_mxfp8", ()),
        ("ckpt160", "hf_to_nvfp4", ("--four-over-six",)),
        ("ckpt128", "hf_to_nvfp4", ("--quantize-dense", "--num-layers-at-end-in-bf16", "1")),
    ],
)
def test_verify_accepts_every_format(request, convert, name, tool, flags):
    ckpt = request.getfixturevalue(name)
    report = verify(convert(ckpt, tool, *flags), ckpt)
    assert report.ok, [c for c in report.checks if not c.ok] + report.extra
    q = [c for c in report.checks if c.fmt != "bf16"]
    assert q and all(0 < c.rel_err < (0.15 if "nvfp4" in tool else 0.04) for c in q if "experts.1." not in c.name or "layers.0" not in c.name)


def _rewrite(path, name, fn):
    """Apply fn to one stored tensor (rewriting its shard with our writer)."""
    index_file = os.path.join(path, "model.safetensors.index.json")
    with open(index_file) as f:
        index = json.load(f)
    fname = index["weight_map"][name]
    from jaxrl_fp8.model.hf_io import SafetensorsFile

    sf = SafetensorsFile(os.path.join(path, fname))
    tensors = {n: sf.read(n) for n in sf.names()}
    fn(tensors)
    write_safetensors(os.path.join(path, fname), tensors, {"format": "pt"})
    index["weight_map"] = {n: f for n, f in index["weight_map"].items() if f != fname} | {n: fname for n in tensors}
    with open(index_file, "w") as f:
        json.dump(index, f)


def test_verify_reports_each_difference(ckpt160, convert, tmp_path, capsys):
    good = convert(ckpt160, "hf_to_fp8")
    cases = {
        "scale": ("model.layers.2.self_attn.o_proj.weight_scale_inv", lambda t, n: t.__setitem__(n, np.nextafter(t[n], np.inf).astype(np.float32))),
        "data": ("model.layers.0.mlp.experts.2.down_proj.weight", lambda t, n: t.__setitem__(n, -t[n])),
        "copy": ("model.norm.weight", lambda t, n: t.__setitem__(n, (t[n].astype(np.float32) * 1.01).astype(t[n].dtype))),
        "missing": ("model.layers.1.mlp.up_proj.weight_scale_inv", lambda t, n: t.pop(n)),
        "extra": ("model.layers.1.mlp.up_proj.weight_scale_inv", lambda t, n: t.__setitem__("model.layers.1.mlp.bogus", np.zeros(2, np.float32))),
        "dtype": ("model.layers.1.self_attn.q_proj.weight_scale_inv", lambda t, n: t.__setitem__(n, t[n].astype(np.float16))),
    }
    for case, (name, fn) in cases.items():
        bad = str(tmp_path / case)
        shutil.copytree(good, bad)
        _rewrite(bad, name, lambda t: fn(t, name))
        rc = verify_cli.main(["--checkpoint", bad, "--reference", ckpt160, "--quiet", "--json", str(tmp_path / f"{case}.json")])
        out = capsys.readouterr().out
        assert rc == 1 and "FAILED" in out, case
        shown = "model.layers.1.mlp.bogus" if case == "extra" else name.replace("_scale_inv", "")
        assert shown in out, (case, out)
        assert json.load(open(tmp_path / f"{case}.json"))["ok"] is False
    assert verify_cli.main(["--checkpoint", good, "--reference", ckpt160, "--quiet"]) == 0
    assert "VERIFIED" in capsys.readouterr().out
    assert verify_cli.main(["--checkpoint", str(tmp_path / "nope"), "--reference", ckpt160]) == 2


def _same(a: dict, b: dict):
    assert sorted(a) == sorted(b)
    for n in a:
        assert a[n].dtype == b[n].dtype and a[n].tobytes() == b[n].tobytes(), n


@pytest.mark.parametrize("name", ["ckpt160", "ckpt128"])
def test_fp8_bf16_fp8_is_a_fixed_point(request, convert, tmp_path, name):
    """FP32 scales: FP8 -> BF16 -> FP8 returns the same bits (each block's amax element is q = 448, whose
    dequantized value rounds back to the original BF16 amax, so every scale is recomputed exactly)."""
    ckpt = request.getfixturevalue(name)
    fp8 = convert(ckpt, "hf_to_fp8")
    bf16 = str(tmp_path / "bf16")
    convert_to_bf16(fp8, bf16, progress=False)
    with open(os.path.join(bf16, "config.json")) as f:
        assert "quantization_config" not in json.load(f)
    _same(load_all(fp8), load_all(convert(bf16, "hf_to_fp8")))
    src, rt = load_all(ckpt), load_all(bf16)
    assert sorted(src) == sorted(rt) and rt["model.norm.weight"].tobytes() == src["model.norm.weight"].tobytes()


def test_pow2_round_trip_fixed_in_values_then_bits(ckpt128, convert, tmp_path):
    """Power-of-two scales: a block whose max code rounds down to 224 re-quantizes with half the scale and
    doubled codes (same values). So BF16 values are a fixed point at once, the FP8 bits after one round trip."""
    fp8_1 = convert(ckpt128, "hf_to_fp8", "--pow2-scale")
    bf16_1 = str(tmp_path / "bf16_1")
    convert_to_bf16(fp8_1, bf16_1, progress=False)
    fp8_2 = convert(bf16_1, "hf_to_fp8", "--pow2-scale")
    bf16_2 = str(tmp_path / "bf16_2")
    convert_to_bf16(fp8_2, bf16_2, progress=False)
    _same(load_all(bf16_1), load_all(bf16_2))
    _same(load_all(fp8_2), load_all(convert(bf16_2, "hf_to_fp8", "--pow2-scale")))


def test_verify_against_orbax_trainer_checkpoint(ckpt160, convert, tmp_path):
    import orbax.checkpoint as ocp

    params = trainer_params(load_all(ckpt160))
    params = {"params": {k: v for k, v in params.items()}}
    params["params"]["layers"] = {str(i): v for i, v in params["params"]["layers"].items()}  # Orbax keys are strings
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(str(tmp_path / "orbax"), params)
    ckptr.wait_until_finished()
    report = verify(convert(ckpt160, "hf_to_nvfp4"), str(tmp_path / "orbax"))
    assert report.ok and len(report.checks) == len(load_all(ckpt160))


def test_fp8_checkpoint_loads_into_our_model_with_close_logits(ckpt128, convert):
    """Measured on ckpt128 (3 layers, hidden 256, weights N(0, 0.05)): relative logit error ~5e-2."""
    from jaxrl_fp8.model import from_pretrained

    ids = np.random.default_rng(0).integers(0, 256, (2, 12))
    ref = np.asarray(from_pretrained(ckpt128, dtype="float32").logits(ids, precision=None))
    fp8 = np.asarray(from_pretrained(convert(ckpt128, "hf_to_fp8"), dtype="float32").logits(ids, precision=None))
    rel = np.linalg.norm(fp8 - ref) / np.linalg.norm(ref)
    print(f"FP8 checkpoint vs BF16 logits: relative error {rel:.3e}, max |diff| {np.abs(fp8 - ref).max():.3e}")
    assert 0 < rel < 0.15


def test_bf16_round_trip_loads_into_transformers(ckpt128, convert, tmp_path):
    """External reference: transformers reads the dequantized checkpoint; logits stay close to the original."""
    import torch
    import transformers

    bf16 = str(tmp_path / "bf16")
    convert_to_bf16(convert(ckpt128, "hf_to_fp8"), bf16, progress=False)
    ids = torch.tensor(np.random.default_rng(1).integers(0, 256, (2, 12)))
    with torch.no_grad():
        ref = transformers.AutoModelForCausalLM.from_pretrained(ckpt128, dtype=torch.float32)(ids).logits.numpy()
        got = transformers.AutoModelForCausalLM.from_pretrained(bf16, dtype=torch.float32)(ids).logits.numpy()
    rel = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    print(f"transformers, FP8->BF16 checkpoint vs BF16 logits: relative error {rel:.3e}")
    assert 0 < rel < 0.15
