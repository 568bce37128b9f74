"""Block-FP8 checkpoints (weight e4m3 + weight_scale_inv) and the FP8 forward's error against fp32."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxrl_fp8.model as M
from jaxrl_fp8.model import hf_io
from jaxrl_fp8.precision import QuantizedWeight, dequantize_fp8_per_block, get_recipe, quantize_fp8_per_block
from jaxrl_fp8.precision.names import TensorRole, role_of_hf

# hidden 128 so that the 128x128 weight blocks and 1x128 activation groups are full blocks.
CFG = M.tiny_config(num_hidden_layers=2, hidden_size=128, head_dim=32, intermediate_size=256, moe_intermediate_size=128)
FP8_REL_BOUND = 0.12  # |logits_fp8 - logits_fp32| / |logits_fp32| (Frobenius); measured 0.078 on this model
BF16_REL_BOUND = 0.02


def _ids():
    return np.random.default_rng(0).integers(0, CFG.vocab_size, (2, 8))


@pytest.fixture(scope="module")
def master():
    return M.random_policy(CFG, seed=3, dtype="float32")


@pytest.fixture(scope="module")
def fp8_ckpt(master, tmp_path_factory):
    """Quantize every q/k/v/o, dense and expert projection to 128x128 FP8 blocks, through the contract."""
    from jaxrl_fp8.model import loader

    tensors = {}
    for name, (shape, dtype, produce) in loader.hf_tensors_of(master.model).items():
        w = produce()
        if role_of_hf(name) in (TensorRole.LINEAR, TensorRole.EXPERT):
            q, s = quantize_fp8_per_block(jnp.asarray(w))
            q, s = np.asarray(q), np.asarray(s)
            tensors[name] = (q.shape, q.dtype, lambda q=q: q)
            tensors[name + "_scale_inv"] = (s.shape, s.dtype, lambda s=s: s)
        else:
            tensors[name] = (shape, dtype, lambda w=w: w)
    config = M.to_hf_config(CFG, dtype="bfloat16")
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    path = str(tmp_path_factory.mktemp("fp8") / "ckpt")
    hf_io.save_sharded(path, tensors, config=config, max_shard_size="200KB")
    return path


def test_fp8_checkpoint_dequantizes_into_masters(fp8_ckpt):
    policy = M.from_pretrained(fp8_ckpt, dtype="float32")
    f = hf_io.SafetensorsFile(next(s.file for s in hf_io.iter_shards(fp8_ckpt) if "model.layers.0.self_attn.q_proj.weight" in s))
    q, s = f.read("model.layers.0.self_attn.q_proj.weight"), f.read("model.layers.0.self_attn.q_proj.weight_scale_inv")
    want = np.asarray(dequantize_fp8_per_block(jnp.asarray(q), jnp.asarray(s)))
    np.testing.assert_array_equal(np.asarray(policy.model.layers[0].attn.q_proj.weight.get_value()), want)


def test_fp8_checkpoint_kept_quantized_runs_fp8_forward(fp8_ckpt, master):
    recipe = get_recipe("fp8_block")
    kept = M.from_pretrained(fp8_ckpt, dtype="float32", quantized="keep", recipe=recipe)
    w = kept.model.layers[0].moe.gate_proj.weight.get_value()
    assert isinstance(w, QuantizedWeight) and w.fmt == "fp8-block" and w.data.shape == (CFG.num_experts, 128, 128)
    deq = M.from_pretrained(fp8_ckpt, dtype="float32", recipe=recipe)
    ids = _ids()
    a = np.asarray(kept.logits(ids, precision="train"))
    b = np.asarray(deq.logits(ids, precision="train"))  # re-quantizes the dequantized masters
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * np.abs(b).max())
    # Without a precision policy a kept weight is dequantized: same bits as the dequantized masters.
    np.testing.assert_array_equal(np.asarray(kept.logits(ids, precision=None)), np.asarray(deq.logits(ids, precision=None)))


def test_fp8_forward_relative_logit_error_vs_fp32(master):
    ids = _ids()
    ref = np.asarray(master.logits(ids, precision=None))
    fp8 = M.Policy(master.model, recipe=get_recipe("fp8_block"))
    bf16 = M.Policy(master.model, recipe=get_recipe("bf16"))
    rel = lambda x: float(np.linalg.norm(x - ref) / np.linalg.norm(ref))
    e8, e16 = rel(np.asarray(fp8.logits(ids))), rel(np.asarray(bf16.logits(ids)))
    print(f"relative logit error vs fp32: fp8-block {e8:.4f}, bf16 {e16:.4f}")
    assert 0 < e16 < BF16_REL_BOUND
    assert e16 < e8 < FP8_REL_BOUND
    # Rollout and training formats run on the same parameters (no copy).
    mixed = M.Policy(master.model, recipe=get_recipe("bf16_train_fp8_rollout"))
    np.testing.assert_array_equal(np.asarray(mixed.logits(ids, precision="rollout")), np.asarray(fp8.logits(ids)))
    np.testing.assert_array_equal(np.asarray(mixed.logits(ids, precision="train")), np.asarray(bf16.logits(ids)))


def test_bad_fp8_scale_is_named(fp8_ckpt, tmp_path):
    tensors = dict(hf_io.iter_tensors(fp8_ckpt))
    config = hf_io.read_config(fp8_ckpt)
    del tensors["model.layers.1.mlp.down_proj.weight_scale_inv"]
    bad = str(tmp_path / "bad")
    hf_io.save_sharded(bad, {k: (v.shape, v.dtype, lambda v=v: v) for k, v in tensors.items()}, config=config)
    with pytest.raises(M.CheckpointError, match=r"down_proj\.weight' has no 'model\.layers\.1\.mlp\.down_proj\.weight_scale_inv'"):
        M.from_pretrained(bad)
    config["quantization_config"]["weight_block_size"] = [1, 128]
    hf_io.write_json_atomic(f"{bad}/config.json", config)
    with pytest.raises(M.CheckpointError, match="weight_block_size"):
        M.from_pretrained(bad)


def test_moe_quantizes_tokens_before_the_expert_gather(master, monkeypatch):
    """The fp8-block MoE quantizes each token once and gathers its groups to its k expert rows: the logits are the
    bits of quantizing the gathered rows (the path with the pre-quantized input switched off)."""
    from jaxrl_fp8.model import matmul, qwen3

    ids = np.random.default_rng(1).integers(0, CFG.vocab_size, (3, 5))  # a shape no other test traced
    fp8 = M.Policy(master.model, recipe=get_recipe("fp8_block"))
    calls = []
    real = matmul.grouped_fp8_input
    monkeypatch.setattr(matmul, "grouped_fp8_input", lambda x, w: calls.append(x.shape) or real(x, w))
    pre = np.asarray(fp8.logits(ids))
    assert calls == [(ids.size, CFG.hidden_size)] * len(CFG.moe_layers) != []  # the tokens quantized once an MoE layer
    monkeypatch.setattr(qwen3.MoE, "_sorted_fp8_input", lambda self, x, d, ctx: None)
    jax.clear_caches()  # retrace without the pre-quantized input
    calls.clear()
    np.testing.assert_array_equal(pre, np.asarray(fp8.logits(ids)))
    assert calls == []
