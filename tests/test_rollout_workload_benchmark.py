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
    p = subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--step-prompt-lens", "24", "--out", str(out)], env=env,
                       capture_output=True, text=True, timeout=400, cwd=ROOT)
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
    # a longer-cache step point per recipe, reported apart from the target's point (12-token prompts + 8 new tokens)
    assert sorted((s["recipe"], s["prompt_len"]) for s in r["decode_step"]) == [
        ("bf16", 12), ("bf16", 24), ("fp8_block", 12), ("fp8_block", 24)]
    assert set(r["comparison"]["roofline_fraction_at_longer_caches"]["32"]) == {"bf16", "fp8_block"}
    longer = {s["recipe"]: s for s in r["decode_step"] if s["prompt_len"] == 24}
    assert all(longer[k]["bytes_per_step"]["kv_read_live"] > s["bytes_per_step"]["kv_read_live"]
               for s in r["decode_step"] if s["prompt_len"] == 12 for k in [s["recipe"]])
    assert "| recipe | scheduler |" in p.stdout
    assert all(len(x["passes"]) == 1 and x["steady_from"] == "first pass minus its compile events" for x in r["results"])
    # one recipe per run, appended into one JSON: the other recipe's points are kept, the comparisons span both;
    # two passes over the workload (the second on compiled programs, its bits checked against the first's)
    q = subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--recipes", "fp8_block", "--passes", "2", "--append",
                        "--out", str(out)],
                       env=env, capture_output=True, text=True, timeout=400, cwd=ROOT)
    assert q.returncode == 0, f"{q.stdout[-4000:]}\n{q.stderr[-6000:]}"
    again = json.loads(out.read_text())
    assert [x["recipe"] for x in again["results"]] == ["bf16", "bf16", "fp8_block", "fp8_block"]
    assert again["results"][:2] == r["results"][:2] and again["results"][2:] != r["results"][2:]
    assert again["comparison"]["bitwise_equal"] == {"bf16": True, "fp8_block": True}
    # (bf16's two step points kept; fp8_block's replaced by this run's one, without --step-prompt-lens)
    assert "fp8_over_bf16" in again["comparison"] and len(again["decode_step"]) == 3
    for x in again["results"][2:]:
        assert len(x["passes"]) == 2 and x["steady_from"] == "last pass"
        first, last = x["passes"]
        # the second pass compiles nothing new and is the steady figure
        assert last["compile_s"] < first["compile_s"] and x["steady_tokens_per_s"] * (last["wall_s"] - last["compile_s"]) > 0

    # the non-bitwise engine (--mode fast: XLA dots) in its own process, merged beside the bitwise run
    fast = tmp_path / "fast.json"
    p = subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--mode", "fast", "--recipes", "bf16", "--schedulers",
                        "continuous", "--out", str(fast)], env=env, capture_output=True, text=True, timeout=400, cwd=ROOT)
    assert p.returncode == 0, f"{p.stdout[-4000:]}\n{p.stderr[-6000:]}"
    f = json.loads(fast.read_text())
    assert f["mode"] == "fast" and f["model"]["attention_impl"] == r["model"]["attention_impl"]
    assert [(x["recipe"], x["mode"], x["scheduler"]) for x in f["results"]] == [("bf16", "fast", "continuous")]
    merged = tmp_path / "merged.json"
    p = subprocess.run([sys.executable, str(SCRIPT), "--merge", f"{out},{fast}", "--out", str(merged)], env=env,
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-4000:]
    m = json.loads(merged.read_text())
    assert len(m["results"]) == 5 and len(m["decode_step"]) == 4
    assert m["mode"] == "bitwise" and m["model"]["attention_impl"] == r["model"]["attention_impl"]
    cost = m["comparison"]["fast_over_bitwise"]["bf16"]
    assert cost["steady"] > 0 and cost["bitwise_cost_steady"] == pytest.approx(1 - 1 / cost["steady"])
    assert m["comparison"]["bitwise_equal"] == r["comparison"]["bitwise_equal"]
    assert set(m["comparison"]["roofline_fraction_at_slots"]) == {"bf16", "fp8_block"}  # bitwise steps only
    assert len(m["merged_from"]) == 2

    # the FP8 KV cache (fp8_block_kv) appended: its own ratio to bf16, and a step that reads about half the K/V bytes
    p = subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--recipes", "fp8_block_kv", "--schedulers", "continuous",
                        "--append", "--out", str(out)], env=env, capture_output=True, text=True, timeout=400, cwd=ROOT)
    assert p.returncode == 0, f"{p.stdout[-4000:]}\n{p.stderr[-6000:]}"
    kv = json.loads(out.read_text())
    assert isinstance(kv["comparison"]["fp8_kv_over_bf16"]["met"], bool) and "fp8_over_bf16" in kv["comparison"]
    step = {s["recipe"]: s for s in kv["decode_step"] if s["prompt_len"] == 12}
    ratio = step["fp8_block_kv"]["bytes_per_step"]["kv_read_live"] / step["fp8_block"]["bytes_per_step"]["kv_read_live"]
    head_dim = kv["model"]["head_dim"]
    assert ratio == pytest.approx((head_dim + 4) / (2 * head_dim))


def test_merge_refuses_another_workload(tmp_path):
    sys.path.insert(0, str(SCRIPT.parent))
    import rollout_workload

    base = dict(command="x", date="d", bandwidth={}, workload={"rows": 1}, engine={}, model={"layers": 1},
                results=[], decode_step=[], complete=True)
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(base))
    b.write_text(json.dumps(dict(base, workload={"rows": 2})))
    with pytest.raises(SystemExit, match="another workload"):
        rollout_workload.merge([str(a), str(b)], str(tmp_path / "m.json"))
    b.write_text(json.dumps(dict(base, model={"layers": 2})))
    with pytest.raises(SystemExit, match="another model"):
        rollout_workload.merge([str(a), str(b)], str(tmp_path / "m.json"))
    assert not (tmp_path / "m.json").exists()


def test_mean_decode_cache_weights_caches_by_decoded_tokens():
    """Token j >= 1 of a response is decoded over prompt + j cached tokens; token 0 comes from the prefill."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import rollout_workload
    finally:
        sys.path.remove(str(SCRIPT.parent))
    # lengths 1 (no decode step) and 3 (steps over 11 and 12 cached tokens)
    assert rollout_workload.mean_decode_cache([1, 3], 10) == pytest.approx(11.5)
    assert rollout_workload.mean_decode_cache([2, 2, 5], 0) == pytest.approx((1 + 1 + 1 + 2 + 3 + 4) / 6)
