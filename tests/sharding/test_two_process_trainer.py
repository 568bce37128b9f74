"""`Trainer.train_step` on two localhost processes x 2 CPU devices (mesh data=2 x expert=2) equals one process x
4 devices (same mesh) applying the documented split to the same global batch; the final export is complete and
written once, by process 0. The scripts: two_process_trainer.py.

Why a tolerance and not bitwise for the gradients: the two runs are the same SPMD program on the same global
arrays, but the cross-process reductions run through gloo, whose all-reduce may add the four per-device partial
sums in another order than XLA:CPU's in-process all-reduce (values measured: docs/decisions/0009-sharding.md).
"""

import json
import os

import numpy as np
import pytest

from subprocess_util import free_port, run_processes, run_script

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    work = tmp_path_factory.mktemp("two_process_trainer")
    port = str(free_port())
    run_processes("two_process_trainer.py", [["multi", "0", port, str(work)], ["multi", "1", port, str(work)]], timeout=900)
    run_script("two_process_trainer.py", "single", str(work), timeout=900)
    logs = {p: json.loads((work / f"multi_{p}.json").read_text()) for p in (0, 1)}
    single = json.loads((work / "single.json").read_text())
    arrays = {ph: dict(np.load(work / f"{ph}.npz")) for ph in ("multi", "single")}
    return work, logs, single, arrays


def test_minibatches_are_normalised_by_the_global_token_count(runs):
    _, logs, single, _ = runs
    counts = single["minibatch_local_token_counts"]  # [update][process]: that process's tokens in minibatch m
    assert len(counts) == len(logs[0]["updates"]) == 4
    assert any(a != b for a, b in counts)  # a per-process count would give the processes other step sizes
    for (c0, c1), u0, u1 in zip(counts, logs[0]["updates"], logs[1]["updates"]):
        assert u0[2] == u1[2] == c0 + c1  # num_tokens of the update: both processes' tokens of minibatch m


def test_every_update_equals_one_process_with_the_global_batch(runs):
    _, logs, single, _ = runs
    for u0, u1, ref in zip(logs[0]["updates"], logs[1]["updates"], single["updates"]):
        assert u0 == u1  # one global loss / grad norm, replicated to both processes
        assert np.isfinite(ref[0]) and ref[0] != 0
        assert abs(u0[0] - ref[0]) <= 1e-6 * abs(ref[0]), (u0, ref)  # loss
        assert abs(u0[1] - ref[1]) <= 1e-6 * ref[1], (u0, ref)  # grad norm
        assert u0[2] == ref[2]  # token count
    for step in range(2):  # what train_step reports: the mean over its minibatches
        assert abs(logs[0]["steps"][step]["loss"] - single["steps"][step]["loss"]) <= 1e-6 * abs(single["steps"][step]["loss"])


def test_grads_and_params_equal_one_process(runs):
    _, _, _, arrays = runs
    a, b = arrays["multi"], arrays["single"]
    assert set(a) == set(b) and len([k for k in a if k.startswith("first/")]) == 26
    for k in a:
        rel = float(np.linalg.norm(a[k] - b[k])) / max(float(np.linalg.norm(b[k])), 1e-30)
        # first/: gradients of the first update (same params); grad/: of the last; param/: after 4 SGD updates
        assert rel <= (1e-7 if k.startswith("param/") else 1e-6), (k, rel)
        if k.startswith("first/"):
            assert np.linalg.norm(b[k]) > 0, k


def test_export_is_complete_and_written_by_process_zero_only(runs):
    work, logs, _, _ = runs
    assert logs[1]["export"]["renames"] == []  # process 1 gathered with everyone but wrote nothing
    renames = logs[0]["export"]["renames"]
    # each export directory renamed into place exactly once (files inside are written in the temp dir)
    assert renames.count(os.path.join("export", "hf_bf16")) == 1
    assert renames.count(os.path.join("export", "hf_fp8-block")) == 1
    maps = {}
    for sub in ("hf_bf16", "hf_fp8-block"):
        d = work / "export" / sub
        files = sorted(os.listdir(d))
        assert "config.json" in files and "model.safetensors.index.json" in files and "tokenizer.json" in files, files
        index = json.loads((d / "model.safetensors.index.json").read_text())
        shards = set(index["weight_map"].values())
        assert shards and all((d / s).is_file() for s in shards)
        maps[sub] = index["weight_map"]
    # the 2-layer test model: 3 global + 21 (MoE layer, 4 experts) + 11 (dense layer) tensors; FP8 adds one
    # weight_scale_inv per quantized projection (4 + 4 attention, 12 experts, 3 MLP)
    assert len(maps["hf_bf16"]) == 35 and len(maps["hf_fp8-block"]) == 35 + 23
    assert set(maps["hf_bf16"]) <= set(maps["hf_fp8-block"])
    cfg = json.loads((work / "export" / "hf_fp8-block" / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "fp8"
    # nothing half-written is left beside the directories
    assert [e for e in os.listdir(work / "export") if e.startswith(".")] == []
