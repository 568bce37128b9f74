import json
import os

import pytest

from jaxrl_fp8.metrics import MetricsWriter, read_metrics
from jaxrl_fp8.plot import plot_workdir


def test_jsonl_tensorboard_and_plots(tmp_path):
    w = MetricsWriter(str(tmp_path))
    for step in range(1, 6):
        w.write(step, {"reward_mean": step / 5, "train_rollout_logprob_abs_diff": 0.0, "loss": float("nan"), "note": "x"})
    w.close()
    recs = read_metrics(str(tmp_path))
    assert [r["step"] for r in recs] == [1, 2, 3, 4, 5]
    assert recs[-1]["reward_mean"] == 1.0 and recs[0]["loss"] == "nan" and "note" not in recs[0]
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(tmp_path / "tensorboard"))
    paths = plot_workdir(str(tmp_path))
    assert any(p.endswith("reward.png") for p in paths)
    for p in paths:
        with open(p, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    w2 = MetricsWriter(str(tmp_path), tensorboard=False)
    w2.truncate_after(3)
    assert [r["step"] for r in read_metrics(str(tmp_path))] == [1, 2, 3]


def test_read_metrics_names_bad_line(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1}) + "\n{oops\n")
    with pytest.raises(ValueError, match=r"metrics.jsonl:2"):
        read_metrics(str(tmp_path))
