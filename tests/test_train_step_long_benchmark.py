"""experiments/benchmarks/train_step_long.py runs on CPU (tiny model): every point compiles, is analysed and timed
or recorded as compiled only; the JSON says which attention ran."""

import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "experiments", "benchmarks"))


def test_tiny_run_writes_points(tmp_path):
    import train_step_long

    out = tmp_path / "r.json"
    train_step_long.main(["--tiny", "--points", "exact:64,xla:64,auto:32", "--no-run", "auto:32", "--iters", "1",
                          "--out", str(out)])
    res = json.loads(out.read_text())
    pts = {(p["impl"], p["T"]): p for p in res["points"]}
    assert pts[("exact", 64)]["step_s"] > 0 and pts[("exact", 64)]["runs"] == "exact"
    assert pts[("xla", 64)]["step_s"] > 0 and all(p["memory_gb"] > 0 for p in res["points"])
    assert pts[("auto", 32)]["timed"] is False and pts[("auto", 32)]["runs"] == "exact"  # CPU: auto is the exact scan
    assert all("error" not in p for p in res["points"])
