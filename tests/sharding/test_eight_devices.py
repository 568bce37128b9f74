"""8 virtual CPU devices (one subprocess, eight_devices.py): one unified-FP8 train step on five meshes.

Tolerances (measured values in docs/decisions/0009-sharding.md):
- The forward is row-invariant, so meshes that only split rows, experts or gather FSDP shards (data 8, fsdp 8,
  expert 4 x data 2) compute every token bit for bit like one device; the loss and gradients then differ only
  through the order of the cross-device sums: loss within 1e-6 relative, every gradient tensor within 1e-4
  norm-relative (fp32 reassociation).
- tensor 2 x fsdp 4 splits the K dimension of o_proj / down_proj: the partial sums are added in another order,
  and a 1-ulp change of an activation can move its FP8 rounding, so that mesh is held to 1e-2 (FP8 level).
"""

import json
import os

import numpy as np
import pytest

from subprocess_util import run_script

pytestmark = pytest.mark.slow
NON_TENSOR = ("data8", "fsdp8", "expert4_data2")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("eight_devices")
    run_script("eight_devices.py", str(out), timeout=1200)
    with open(out / "results.json") as f:
        res = json.load(f)
    res["arrays"] = {name: dict(np.load(out / f"mesh_{name}.npz")) for name in res["meshes"]}
    return res


def _norm_rel(a, b):
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(a), 1e-30))


def test_meshes_have_the_requested_shapes(results):
    sizes = {k: v["sizes"] for k, v in results["meshes"].items()}
    assert sizes["1"] == dict(data=1, fsdp=1, expert=1, tensor=1)
    assert sizes["data8"]["data"] == 8 and sizes["fsdp8"]["fsdp"] == 8
    assert (sizes["expert4_data2"]["expert"], sizes["expert4_data2"]["data"]) == (4, 2)
    assert (sizes["tensor2_fsdp4"]["tensor"], sizes["tensor2_fsdp4"]["fsdp"]) == (2, 4)


def test_loss_equal_across_meshes(results):
    base = results["meshes"]["1"]["loss"]
    assert np.isfinite(base) and base != 0
    for name, m in results["meshes"].items():
        assert m["finite"] == 1.0
        tol = 1e-6 if name in NON_TENSOR or name == "1" else 1e-4
        assert abs(m["loss"] - base) <= tol * abs(base), (name, m["loss"], base)


@pytest.mark.parametrize("name", ["data8", "fsdp8", "expert4_data2", "tensor2_fsdp4"])
def test_gradients_equal_across_meshes(results, name):
    base, other = results["arrays"]["1"], results["arrays"][name]
    grads = [k for k in base if k.startswith("grad/")]
    assert len(grads) == 26 and set(base) == set(other)
    tol = 1e-4 if name in NON_TENSOR else 1e-2
    worst = max((_norm_rel(base[k], other[k]), k) for k in grads)
    assert worst[0] <= tol, (name, worst)
    # the gradients are not trivially zero, and the step applied them
    assert all(np.linalg.norm(base[k]) > 0 for k in grads)


def test_per_device_memory_shrinks_as_the_specs_say(results):
    m = results["meshes"]
    for name, r in m.items():
        # every device holds exactly the bytes its storage specs imply (arrays' addressable shards)
        assert r["param_bytes_per_device"] == [r["expected_param_bytes"]], name
        assert r["opt_bytes_per_device"] == [r["expected_opt_bytes"]], name
    full = m["1"]["param_bytes_per_device"][0]
    assert m["data8"]["param_bytes_per_device"][0] == full  # pure data parallel replicates
    assert m["fsdp8"]["param_bytes_per_device"][0] <= full / 8 * 1.01  # all but head_dim norms split 8 ways
    assert m["expert4_data2"]["param_bytes_per_device"][0] <= full / 4 * 1.01
    assert m["tensor2_fsdp4"]["param_bytes_per_device"][0] <= full / 7
    # compiled memory statistics: the step's argument buffers (params + optimizer state + batch) per device
    args = {k: v["compiled_argument_bytes"] for k, v in m.items()}
    assert args["fsdp8"] < args["1"] / 7 and args["expert4_data2"] < args["1"] / 3.5 and args["tensor2_fsdp4"] < args["1"] / 6
    for name, r in m.items():
        state = r["expected_param_bytes"] + r["expected_opt_bytes"]
        assert state <= r["compiled_argument_bytes"] <= state + 16 * 8 * 8 * 20, name  # + the minibatch


def test_expert_parallel_uses_all_to_all_and_keeps_experts_split(results):
    ep = results["meshes"]["expert4_data2"]
    assert ep["all_to_all"] >= 4  # tokens out and back, forward and backward
    assert ep["expert_weight_shard"][0] == 2  # 8 experts / expert=4
    assert ep["expert_allgathers"] == []  # no device ever materializes the whole expert stack
    assert results["meshes"]["data8"]["all_to_all"] == 0


def test_block_validation_names_tensor_and_axis(results):
    v = results["validation"]
    assert v["tiny_expert4"]["ok"] and v["qwen3_30b_expert8"]["ok"]
    msg = v["qwen3_30b_tensor8"]["message"]
    assert ("layers.0.moe.up_proj.weight dim N=768 over tensor=8 gives 96 rows per device, not a multiple of the "
            "128-row FP8 block") in msg
    assert "layers.0.moe.down_proj.weight dim K=768 over tensor=8 gives 96 columns per device" in msg
    assert "layers.0.attn.k_proj.weight dim N=512 over tensor=8 gives 64 rows" in msg
    assert "layers.0.attn.q_proj" not in msg  # 4096 / 8 = 512 rows: whole blocks
    assert "layers.0.attn.o_proj.weight dim K=64 over tensor=2 gives 32 columns per device" in v["tiny_tensor2"]["message"]


def test_stored_quantized_weight_shards_with_its_scales(results):
    q = results["validation"]["quantized_storage"]
    # [8, 256, 256] fp8-block over expert=4: 2 experts per device, each with its [2, 2] block scales
    assert q["expert4_data2"] == dict(ok=True, data_shard=[2, 256, 256], scale_shard=[2, 2, 2], scales_match=True)
    # fsdp=4 would leave 64 of the 128 columns of a block on a device (and split its scale): refused by name
    assert not q["tensor2_fsdp4"]["ok"]
    assert q["tensor2_fsdp4"]["message"].startswith("layers.0.moe.up_proj.weight dim K=256 over fsdp=4 gives 64 columns")


def test_kv_cache_rows_over_batch_axes_heads_over_tensor(results):
    # tiny model: 2 KV heads split over tensor=2; 8 rows over fsdp=4
    assert results["validation"]["kv_cache_specs"] == dict(k=["fsdp", None, "tensor", None], lengths=["fsdp"])


def test_sharded_export_is_the_single_device_export_with_bounded_host_memory(results):
    e = results["export"]
    assert e["bitwise_equal"] and e["tensors"] == e["reference_tensors"] > 50
    assert e["buckets"] > 3
    # host memory: the bucket being built + about two gathered tensors, far below the model
    assert e["peak_host_bytes"] <= e["bucket_bytes"] + 3 * e["largest_tensor_f32_bytes"], e
    assert e["peak_host_bytes"] < e["master_bytes"] / 4, e
