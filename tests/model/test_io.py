"""Safetensors I/O, sharded save, and clear errors for bad checkpoints (nothing half-loaded, atomic writes)."""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jaxrl_fp8.model as M
from jaxrl_fp8.model import hf_io

CFG = M.tiny_config(num_hidden_layers=2)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("ckpt") / "tiny")
    M.random_policy(CFG, seed=0, dtype="float32").save_pretrained(path, max_shard_size="100KB")
    return path


def _rewrite(src, dst, edit):
    """Copy a checkpoint, letting edit(dict name -> array) change its tensors (or edit config)."""
    tensors = dict(hf_io.iter_tensors(src))
    config = hf_io.read_config(src)
    edit(tensors, config)
    hf_io.save_sharded(dst, {k: (v.shape, v.dtype, lambda v=v: v) for k, v in tensors.items()}, config=config)
    return dst


def test_safetensors_round_trip_all_dtypes(tmp_path):
    arrays = {
        "f32": np.arange(6, dtype=np.float32).reshape(2, 3),
        "bf16": np.arange(4, dtype=np.float32).astype(ml_dtypes.bfloat16),
        "e4m3": np.array([0.5, -448.0, 3.0], np.float32).astype(ml_dtypes.float8_e4m3fn),
        "u8": np.array([1, 255], np.uint8),
    }
    file = str(tmp_path / "x.safetensors")
    hf_io.write_safetensors(file, arrays, {"format": "pt"})
    f = hf_io.SafetensorsFile(file)
    assert f.metadata == {"format": "pt"} and f.info("e4m3") == ("F8_E4M3", (3,))
    for name, a in arrays.items():
        got = f.read(name)
        assert got.dtype == a.dtype and got.shape == a.shape
        np.testing.assert_array_equal(got.astype(np.float32), a.astype(np.float32))
    # The reference library reads our files.
    from safetensors import safe_open

    with safe_open(file, framework="numpy") as g:
        np.testing.assert_array_equal(g.get_tensor("f32"), arrays["f32"])


def test_sharded_save_index_and_reload_bitwise(ckpt):
    with open(os.path.join(ckpt, hf_io.INDEX_NAME)) as f:
        index = json.load(f)
    files = set(index["weight_map"].values())
    assert len(files) > 1
    total = sum(a.nbytes for _, a in hf_io.iter_tensors(ckpt))
    assert index["metadata"]["total_size"] == total
    a = M.from_pretrained(ckpt, dtype="float32")
    b = M.random_policy(CFG, seed=0, dtype="float32")
    ids = np.arange(10).reshape(2, 5)
    np.testing.assert_array_equal(np.asarray(a.logits(ids)), np.asarray(b.logits(ids)))


@pytest.mark.parametrize(
    "case, edit, match",
    [
        ("missing", lambda t, c: t.pop("model.layers.1.mlp.up_proj.weight"), r"missing tensor 'model\.layers\.1\.mlp\.up_proj\.weight'"),
        ("shape", lambda t, c: t.__setitem__("model.norm.weight", np.ones(63, np.float32)), r"'model\.norm\.weight' has shape \[63\]"),
        ("dtype", lambda t, c: t.__setitem__("model.norm.weight", np.ones(64, np.int32)), r"'model\.norm\.weight' has dtype I32"),
        ("unknown", lambda t, c: t.__setitem__("model.layers.0.mlp.shared_expert.weight", np.ones(3, np.float32)), r"shared_expert.*unexpected tensor"),
        ("fp8_without_config", lambda t, c: t.__setitem__("model.layers.1.mlp.up_proj.weight", t["model.layers.1.mlp.up_proj.weight"].astype(ml_dtypes.float8_e4m3fn)), r"up_proj\.weight' is F8_E4M3 but config\.json has no quantization_config"),
        ("arch", lambda t, c: c.update(architectures=["LlamaForCausalLM"]), r"'architectures'"),
        ("expert_count", lambda t, c: c.update(num_experts=4), r"experts\.4\.|not a parameter"),
    ],
)
def test_bad_checkpoints_fail_naming_the_problem(ckpt, tmp_path, case, edit, match):
    bad = _rewrite(ckpt, str(tmp_path / case), edit)
    with pytest.raises((M.CheckpointError, M.ConfigError), match=match):
        M.from_pretrained(bad, dtype="float32")


def test_missing_shard_and_corrupt_header(ckpt, tmp_path):
    import shutil

    bad = str(tmp_path / "noshard")
    shutil.copytree(ckpt, bad)
    victim = sorted(f for f in os.listdir(bad) if f.endswith(".safetensors"))[0]
    os.remove(os.path.join(bad, victim))
    with pytest.raises(M.CheckpointError, match=victim):
        M.from_pretrained(bad)
    with open(os.path.join(bad, victim), "wb") as f:
        f.write((10**6).to_bytes(8, "little") + b"{}")
    with pytest.raises(M.CheckpointError, match="header length"):
        M.from_pretrained(bad)
    with pytest.raises(M.CheckpointError, match="config.json"):
        M.from_pretrained(str(tmp_path))


def test_failed_save_leaves_previous_checkpoint_intact(ckpt, tmp_path):
    dst = _rewrite(ckpt, str(tmp_path / "dst"), lambda t, c: None)
    before = sorted(os.listdir(dst))

    def boom():
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        hf_io.save_sharded(dst, {"a": ((2,), np.float32, boom)}, config={})
    assert sorted(os.listdir(dst)) == before
    assert not [p for p in os.listdir(tmp_path) if ".tmp-" in p]
    M.from_pretrained(dst, dtype="float32")  # still loads


def test_tied_checkpoint_with_redundant_lm_head_loads(tmp_path):
    cfg = M.tiny_config(num_hidden_layers=1, tie_word_embeddings=True, mlp_only_layers=())
    path = str(tmp_path / "tied")
    M.random_policy(cfg, dtype="float32").save_pretrained(path)
    withhead = _rewrite(path, str(tmp_path / "tied2"), lambda t, c: t.__setitem__("lm_head.weight", t["model.embed_tokens.weight"]))
    p = M.from_pretrained(withhead, dtype="float32")
    assert not hasattr(p.model, "lm_head")
    assert p.model.embed.embedding.get_value().dtype == jnp.float32
