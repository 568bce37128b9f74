"""experiments/recipe_curves.py without training (seconds): config loading and overrides, the per-recipe config,
the summary, table and figure from metrics.jsonl files, and CLI validation. The training itself is
`jaxrl_fp8.train.run`, exercised end to end by tests/test_train.py and notebook 03."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

import jaxrl_fp8  # noqa: F401  (before anything starts a JAX backend: it sets the contract's XLA flags)

ROOT = Path(__file__).resolve().parents[1]


def _load(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "experiments" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


curves = _load("recipe_curves")
TINY = str(ROOT / "experiments" / "configs" / "tiny.py")


def test_load_config_and_overrides():
    c = curves.load_config(TINY)
    curves.apply_override(c, "data.prompts_per_step=4")
    curves.apply_override(c, "model.dtype=bfloat16")
    curves.apply_override(c, "rl.learning_rate=3e-4")
    assert (c.data.prompts_per_step, c.model.dtype, c.rl.learning_rate) == (4, "bfloat16", 3e-4)
    for bad, match in (("data.prompts_per_step", "expected KEY=VALUE"), ("data.nope=1", "no key 'data.nope'"),
                       ("nosection.x=1", "no section 'nosection'")):
        with pytest.raises(ValueError, match=match):
            curves.apply_override(c, bad)
    with pytest.raises(ValueError, match="is not a file"):
        curves.load_config(str(ROOT / "experiments" / "configs" / "missing.py"))


def test_recipe_config_is_a_fresh_identical_seed_copy(tmp_path):
    base = curves.load_config(TINY)
    before = base.to_dict()
    a = curves.recipe_config(base, "bf16", 3, str(tmp_path / "a"), seed=7)
    b = curves.recipe_config(base, "nvfp4", 3, str(tmp_path / "b"), seed=7)
    assert (a.recipe, b.recipe, a.seed, b.seed, a.total_steps) == ("bf16", "nvfp4", 7, 7, 3)
    assert a.checkpoint.resume is False and a.checkpoint.export_final_hf is False
    assert base.to_dict() == before  # the base is not modified
    assert a.model.to_dict() == b.model.to_dict() and a.data.to_dict() == b.data.to_dict()


def _fake_run(workdir, reward, diff, steps=4):
    from jaxrl_fp8.metrics import MetricsWriter

    w = MetricsWriter(str(workdir), tensorboard=False)
    for s in range(1, steps + 1):
        w.write(s, {"reward_mean": reward * s, "tis_clipfrac": diff, "train_rollout_logprob_abs_diff": diff,
                    "train_rollout_kl": diff / 10, "step_seconds": 10.0 if s == 1 else 0.5})
    w.close()
    return str(workdir)


def test_summary_table_and_figure(tmp_path):
    workdirs = {"bf16": _fake_run(tmp_path / "bf16", 0.1, 0.0), "bf16_train_fp8_rollout": _fake_run(tmp_path / "mixed", 0.05, 0.2)}
    summary = curves.summarize(workdirs)
    assert summary["bf16"]["reward_last"] == pytest.approx(0.4)
    assert summary["bf16"]["reward_mean"] == pytest.approx(0.25)
    assert summary["bf16"]["logprob_abs_diff_mean"] == 0.0
    assert summary["bf16_train_fp8_rollout"]["tis_clipfrac_mean"] == pytest.approx(0.2)
    assert summary["bf16"]["step_seconds_median"] == 0.5 and summary["bf16"]["first_step_seconds"] == 10.0
    png = tmp_path / "curves.png"
    curves.plot_curves(workdirs, str(png), "test")
    assert png.read_bytes()[:4] == b"\x89PNG" and png.stat().st_size > 10_000
    meta = {"device": "cpu", "steps": 4, "seed": 0, "config": "configs/tiny.py", "overrides": []}
    md = curves.markdown(summary, meta)
    assert "| bf16 | 0.100 → 0.400 (0.250) | 0 |" in md
    json.dumps(summary)  # serializable


def test_cli_validation(capsys, tmp_path):
    assert curves.main(["--recipes", "bf16,fp9"]) == 2
    assert "unknown ['fp9']" in capsys.readouterr().err
    assert curves.main(["--steps", "0"]) == 2
    assert curves.main(["--set", "model.nope=1"]) == 2
    assert "no key" in capsys.readouterr().err
    (tmp_path / "runs" / "bf16").mkdir(parents=True)  # an existing run is never silently replaced
    assert curves.main(["--recipes", "bf16", "--steps", "1", "--out", str(tmp_path / "out"), "--runs-dir", str(tmp_path / "runs")]) == 2
    assert "pass --overwrite" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # nothing written before the runs
    for action in curves.build_parser()._actions:
        assert action.help, action.option_strings
    keys = {k for _, ks in curves.PANELS for k in ks}
    assert {"reward_mean", "tis_clipfrac", "step_seconds"} <= keys


def test_from_runs_with_a_device_label(tmp_path, capsys):
    """Runs trained on another machine are summarised here under that machine's name; the label alone is refused."""
    assert curves.main(["--recipes", "bf16", "--device-label", "h200"]) == 2
    assert "--from-runs" in capsys.readouterr().err
    runs = tmp_path / "runs"
    _fake_run(runs / "bf16", 0.1, 0.0)
    out = tmp_path / "out"
    assert curves.main(["--from-runs", "--recipes", "bf16", "--steps", "4", "--runs-dir", str(runs), "--out", str(out),
                        "--device-label", "h200:NVIDIA H200"]) == 0
    meta = json.loads((out / "recipe_curves.json").read_text())["meta"]
    assert (meta["device"], meta["device_kind"]) == ("h200", "NVIDIA H200")
    assert "(h200)" in (out / "recipe_curves.md").read_text()
