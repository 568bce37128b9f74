"""experiments/benchmarks/rollout_workload.py (issue 22's RL rollout workload) on CPU: `--tiny` runs both recipes with the
continuous and the static scheduler in a subprocess and writes the JSON: same samples bit for bit from both
schedulers, every target entry present (met or missed), the decode-step roofline measured."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "experiments" / "benchmarks" / "rollout_workload.py"


@pytest.mark.slow
def test_tiny_workload_runs_and_reports_targets(tmp_path):
    out = tmp_path / "rw.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)]))
    env.pop("XLA_FLAGS", None)
    p = subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--out", str(out)], env=env, capture_output=True,
                       text=True, timeout=400, cwd=ROOT)
    assert p.returncode == 0, f"{p.stdout[-4000:]}\n{p.stderr[-6000:]}"
    r = json.loads(out.read_text())
    assert r["complete"] and r["tiny"] and r["device"]["platform"] == "cpu" and r["versions"]["jax"]
    assert r["workload"]["rows"] == 12 and r["model"]["num_experts"] == 8
    steps = r["workload"]["decode_steps_from_lengths"]
    assert steps["static_request_order"] >= steps["static_sorted"] >= steps["continuous"] >= steps["all_slots_busy"]
    assert {(x["recipe"], x["scheduler"]) for x in r["results"]} == {
        (a, b) for a in ("bf16", "fp8_block") for b in ("continuous", "static")}
    for x in r["results"]:
        assert x["wall_s"] > 0 and x["tokens_per_s"] > 0 and x["compile_s"] >= 0
    assert r["comparison"]["bitwise_equal"] == {"bf16": True, "fp8_block": True}
    for name in ("continuous_over_static", "roofline_fraction_at_slots"):
        assert set(r["comparison"][name]) == {"bf16", "fp8_block"}
        assert all(isinstance(v["met"], bool) for v in r["comparison"][name].values())
    assert isinstance(r["comparison"]["fp8_over_bf16"]["met"], bool)
    assert all(s["bytes_per_step"]["weights_read"] > 0 and s["roofline_step_ms_at_copy_bw"] > 0 for s in r["decode_step"])
    assert "| recipe | scheduler |" in p.stdout
    # one recipe per run, appended into one JSON: the other recipe's points are kept, the comparisons span both
    q = subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--recipes", "fp8_block", "--append", "--out", str(out)],
                       env=env, capture_output=True, text=True, timeout=400, cwd=ROOT)
    assert q.returncode == 0, f"{q.stdout[-4000:]}\n{q.stderr[-6000:]}"
    again = json.loads(out.read_text())
    assert [x["recipe"] for x in again["results"]] == ["bf16", "bf16", "fp8_block", "fp8_block"]
    assert again["results"][:2] == r["results"][:2] and again["results"][2:] != r["results"][2:]
    assert again["comparison"]["bitwise_equal"] == {"bf16": True, "fp8_block": True}
    assert "fp8_over_bf16" in again["comparison"] and len(again["decode_step"]) == 2
