"""experiments/benchmarks/optimizer_step.py on CPU: both forms of the non-finite skip timed, giving the same bits."""

import importlib.util
import json
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "optimizer_step", Path(__file__).parents[1] / "experiments/benchmarks/optimizer_step.py")
optimizer_step = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(optimizer_step)


def test_both_forms_timed_and_bitwise_equal(tmp_path):
    out = tmp_path / "optimizer_step.json"
    result = optimizer_step.main(["--params", "30000", "--leaves", "3", "--reps", "3", "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["params"] == 30000 and saved["device"]["platform"] == "cpu"
    assert set(saved["forms"]) == {"where", "cond"}
    assert all(r["median_ms"] > 0 for r in saved["forms"].values())
    assert saved["same_bits"] == {"finite": True, "clipped": True, "nan": True}
    assert result["cond_speedup"] == saved["cond_speedup"]
