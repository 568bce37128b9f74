"""Short RL runs of each precision recipe with identical seeds, and their curves in one figure.

Every recipe trains from the same config (`--config`, default experiments/configs/tiny.py: the built-in copy
task, a tiny Qwen3-MoE initialised from the same seed) for the same number of steps through
`jaxrl_fp8.train.run`, each into its own workdir. Then one PNG shows reward, TIS clip fraction, train–rollout
|Δlogp| and step time against the step for every recipe, and a JSON/markdown summary gives per-recipe means.

    python experiments/recipe_curves.py --steps 3                          # CPU smoke run (a few minutes)
    python experiments/recipe_curves.py --steps 200 --set data.prompts_per_step=64   # on the H200

Outputs: recipe_curves.png, recipe_curves.json, recipe_curves.md under experiments/results/recipe_curves_<device>/
(or --out); the run workdirs (metrics, checkpoints) under runs/recipe_curves_<device>/<recipe>/ (or --runs-dir;
runs/ is not versioned).
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import os
import shutil
import sys
import time
from collections.abc import Sequence

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
DEFAULT_CONFIG = os.path.join(HERE, "configs", "tiny.py")
DEFAULT_RECIPES = ("bf16", "bf16_train_fp8_rollout", "fp8_block", "mxfp8", "nvfp4")
# (panel title, metric keys tried in order): the first key a run logged is plotted
PANELS = (
    ("reward (mean over samples)", ("reward_mean",)),
    ("TIS clip fraction", ("tis_clipfrac", "train_rollout_tis_clipfrac")),
    ("train-rollout mean |Δlogp|", ("train_rollout_logprob_abs_diff",)),
    ("step time (s)", ("step_seconds",)),
)


def load_config(path: str):
    """`get_config()` of an ml_collections config file (as `--config=` of the train CLI)."""
    if not os.path.isfile(path):
        raise ValueError(f"--config: {path!r} is not a file")
    spec = importlib.util.spec_from_file_location("recipe_curves_config", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, "get_config"):
        raise ValueError(f"--config: {path} has no get_config()")
    return module.get_config()


def apply_override(c, assignment: str) -> None:
    """`section.key=value` (value parsed as a Python literal, else kept as a string) onto config `c`."""
    if "=" not in assignment:
        raise ValueError(f"--set {assignment!r}: expected KEY=VALUE, e.g. data.prompts_per_step=16")
    key, raw = assignment.split("=", 1)
    try:
        value = ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        value = raw
    node = c
    parts = key.strip().split(".")
    for part in parts[:-1]:
        if part not in node:
            raise ValueError(f"--set {assignment!r}: config has no section {part!r}")
        node = node[part]
    if parts[-1] not in node:
        raise ValueError(f"--set {assignment!r}: config has no key {key!r}")
    node[parts[-1]] = value


def recipe_config(base, recipe: str, steps: int, workdir: str, seed: int):
    """The base config for one recipe: same seed, same steps, own workdir, no resume, no export."""
    c = base.copy_and_resolve_references()
    c.recipe = recipe
    c.total_steps = steps
    c.seed = seed
    c.workdir = workdir
    c.checkpoint.resume = False
    c.checkpoint.every_steps = steps  # one checkpoint at the end
    c.checkpoint.export_final_hf = False
    c.logging.plot_at_end = False
    c.logging.progress_bar = False
    c.logging.eval_every_steps = 0
    return c


def run_recipes(base, recipes: Sequence[str], steps: int, runs_dir: str, seed: int, *, overwrite: bool, log=print) -> dict[str, str]:
    """Train each recipe into runs_dir/<recipe>; returns {recipe: workdir}."""
    from jaxrl_fp8.config import validate_config
    from jaxrl_fp8.train import run

    configs = {r: recipe_config(base, r, steps, os.path.join(runs_dir, r), seed) for r in recipes}
    for r, c in configs.items():  # every config is valid and every workdir free before the first step
        validate_config(c)
        if os.path.exists(c.workdir):
            if not overwrite:
                raise ValueError(f"{c.workdir} exists; pass --overwrite to replace it")
    workdirs = {}
    for r, c in configs.items():
        if os.path.exists(c.workdir):
            shutil.rmtree(c.workdir)
        t0 = time.time()
        workdirs[r] = run(c)
        log(f"{r}: {steps} steps in {time.time() - t0:.1f}s -> {workdirs[r]}")
    return workdirs


def _series(records: list[dict], keys: Sequence[str]):
    for key in keys:
        pts = [(r["step"], r[key]) for r in records if isinstance(r.get(key), float)]
        if pts:
            return key, np.array([p[0] for p in pts]), np.array([p[1] for p in pts])
    return None, np.array([]), np.array([])


def summarize(workdirs: dict[str, str]) -> dict:
    """Per recipe: steps, final and mean reward, mean mismatch, TIS clip fraction, median step time (after step 1,
    which includes compilation)."""
    from jaxrl_fp8.metrics import read_metrics

    out = {}
    for recipe, wd in workdirs.items():
        recs = read_metrics(wd)
        if not recs:
            raise ValueError(f"{wd}/metrics.jsonl has no records")

        def col(*keys):
            return _series(recs, keys)[2]

        steady = col("step_seconds")[1:] if len(recs) > 1 else col("step_seconds")
        out[recipe] = {
            "workdir": wd,
            "steps": len(recs),
            "reward_first": float(col("reward_mean")[0]),
            "reward_last": float(col("reward_mean")[-1]),
            "reward_mean": float(col("reward_mean").mean()),
            "logprob_abs_diff_mean": float(col("train_rollout_logprob_abs_diff").mean()),
            "kl_mean": float(col("train_rollout_kl").mean()),
            "tis_clipfrac_mean": float(col("tis_clipfrac", "train_rollout_tis_clipfrac").mean()),
            "step_seconds_median": float(np.median(steady)),
            "first_step_seconds": float(col("step_seconds")[0]),
        }
    return out


def plot_curves(workdirs: dict[str, str], path: str, title: str = "") -> None:
    """One figure: a panel per metric of PANELS, a line per recipe."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from jaxrl_fp8.metrics import read_metrics

    fig, axes = plt.subplots(1, len(PANELS), figsize=(4.6 * len(PANELS), 3.8))
    for recipe, wd in workdirs.items():
        recs = read_metrics(wd)
        for ax, (label, keys) in zip(axes, PANELS):
            key, x, y = _series(recs, keys)
            if key is not None:
                ax.plot(x, y, marker="." if len(x) < 60 else None, label=recipe)
    for ax, (label, _) in zip(axes, PANELS):
        ax.set_title(label, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[2].set_yscale("symlog", linthresh=1e-4)
    axes[3].set_yscale("log")
    axes[0].legend(fontsize=8)
    fig.suptitle(title or "recipes, identical seeds", fontsize=10)
    fig.tight_layout()
    tmp = path[: -len(".png")] + ".tmp.png"
    fig.savefig(tmp, dpi=110)
    os.replace(tmp, path)
    plt.close(fig)


def markdown(summary: dict, meta: dict) -> str:
    lines = [f"# Recipe curves ({meta['device']})", "",
             f"{meta['steps']} RL steps per recipe, seed {meta['seed']}, config `{meta['config']}`"
             + (f", overrides {', '.join(meta['overrides'])}" if meta["overrides"] else "") + ".", "",
             "| recipe | reward first → last (mean) | mean abs Δlogp | K3 KL | TIS clipfrac | step s (median, after step 1) | step 1 s |",
             "|---|---|---|---|---|---|---|"]
    for r, s in summary.items():
        lines.append(f"| {r} | {s['reward_first']:.3f} → {s['reward_last']:.3f} ({s['reward_mean']:.3f}) | "
                     f"{s['logprob_abs_diff_mean']:.3g} | {s['kl_mean']:.3g} | {s['tis_clipfrac_mean']:.3g} | "
                     f"{s['step_seconds_median']:.3g} | {s['first_step_seconds']:.3g} |")
    return "\n".join(lines) + "\n"


def _write(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _device_name() -> tuple[str, str]:
    """mismatch_study.device_name (one device naming for every result folder), loaded by path."""
    if "mismatch_study" in sys.modules:
        return sys.modules["mismatch_study"].device_name()
    spec = importlib.util.spec_from_file_location("mismatch_study", os.path.join(HERE, "mismatch_study.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules["mismatch_study"] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module.device_name()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python experiments/recipe_curves.py",
        description="Train each precision recipe for the same steps from the same seed (jaxrl_fp8.train.run) and plot "
                    "reward, TIS clip fraction, train-rollout mismatch and step time in one figure.",
    )
    p.add_argument("--config", default=DEFAULT_CONFIG, help="ml_collections config file (default: %(default)s)")
    p.add_argument("--recipes", default=",".join(DEFAULT_RECIPES), help="comma-separated recipe names (default: %(default)s)")
    p.add_argument("--steps", type=int, default=20, help="RL steps per recipe (default %(default)s)")
    p.add_argument("--seed", type=int, default=None,
                   help="the seed every recipe uses (model init, data, sampling; default: the config's seed)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="config override, repeatable, e.g. --set data.prompts_per_step=16 --set model.dtype=bfloat16")
    p.add_argument("--out", default=None, help="output directory (default: experiments/results/recipe_curves_<device>/)")
    p.add_argument("--runs-dir", default=None,
                   help="parent of the per-recipe workdirs (default: runs/recipe_curves_<device>/ in the repository)")
    p.add_argument("--overwrite", action="store_true", help="replace existing run directories under --runs-dir")
    p.add_argument("--from-runs", action="store_true",
                   help="train nothing: summarise and plot the finished workdirs --runs-dir/<recipe> (e.g. recipes trained "
                        "by separate processes at once, one --recipes each)")
    p.add_argument("--device-label", default=None, metavar="LABEL[:KIND]",
                   help="with --from-runs: the device the runs trained on, when summarising elsewhere "
                        "(e.g. 'h200:NVIDIA H200'; default: this machine's device)")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        from jaxrl_fp8.precision import RECIPES

        recipes = [r.strip() for r in args.recipes.split(",") if r.strip()]
        unknown = [r for r in recipes if r not in RECIPES]
        if unknown or not recipes:
            raise ValueError(f"--recipes: unknown {unknown or 'empty list'}; known: {', '.join(RECIPES)}")
        if args.steps < 1:
            raise ValueError(f"--steps must be >= 1, got {args.steps}")
        base = load_config(args.config)
        for assignment in args.set:
            apply_override(base, assignment)
        seed = base.seed if args.seed is None else args.seed
        if args.device_label is not None and not args.from_runs:
            raise ValueError("--device-label names the device of finished runs: use it with --from-runs")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.device_label:
        device, _, kind = args.device_label.partition(":")
        kind = kind or device
    else:
        device, kind = _device_name()
    out = args.out or os.path.join(HERE, "results", f"recipe_curves_{device}")
    runs_dir = args.runs_dir or os.path.join(REPO, "runs", f"recipe_curves_{device}")
    try:
        if args.from_runs:
            workdirs = {r: os.path.join(runs_dir, r) for r in recipes}
            missing = [wd for wd in workdirs.values() if not os.path.isfile(os.path.join(wd, "metrics.jsonl"))]
            if missing:
                raise ValueError(f"--from-runs: no metrics.jsonl in {', '.join(missing)}")
        else:
            workdirs = run_recipes(base, recipes, args.steps, runs_dir, seed, overwrite=args.overwrite,
                                   log=lambda m: print(m, file=sys.stderr))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    os.makedirs(out, exist_ok=True)
    summary = summarize(workdirs)
    for s in summary.values():  # repository-relative where possible: the JSON is committed
        if os.path.abspath(s["workdir"]).startswith(REPO + os.sep):
            s["workdir"] = os.path.relpath(s["workdir"], REPO)
    # with --from-runs the runs say how many steps they logged; --steps is only what was asked for
    steps = max(v["steps"] for v in summary.values()) if args.from_runs else args.steps
    meta = {"device": device, "device_kind": kind, "steps": steps, "seed": seed, "config": os.path.relpath(args.config, HERE),
            "overrides": list(args.set), "recipes": recipes, "date": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    png = os.path.join(out, "recipe_curves.png")
    plot_curves(workdirs, png, f"{len(recipes)} recipes, {steps} steps, seed {seed} ({device})")
    _write(os.path.join(out, "recipe_curves.json"), json.dumps({"meta": meta, "summary": summary}, indent=1) + "\n")
    _write(os.path.join(out, "recipe_curves.md"), markdown(summary, meta))
    for name in ("recipe_curves.png", "recipe_curves.json", "recipe_curves.md"):
        print(os.path.join(out, name))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
