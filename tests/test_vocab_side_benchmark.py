"""experiments/benchmarks/vocab_side.py on CPU (`--tiny`): its parts run one call at a time into one JSON per card, the
points of the parts not run kept, `runs` naming the call that measured each part; the log-prob cut equals the uncut."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "experiments" / "benchmarks" / "vocab_side.py"


def _run(out, *args):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)]))
    p = subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--rows", "4", "--out", str(out), *args], env=env,
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-4000:]
    return json.loads(out.read_text())


def test_parts_accumulate_in_one_file(tmp_path):
    out = tmp_path / "vs.json"
    first = _run(out, "--parts", "noise")
    assert {pt["kind"] for pt in first["points"]} == {"noise"} and set(first["runs"]) == {"noise"}
    second = _run(out, "--parts", "logprob")
    assert {pt["kind"] for pt in second["points"]} == {"noise", "logprob"}
    assert second["runs"]["noise"] == first["runs"]["noise"] and "--parts logprob" in second["runs"]["logprob"]["command"]
    assert [pt for pt in second["points"] if pt["kind"] == "noise"] == first["points"]
    assert all(pt["bitwise_vs_cut"] for pt in second["points"] if pt["kind"] == "logprob")
    again = _run(out, "--parts", "logprob")  # a rerun replaces its part's points, never appends beside them
    assert sum(pt["kind"] == "logprob" for pt in again["points"]) == sum(pt["kind"] == "logprob" for pt in second["points"])
