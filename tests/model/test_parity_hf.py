"""Logits, routing, aux loss and gradients against transformers' Qwen3MoeForCausalLM / Qwen3ForCausalLM (fp32, CPU)."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

import jaxrl_fp8.model as M
from tests.model.hf_reference import hf_logits, make_hf_model, random_ids

TOL = 1e-4  # max |Δlogit| in fp32 (the bound); measured values are ~1e-6

CASES = {
    "moe_norm_topk_mlp_only_gqa2_vocab301": dict(norm_topk_prob=True, mlp_only_layers=[1]),
    "moe_no_norm_sparse_step2_tied_gqa4_vocab257": dict(
        norm_topk_prob=False, decoder_sparse_step=2, tie_word_embeddings=True, vocab_size=257,
        num_attention_heads=8, num_key_value_heads=2, head_dim=8,
    ),
    "moe_mha_top1_linear_rope": dict(
        num_key_value_heads=4, num_experts=4, num_experts_per_tok=1,
        rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
    ),
    "moe_yarn_rope": dict(
        num_experts_per_tok=3, norm_topk_prob=True,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 5000.0, "original_max_position_embeddings": 64},
    ),
    "dense_qwen3_gqa2_tied_vocab263": dict(dense=True, tie_word_embeddings=True, vocab_size=263),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    out = {}
    for name, kw in CASES.items():
        kw = dict(kw)
        dense = kw.pop("dense", False)
        model = make_hf_model(seed=len(out), dense=dense, **kw)
        path = str(tmp_path_factory.mktemp(name))
        model.save_pretrained(path)
        out[name] = (model, path)
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(checkpoints, case):
    hf, path = checkpoints[case]
    vocab = hf.config.vocab_size
    ids = random_ids(vocab, (2, 13), seed=1)
    ref = hf_logits(hf, ids)
    policy = M.from_pretrained(path, dtype="float32")
    ours = np.asarray(policy.logits(ids))
    assert ours.shape == ref.shape == (2, 13, vocab)
    err = np.abs(ours - ref).max()
    print(f"{case}: max |dlogit| = {err:.3g}")
    assert err <= TOL, f"{case}: max |Δlogit| = {err:.3g}"


def test_routing_and_aux_loss_match_transformers(checkpoints):
    hf, path = checkpoints["moe_norm_topk_mlp_only_gqa2_vocab301"]
    cfg = hf.config
    ids = random_ids(cfg.vocab_size, (2, 9), seed=2)
    with torch.no_grad():
        out = hf(torch.as_tensor(ids), output_router_logits=True)
    policy = M.from_pretrained(path, dtype="float32")
    ours = policy.forward(ids)
    moe_layers = policy.config.moe_layers
    assert moe_layers == (0,)
    for layer, router_logits in zip(moe_layers, out.router_logits):
        probs = torch.softmax(router_logits.float(), dim=-1)
        ref_top = torch.topk(probs, cfg.num_experts_per_tok, dim=-1).indices.numpy().reshape(2, 9, -1)
        np.testing.assert_array_equal(np.asarray(ours.routed_experts[:, :, layer]), ref_top)
    assert (np.asarray(ours.routed_experts[:, :, 1]) == -1).all(), "dense layer reports -1"
    np.testing.assert_allclose(float(ours.aux_loss), float(out.aux_loss), rtol=1e-5)


def test_gradients_match_torch(checkpoints):
    """The custom attention backward and the expert dispatch give the same gradients as torch autograd."""
    hf, path = checkpoints["moe_norm_topk_mlp_only_gqa2_vocab301"]
    ids = random_ids(hf.config.vocab_size, (2, 7), seed=3)
    targets = np.roll(ids, -1, axis=1)
    hf.zero_grad()
    logits = hf(torch.as_tensor(ids)).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), torch.as_tensor(targets).reshape(-1))
    loss.backward()
    policy = M.from_pretrained(path, dtype="float32")

    def loss_fn(model):
        lp = M.token_logprobs(model(jnp.asarray(ids)).logits, jnp.asarray(targets))
        return -jnp.mean(lp)

    value, grads = nnx.jit(nnx.value_and_grad(loss_fn))(policy.model)
    np.testing.assert_allclose(float(value), float(loss), rtol=1e-5)
    named = dict(hf.named_parameters())
    checks = {
        "layers.0.attn.q_proj.weight": "model.layers.0.self_attn.q_proj.weight",
        "layers.1.attn.k_proj.weight": "model.layers.1.self_attn.k_proj.weight",
        "layers.0.attn.q_norm.scale": "model.layers.0.self_attn.q_norm.weight",
        "layers.0.moe.router.weight": "model.layers.0.mlp.gate.weight",
        "layers.1.mlp.down_proj.weight": "model.layers.1.mlp.down_proj.weight",
        "embed.embedding": "model.embed_tokens.weight",
    }
    flat = {".".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(grads)}
    for ours_name, hf_name in checks.items():
        ref = named[hf_name].grad.numpy()
        got = np.asarray(flat[ours_name])
        scale = np.abs(ref).max() + 1e-12
        assert np.abs(got - ref).max() <= 1e-4 * scale, f"grad of {ours_name}: rel err {np.abs(got - ref).max() / scale:.3g}"
    # Experts: HF fuses gate/up as [E, 2I, H]; ours stacks gate and up separately.
    gate_up = named["model.layers.0.mlp.experts.gate_up_proj"].grad.numpy()
    inter = hf.config.moe_intermediate_size
    ours_gate = np.asarray(flat["layers.0.moe.gate_proj.weight"])
    scale = np.abs(gate_up).max()
    assert np.abs(ours_gate - gate_up[:, :inter]).max() <= 1e-4 * scale


def test_round_trip_save_pretrained_transformers_loads(checkpoints, tmp_path):
    """HF -> ours -> save_pretrained (several shards) -> transformers loads -> same weights and logits."""
    from transformers import AutoModelForCausalLM

    hf, path = checkpoints["moe_no_norm_sparse_step2_tied_gqa4_vocab257"]
    policy = M.from_pretrained(path, dtype="float32")
    out = str(tmp_path / "saved")
    policy.save_pretrained(out, max_shard_size="40KB")
    with open(os.path.join(out, "model.safetensors.index.json")) as f:
        index = json.load(f)
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1
    data_bytes = sum(os.path.getsize(os.path.join(out, s)) for s in shards)
    assert 0 < index["metadata"]["total_size"] < data_bytes  # tensor bytes only (headers excluded)
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(reloaded).__name__ == "Qwen3MoeForCausalLM"
    orig = hf.state_dict()
    for name, tensor in reloaded.state_dict().items():
        torch.testing.assert_close(tensor, orig[name], rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
    ids = random_ids(hf.config.vocab_size, (1, 11), seed=4)
    np.testing.assert_array_equal(hf_logits(reloaded, ids), hf_logits(hf, ids))
    again = M.from_pretrained(out, dtype="float32")
    np.testing.assert_array_equal(np.asarray(again.logits(ids)), np.asarray(policy.logits(ids)))


def test_bf16_checkpoint_loads_and_tracks_fp32(checkpoints, tmp_path):
    hf, path = checkpoints["dense_qwen3_gqa2_tied_vocab263"]
    bf16_dir = str(tmp_path / "bf16")
    hf.to(torch.bfloat16).save_pretrained(bf16_dir)
    hf.to(torch.float32)
    policy = M.from_pretrained(bf16_dir, dtype="bfloat16")
    assert policy.model.embed.embedding.get_value().dtype == jnp.bfloat16
    ids = random_ids(hf.config.vocab_size, (2, 8), seed=5)
    ours = np.asarray(policy.logits(ids))
    ref = hf_logits(hf, ids)
    rel = np.linalg.norm(ours - ref) / np.linalg.norm(ref)
    assert rel < 0.03, f"bf16 relative logit error {rel:.3g}"
