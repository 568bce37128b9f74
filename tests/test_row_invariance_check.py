"""experiments/checks/row_invariance.py: on CPU every op of the forward is row invariant (the property the
embedded engine's bitwise rollout rests on), and the audit does see an op that is not."""

import importlib.util
import json
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

import jaxrl_fp8  # noqa: F401  (before anything starts a JAX backend: it sets the contract's XLA flags)

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("row_invariance", ROOT / "experiments" / "checks" / "row_invariance.py")
audit = importlib.util.module_from_spec(spec)
sys.modules["row_invariance"] = audit
spec.loader.exec_module(audit)


@pytest.mark.row_invariant_cpu
def test_every_forward_op_is_row_invariant_on_cpu(tmp_path):
    out = tmp_path / "r.json"
    assert audit.main(["--small", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    ops = {r["op"] for r in result["rows"]}
    assert {"dense fp8-block", "lm_head f32 (high_precision_linear)", "grouped fp8-block", "rms_norm",
            "lm_head split3 (ops.high_precision)"} <= ops
    assert any(op.startswith("attention exact") for op in ops) and any(op.startswith("attention xla") for op in ops)
    bad = {r["op"]: r["differing_by_batch"] for r in result["rows"] if any(r["differing_by_batch"].values())}
    assert not bad, bad


def test_the_audit_sees_an_op_whose_rows_depend_on_the_batch(monkeypatch):
    def fake_ops(s):  # row r scaled by the batch size: every M > 1 changes every row
        return {"depends on M": (lambda x: x * jnp.float32(x.shape[0]), 8)}

    monkeypatch.setattr(audit, "row_ops", fake_ops)
    rows = audit.audit_rows(audit._shapes(True), (1, 3, 16), log=lambda m: None)
    assert rows[0]["differing_by_batch"][1] == 0
    assert rows[0]["differing_by_batch"][3] > 0 and rows[0]["differing_by_batch"][16] > 0
    assert audit._diff(np.float32([1.0, 2.0]), np.float32([1.0, np.nextafter(np.float32(2.0), np.float32(3.0))])) == 1
    assert audit._diff(np.float32([0.0, 3.0]), np.float32([-0.0, -3.0])) == 2  # elements, not bytes
