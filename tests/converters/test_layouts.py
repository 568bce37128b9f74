"""Every output tensor's name / dtype / shape as SGLang loads it (`converters/spec.py`), configs, error bounds, zero blocks.

Dequantization here is written independently in numpy (not with the contract) so the bounds test the files.
"""

from __future__ import annotations

import json
import math
import os

import ml_dtypes
import numpy as np
import pytest

from jaxrl_fp8.precision import names as N

from tests.converters.helpers import load_all

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
BF16 = np.dtype(ml_dtypes.bfloat16)
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float32)
QUANTIZABLE = (N.TensorRole.LINEAR, N.TensorRole.EXPERT)


def _json(path, name):
    with open(os.path.join(path, name)) as f:
        return json.load(f)


def _header_nbytes(path):
    """Sum of tensor bytes from the shard headers, and the names per file (independent of our writer)."""
    import struct

    total, names = 0, {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            with open(os.path.join(path, f), "rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
                header = json.loads(fh.read(n))
            header.pop("__metadata__", None)
            for k, v in header.items():
                total += v["data_offsets"][1] - v["data_offsets"][0]
                names[k] = f
    return total, names


def check_index_and_side_files(src, out):
    index = _json(out, "model.safetensors.index.json")
    total, where = _header_nbytes(out)
    assert index["metadata"]["total_size"] == total
    assert index["weight_map"] == where
    for f in ("generation_config.json", "tokenizer_config.json"):
        assert open(os.path.join(out, f)).read() == open(os.path.join(src, f)).read()
    assert not [d for d in os.listdir(os.path.dirname(out)) if ".tmp-" in d]


def fp8_block_dequant(q, s, bn=128, bk=128):
    n, k = q.shape
    full = np.repeat(np.repeat(s, bn, 0), bk, 1)[:n, :k]
    return q.astype(np.float32) * full, full


@pytest.mark.parametrize("name,strategy", [("ckpt128", "block"), ("ckpt160", "block"), ("ckpt160", "tensor"), ("ckpt160", "channel")])
def test_fp8_layout_and_bounds(request, convert, name, strategy):
    ckpt = request.getfixturevalue(name)
    out = convert(ckpt, "hf_to_fp8", *(("--strategy", strategy) if strategy != "block" else ()))
    src, got = load_all(ckpt), load_all(out)
    cfg = _json(out, "config.json")
    qc = cfg["quantization_config"]
    expected_names = set()
    for name, w in src.items():
        m = name[: -len(".weight")]
        if N.role_of_hf(name) not in QUANTIZABLE:
            assert got[name].dtype == BF16 and got[name].tobytes() == w.tobytes(), name
            expected_names.add(name)
            continue
        n, k = w.shape
        q = got[name]
        assert q.dtype == E4M3 and q.shape == (n, k), name
        x = w.astype(np.float32)
        if strategy == "block":
            s = got[f"{m}.weight_scale_inv"]
            assert s.dtype == np.float32 and s.shape == (math.ceil(n / 128), math.ceil(k / 128)), name
            xh, sfull = fp8_block_dequant(q, s)
            expected_names |= {name, f"{m}.weight_scale_inv"}
        else:
            s = got[f"{m}.weight_scale"]
            assert s.dtype == np.float32 and s.shape == ((1,) if strategy == "tensor" else (n, 1)), name
            sfull = np.broadcast_to(s.reshape(-1, 1) if strategy == "channel" else s.reshape(1, 1), (n, k))
            xh = q.astype(np.float32) * sfull
            expected_names |= {name, f"{m}.weight_scale"}
        assert np.all(np.isfinite(s)) and np.all(s > 0), name
        bound = np.abs(x) * (2**-4 + 2**-20) + sfull * 2**-10
        assert np.all(np.abs(xh - x) <= bound), (name, float(np.max(np.abs(xh - x) - bound)))
    assert set(got) == expected_names
    if strategy == "channel":
        assert qc["quant_method"] == "compressed-tensors" and qc["config_groups"]["group_0"]["weights"]["strategy"] == "channel"
        assert qc["ignore"] == []
    else:
        assert qc["quant_method"] == "fp8" and qc["fmt"] == "e4m3" and qc["activation_scheme"] == "dynamic"
        assert qc["modules_to_not_convert"] == []
        assert qc.get("weight_block_size") == ([128, 128] if strategy == "block" else None)
    check_index_and_side_files(ckpt, out)


def test_fp8_zero_block_and_pow2(ckpt128, convert):
    for flags in ((), ("--pow2-scale",)):
        out = convert(ckpt128, "hf_to_fp8", *flags)
        got = load_all(out)
        q, s = got["model.layers.0.self_attn.q_proj.weight"], got["model.layers.0.self_attn.q_proj.weight_scale_inv"]
        assert np.all(q[:128, :128].astype(np.float32) == 0) and np.isfinite(s[0, 0]) and s[0, 0] > 0
        xe = got["model.layers.0.mlp.experts.1.up_proj.weight"].astype(np.float32)
        assert np.all(xe == 0) and np.all(np.isfinite(got["model.layers.0.mlp.experts.1.up_proj.weight_scale_inv"]))
        for name, a in got.items():
            if a.dtype.name.startswith("float") or a.dtype == E4M3:
                assert np.all(np.isfinite(a.astype(np.float32))), name
        if flags:
            qc = _json(out, "config.json")["quantization_config"]
            assert qc["scale_fmt"] == "ue8m0"
            scales = np.concatenate([a.ravel() for n, a in got.items() if n.endswith("weight_scale_inv")])
            mant = scales.view(np.uint32) & 0x7FFFFF
            assert np.all(mant == 0), "pow2 scales must be exact powers of two"


def test_mxfp8_layout_and_bounds(ckpt, convert):
    out = convert(ckpt, "hf_to_mxfp8")
    src, got = load_all(ckpt), load_all(out)
    qc = _json(out, "config.json")["quantization_config"]
    assert qc["quant_method"] == "mxfp8" and qc["weight_block_size"] == [1, 32] and qc["scale_fmt"] == "ue8m0"
    n_quantized = 0
    for name, w in src.items():
        if N.role_of_hf(name) not in QUANTIZABLE:
            assert got[name].tobytes() == w.tobytes()
            continue
        n_quantized += 1
        n, k = w.shape
        q, s = got[name], got[name[: -len(".weight")] + ".weight_scale_inv"]
        assert q.dtype == E4M3 and q.shape == (n, k) and s.dtype == np.uint8 and s.shape == (n, k // 32), name
        assert np.all(s < 255)
        sf = np.repeat(np.ldexp(np.float32(1), s.astype(np.int32) - 127).astype(np.float32), 32, 1)
        x, xh = w.astype(np.float32), q.astype(np.float32) * sf
        assert np.all(np.abs(xh - x) <= np.abs(x) * 2**-4 + sf * 2**-10), name
        assert np.all(np.abs(x) <= 448 * sf), "MXFP8 scales never saturate"
    assert n_quantized == 3 * 4 + 3 * 2 * 4 + 3  # attention 3 layers, experts 2 layers x 4 x 3, one dense MLP
    check_index_and_side_files(ckpt, out)


def nvfp4_dequant(packed, bs, g):
    codes = np.stack([packed & 0xF, packed >> 4], -1).reshape(packed.shape[0], -1)
    vals = E2M1[codes & 7] * np.where(codes & 8, -1.0, 1.0).astype(np.float32)
    d = np.repeat(bs.astype(np.float32) * np.float32(g), 16, 1)
    return vals * d, d


@pytest.mark.parametrize("name,flags", [("ckpt128", ()), ("ckpt160", ()), ("ckpt160", ("--four-over-six",)), ("ckpt128", ("--quantize-dense",))])
def test_nvfp4_layout_pairs_and_bounds(request, convert, name, flags):
    ckpt = request.getfixturevalue(name)
    out = convert(ckpt, "hf_to_nvfp4", *flags)
    src, got = load_all(ckpt), load_all(out)
    qc = _json(out, "config.json")["quantization_config"]
    hq = _json(out, "hf_quant_config.json")
    assert qc["quant_method"] == "modelopt" and qc["quant_algo"] == "NVFP4" and qc["group_size"] == 16
    assert hq["producer"]["name"] == "modelopt"
    assert hq["quantization"]["quant_algo"] == "NVFP4" and hq["quantization"]["group_size"] == 16
    assert hq["quantization"]["exclude_modules"] == qc["ignore"] and "lm_head" in qc["ignore"]
    dense = "--quantize-dense" in flags
    for name, w in src.items():
        role = N.role_of_hf(name)
        quantized = role == N.TensorRole.EXPERT or (dense and role == N.TensorRole.LINEAR)
        m = name[: -len(".weight")]
        if not quantized:
            assert got[name].tobytes() == w.tobytes() and f"{m}.weight_scale" not in got, name
            if role == N.TensorRole.LINEAR:
                assert m in qc["ignore"], m
            continue
        n, k = w.shape
        p, bs, g, isc = got[name], got[f"{m}.weight_scale"], got[f"{m}.weight_scale_2"], got[f"{m}.input_scale"]
        assert p.dtype == np.uint8 and p.shape == (n, k // 2), name
        assert bs.dtype == E4M3 and bs.shape == (n, k // 16), name
        assert g.dtype == np.float32 and g.shape == () and np.isfinite(g) and g > 0, name
        assert isc.dtype == np.float32 and isc.shape == () and isc == 1.0, name
        x = w.astype(np.float32)
        xh, d = nvfp4_dequant(p, bs, g)
        assert np.all(np.isfinite(xh)), name
        bound = np.maximum(0.25 * d, np.abs(x) / 4) * (1 + 2**-20) + 1e-12  # ties (y = 0.75 etc.) sit on the bound
        assert np.all(np.abs(xh - x) <= bound), name
        if role == N.TensorRole.EXPERT and name.endswith("gate_proj.weight"):
            up = name.replace("gate_proj", "up_proj")
            assert got[up[: -len(".weight")] + ".weight_scale_2"] == g, "gate/up must share one global scale"
            amax = max(np.abs(x).max(), np.abs(src[up].astype(np.float32)).max(), 1e-10)
            emax = 256.0 if "--four-over-six" in flags else 448.0
            assert g == np.float32(np.float32(amax) / np.float32(6 * emax))
    zero = "model.layers.0.mlp.experts.1.gate_proj"
    assert np.all(got[zero + ".weight"] == 0) and np.all(got[zero + ".weight_scale"].astype(np.float32) == 0)
    check_index_and_side_files(ckpt, out)


def test_nvfp4_pair_matches_contract_pair(ckpt128, convert):
    """The converter's shared global scale is the contract's quantize_nvfp4_pair, bit for bit."""
    from jaxrl_fp8.precision import quantize_nvfp4_pair

    got, src = load_all(convert(ckpt128, "hf_to_nvfp4")), load_all(ckpt128)
    base = "model.layers.2.mlp.experts.3."
    (gp, gbs, gg), (up, ubs, ug) = quantize_nvfp4_pair(src[base + "gate_proj.weight"], src[base + "up_proj.weight"])
    assert np.asarray(gg) == got[base + "gate_proj.weight_scale_2"] == got[base + "up_proj.weight_scale_2"]
    assert np.array_equal(np.asarray(gp), got[base + "gate_proj.weight"])
    assert np.asarray(ubs).tobytes() == got[base + "up_proj.weight_scale"].tobytes()


def test_fp8_block_checkpoint_codes_are_the_trainers_operands(monkeypatch):
    """An fp8-block (128 x 128) tensor is quantized by the maker of the trainer's GEMM operands, on the backend chosen
    for where the array lives: the XLA contract for a CPU array (on a Hopper GPU: the Pallas kernel the trainer runs)."""
    import jax
    import jax.numpy as jnp

    from converters import quantize
    from converters.quantize import quantize_hf_tensor
    from converters.spec import QuantSpec
    from jaxrl_fp8.ops import backends

    quantize._quantize.clear_cache()  # trace again, through the patched maker
    asked = []
    make = backends.fp8_weight_operands
    monkeypatch.setattr("converters.quantize.fp8_weight_operands",
                        lambda w, backend=None, **kw: asked.append((backend, kw)) or make(w, backend, **kw))
    w = jax.device_put(jnp.asarray(np.random.default_rng(3).standard_normal((256, 384)), jnp.bfloat16), jax.devices("cpu")[0])
    assert backends.backend_of_array(w) == "xla"
    out = dict(quantize_hf_tensor("model.layers.0.mlp.experts.0.up_proj.weight", w, QuantSpec("fp8-block"), "fp8-block"))
    assert asked == [("xla", {"pow2_scale": False})]
    q, s = make(w, "xla")
    np.testing.assert_array_equal(out["model.layers.0.mlp.experts.0.up_proj.weight"].view(np.uint8), np.asarray(q).view(np.uint8))
    np.testing.assert_array_equal(out["model.layers.0.mlp.experts.0.up_proj.weight_scale_inv"], np.asarray(s))
