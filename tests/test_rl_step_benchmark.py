"""experiments/benchmarks/rl_step.py (issue 23's RL step yardstick) on CPU: `--tiny` drives the real trainer loop for
2 steps of one recipe in a subprocess and writes the JSON + PNG; a point that fails is recorded with its error and the
run goes on; the fp8-vs-bf16 comparison (ratios, targets, the phase holding it back) on hand-made points."""

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxrl_fp8.ops.xla_gemm import cpu_dots_row_invariant

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "experiments" / "benchmarks" / "rl_step.py"


def _env():
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)]))
    env.pop("XLA_FLAGS", None)
    return env


def _run(tmp_path, *extra, name="r.json"):
    out = tmp_path / name
    p = subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--fast-compile", "--out", str(out),
                        "--runs-dir", str(tmp_path / "runs"), *extra],
                       env=_env(), capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert p.returncode == 0, f"{p.stdout[-4000:]}\n{p.stderr[-6000:]}"
    return json.loads(out.read_text()), out, p.stdout


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("rl_step_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_tiny_two_steps_of_fp8_block(tmp_path):
    res, out, stdout = _run(tmp_path, "--recipes", "fp8_block", "--steps", "2", "--micro-batch", "1", "--logit-chunk", "8")
    assert out.with_suffix(".png").stat().st_size > 1000
    assert res["benchmark"] == "rl_step" and res["tiny"] is True
    assert res["device"]["platform"] == "cpu" and set(res["versions"]) >= {"python", "jax", "jaxlib"}
    assert res["shapes"]["layers"] == {"16": 2} and res["shapes"]["params"]["16"]["total"] > 0
    assert res["shapes"]["model"]["num_experts"] == 16 and res["shapes"]["memory_estimate"]["16"]["update_peak_bytes"] > 0
    assert res["memory_note"]  # XLA:CPU: no allocator statistics
    (point,) = res["points"]
    assert point["recipe"] == "fp8_block" and point["response_tokens"] == 16 and point["status"] == "ok", point.get("error")
    cfg = point["config"]
    assert cfg["rollout"]["ignore_eos"] and cfg["rollout"]["routing_replay"] and cfg["rl"]["use_tis"]
    assert cfg["rollout"]["engine"] == "embedded" and cfg["model"]["num_experts"] == 16 and cfg["model"]["num_hidden_layers"] == 2
    assert cfg["model"]["embed_init_std"] == 1.0  # the random slice routes tokens apart (--embed-init-std)
    assert cfg["model"]["scaled_output_init"] is True  # ... in every layer (--scaled-output-init)
    # minibatches of 2 rows, each gradient accumulated over two 1-row micro-batches (one optimizer update per minibatch)
    assert point["sizes"] == {"layers": 2, "prompts": 2, "samples": 2, "batch": 2, "steps": 2, "rows": 4,
                              "micro_batch": 1, "logprob_chunk": 1}
    assert cfg["rl"]["micro_batch_rows"] == 1 and cfg["rl"]["num_minibatches"] == 2 and cfg["rl"]["logit_chunk_tokens"] == 8
    assert res["shapes"]["memory_estimate"]["16"]["logit_chunk_bytes"] > 0
    assert [r["step"] for r in point["rows"]] == [1, 2]
    for row in point["rows"]:
        assert row["response_length"] == 16.0 and row["truncated_frac"] == 1.0  # EOS suppressed: lengths as asked
        assert row["train_seconds"] == pytest.approx(row["logprob_seconds"] + row["update_seconds"])
        assert row["peak_bytes_in_use"] is None
    s = point["summary"]
    assert s["steps_measured"] == [2] and s["warmup_excluded"] == 1  # the compiling step is left out
    for key in ("rollout_seconds", "logprob_seconds", "update_seconds", "train_seconds", "sync_seconds", "step_seconds"):
        assert isinstance(s["median"][key], float) and s["median"][key] > 0, key
    assert s["response_tokens_per_step"] == 16 * 4
    assert s["tokens_per_second_end_to_end"] == pytest.approx(64 / s["median"]["step_seconds"])
    for ph in ("rollout", "train", "sync"):
        assert s["tokens_per_second_per_phase"][ph] > 0
    # unified FP8 with R3 on CPU: the trainer's recomputed log-probs equal the rollout's bit for bit where XLA:CPU's
    # dots are row invariant (conftest's row_invariant_cpu; on an Intel Xeon host where they are not: 7.5e-9)
    if cpu_dots_row_invariant():
        assert s["median"]["train_rollout_logprob_abs_diff"] == 0.0 and s["median"]["train_rollout_kl"] == 0.0
    assert s["median"]["train_rollout_logprob_abs_diff"] < 1e-6
    # distinct experts a decode step of the 4 rows (top-4 of 16) read, mean over steps and layers
    assert 4 <= s["median"]["rollout_experts_touched"] <= 16
    assert res["comparison"]["16"]["fp8_block_vs_bf16"] is None  # bf16 not run
    assert "fp8_block" in stdout and "step" in stdout


@pytest.mark.slow
def test_a_failing_point_is_recorded_and_the_run_goes_on(tmp_path):
    # a vocabulary smaller than the tokenizer's passes validate_config but is refused when the model is built
    res, out, _ = _run(tmp_path, "--recipes", "bf16,fp8_block", "--steps", "1", "--set", "model.vocab_size=8")
    assert [p["status"] for p in res["points"]] == ["error", "error"]
    for p in res["points"]:
        assert "vocab_size" in p["error"] and p["traceback"] and p["summary"] is None
    assert out.with_suffix(".png").exists()


def test_bad_flags_fail_before_any_point(tmp_path):
    p = subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--recipes", "fp8_block", "--batch", "3",
                        "--out", str(tmp_path / "r.json"), "--runs-dir", str(tmp_path / "runs")],
                       env=_env(), capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert p.returncode == 2 and "--batch 3 must divide" in p.stderr, p.stderr[-2000:]
    assert not (tmp_path / "r.json").exists()
    p = subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--recipes", "fp8_block", "--micro-batch", "3",
                        "--out", str(tmp_path / "r.json"), "--runs-dir", str(tmp_path / "runs")],
                       env=_env(), capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert p.returncode == 2 and "--micro-batch 3 must divide --batch 2" in p.stderr, p.stderr[-2000:]


def _point(recipe, rollout, logprob, update, sync, peak, rows=(1, 2, 3)):
    step = rollout + logprob + update + sync
    mk = lambda i: dict(step=i, rollout_seconds=rollout * (5 if i == 1 else 1), logprob_seconds=logprob,  # noqa: E731
                        update_seconds=update, train_seconds=logprob + update, sync_seconds=sync,
                        step_seconds=step + (4 * rollout if i == 1 else 0), tokens_per_second=1.0, response_length=100.0,
                        train_rollout_logprob_abs_diff=0.0, train_rollout_kl=0.0, peak_bytes_in_use=peak)
    return dict(recipe=recipe, response_tokens=100, status="ok", sizes=dict(rows=10), rows=[mk(i) for i in rows])


def test_comparison_ratios_targets_and_the_phase_holding_back(bench):
    points = [_point("bf16", 6.0, 1.0, 3.0, 0.5, 100e9), _point("fp8_block", 5.0, 0.5, 1.5, 0.25, 90e9),
              dict(recipe="bf16_train_fp8_rollout", response_tokens=100, status="error", error="OOM", rows=[])]
    res = bench.assemble({"benchmark": "rl_step"}, points, warmup=1)
    b, f = res["points"][0]["summary"], res["points"][1]["summary"]
    assert b["median"]["rollout_seconds"] == 6.0 and b["steps_measured"] == [2, 3]  # warm-up step 1 left out
    assert b["tokens_per_second_end_to_end"] == pytest.approx(1000 / 10.5)
    c = res["comparison"]["100"]["fp8_block_vs_bf16"]
    assert c["tokens_per_second_end_to_end"] == pytest.approx(10.5 / 7.25)
    assert c["train_phase_tokens_per_second"] == pytest.approx(4.0 / 2.0)
    assert c["peak_memory"] == pytest.approx(0.9)
    assert c["targets"] == {"tokens_per_second_end_to_end >= 1.3x": "met", "train_phase >= 1.4x": "met", "peak_memory lower": "met"}
    # rollout: 1.2x speed-up on the largest share of the step: 5 - 6 / 1.3 = 0.38 s over its part, the largest
    assert c["phases"]["rollout"]["shortfall_seconds"] == pytest.approx(5.0 - 6.0 / 1.3)
    assert c["holds_back"] == "rollout"
    assert res["comparison"]["100"]["bf16_train_fp8_rollout_vs_bf16"] is None  # its point failed
    slow = [_point("bf16", 6.0, 1.0, 3.0, 0.5, 100e9), _point("fp8_block", 3.0, 1.0, 3.5, 0.5, 120e9)]
    c = bench.assemble({}, slow, warmup=1)["comparison"]["100"]["fp8_block_vs_bf16"]
    assert c["holds_back"] == "update" and c["targets"]["train_phase >= 1.4x"] == "missed"
    assert c["targets"]["peak_memory lower"] == "missed"
    assert all(math.isfinite(v["speedup"]) for v in c["phases"].values() if v["speedup"] is not None)
    text = bench.table(res)
    assert "held back by: update" not in text and "held back by: rollout" in text and "OOM" in text


def test_merge_keeps_the_later_point(bench, tmp_path):
    a = bench.assemble({"benchmark": "rl_step", "command": "a"}, [_point("bf16", 6.0, 1.0, 3.0, 0.5, 1.0)], 1)
    bb = bench.assemble({"benchmark": "rl_step", "command": "b"}, [_point("bf16", 2.0, 1.0, 3.0, 0.5, 1.0),
                                                                  _point("fp8_block", 1.0, 1.0, 1.0, 0.5, 1.0)], 1)
    (tmp_path / "a.json").write_text(json.dumps(a))
    (tmp_path / "b.json").write_text(json.dumps(bb))
    assert bench.main(["--merge", f"{tmp_path / 'a.json'},{tmp_path / 'b.json'}", "--out", str(tmp_path / "m.json")]) == 0
    m = json.loads((tmp_path / "m.json").read_text())
    assert [(p["recipe"], p["summary"]["median"]["rollout_seconds"]) for p in m["points"]] == [("bf16", 2.0), ("fp8_block", 1.0)]
    assert m["comparison"]["100"]["fp8_block_vs_bf16"]["tokens_per_second_end_to_end"] == pytest.approx(6.5 / 3.5)
    assert (tmp_path / "m.png").stat().st_size > 1000


@pytest.mark.slow
def test_programs_lower_for_the_gpu_on_cpu(tmp_path):
    """`--memory-analysis --lower-platform cuda`: the step's programs (rollout, old log-probs, update, weight push)
    lower for CUDA on this CPU machine with the ops choosing their Hopper kernels (how the full-size shapes were
    checked without a GPU: results/rl_step_memory_analysis_cpu.json, section lowered_for_cuda)."""
    out = tmp_path / "lower.json"
    # head_dim 64: the flash kernels take the model, so the attention lowers to them too (not to the interpreter);
    # 32 + 96 tokens a row: whole 128-slot pages of the paged cache
    p = subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--recipes", "fp8_block", "--memory-analysis",
                        "--lower-platform", "cuda", "--set", "model.head_dim=64", "--response-lengths", "96", "--out", str(out),
                        "--runs-dir", str(tmp_path / "runs")],
                       env=_env(), capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-4000:]
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "rl_step_memory_analysis" and doc["host_backend"] == "cpu" and list(doc["sections"]) == ["lowered_for_cuda"]
    (entry,) = doc["sections"]["lowered_for_cuda"]["results"]
    for name in ("rollout", "logprob", "update", "sync"):
        assert entry[name].get("lowered_for") == "cuda", (name, entry[name])
    assert entry["update"]["mosaic_gpu_mentions"] > 0  # the FP8 GEMM kernels, not the XLA fallback
    assert entry["update"]["flash_attention_mentions"] > 0 and entry["rollout"]["flash_attention_mentions"] > 0


def test_memory_analysis_sections_are_kept_per_mode(bench):
    """--memory-analysis writes one section per mode into one file per host backend: a run replaces its own section
    and keeps the others of the same size; sections of another size or another host backend are dropped."""
    full = lambda tag: dict(what=tag, tiny=False, results=[tag])  # noqa: E731
    a = bench.memory_analysis_doc(None, "compiled_for_cpu", full("a"), "cpu")
    assert a["benchmark"] == "rl_step_memory_analysis" and a["host_backend"] == "cpu" and list(a["sections"]) == ["compiled_for_cpu"]
    b = bench.memory_analysis_doc(a, "lowered_for_cuda", full("b"), "cpu")
    assert b["sections"] == {"compiled_for_cpu": full("a"), "lowered_for_cuda": full("b")}
    c = bench.memory_analysis_doc(b, "compiled_for_cpu", full("c"), "cpu")
    assert c["sections"] == {"compiled_for_cpu": full("c"), "lowered_for_cuda": full("b")}
    tiny = dict(what="t", tiny=True, results=[])
    assert list(bench.memory_analysis_doc(c, "lowered_for_cuda", tiny, "cpu")["sections"]) == ["lowered_for_cuda"]
    assert list(bench.memory_analysis_doc(c, "compiled_for_gpu", full("g"), "gpu")["sections"]) == ["compiled_for_gpu"]


def test_committed_memory_analysis_result_has_both_sections():
    doc = json.loads((ROOT / "experiments" / "benchmarks" / "results" / "rl_step_memory_analysis_cpu.json").read_text())
    assert doc["benchmark"] == "rl_step_memory_analysis" and doc["host_backend"] == "cpu"
    assert set(doc["sections"]) == {"compiled_for_cpu", "lowered_for_cuda"}
    for name, section in doc["sections"].items():
        assert section["tiny"] is False and section["results"], name
        for entry in section["results"]:
            for program in ("rollout", "logprob", "update", "sync"):
                assert "error" not in entry[program], (name, entry["recipe"], entry["response_tokens"], program)
