"""A few RL steps of each recipe on the Qwen3-30B-A3B shape (random weights), expert-parallel over 8 devices with
the embedded engine collocated on the training mesh: BF16/BF16, BF16-train/FP8-rollout, FP8/FP8.

    # the measurement (nvidia-h200-x8; ~30.5B parameters, 256 prompt + 512 response tokens, 64 rows a step)
    python experiments/scale_run.py --size full --steps 4
    # the same family scaled down on 8 virtual CPU devices (what the repository's results and test run)
    python experiments/scale_run.py --size tiny --steps 3 --cpu-devices 8

Every recipe runs `jaxrl_fp8.train.run` (the real trainer: rollout, R3 replay, old log-probs, PPO x TIS
updates, weight push) on `experiments/configs/qwen3_30b_a3b_shape_<recipe>.py` in its own subprocess, so a
device's peak memory is that recipe's alone. Per step it collects, from the metrics.jsonl the trainer writes:
rollout / train / sync / step seconds, tokens per second (response tokens / step seconds, the trainer's
definition) and the mismatch metrics (train_rollout_logprob_abs_diff, train_rollout_kl, tis_clipfrac). Peak
memory per device comes from `device.memory_stats()["peak_bytes_in_use"]` read when each step's metrics are
written (peak since the process started, i.e. "so far"); XLA:CPU has no memory stats, so on CPU it is null.

Output: experiments/benchmarks/results/scale_run_<device><count>_<size>.json (device kind / count, versions,
config, per-step rows, per-recipe medians over the steps after the first (compiling) one, fp8_block-vs-bf16
throughput and memory ratios) and a .png next to it (step-time breakdown and mismatch per recipe); both are
written to a temp file and renamed.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import re
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
CONFIGS = os.path.join(HERE, "configs")
RESULTS = os.path.join(HERE, "benchmarks", "results")
RECIPES = ("bf16", "bf16_train_fp8_rollout", "fp8_block")
CONFIG_FILE = {"bf16": "qwen3_30b_a3b_shape_bf16.py", "bf16_train_fp8_rollout": "qwen3_30b_a3b_shape_bf16_train_fp8_rollout.py",
               "fp8_block": "qwen3_30b_a3b_shape_fp8.py"}
TIME_KEYS = ("rollout_seconds", "train_seconds", "sync_seconds", "step_seconds", "tokens_per_second")
MISMATCH_KEYS = ("train_rollout_logprob_abs_diff", "train_rollout_kl", "tis_clipfrac")
# the trainer logs the clip fraction twice: from the loss (`tis_clipfrac`, averaged over minibatches, w.r.t. the
# current policy) and from the batch-level mismatch metrics (`train_rollout_tis_clipfrac`, w.r.t. old log-probs)
EXTRA_KEYS = ("train_rollout_tis_clipfrac", "train_rollout_max_abs_diff", "reward_mean", "response_length", "loss", "grad_norm",
              "skipped_updates")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python experiments/scale_run.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=("tiny", "full"), default="full",
                   help="full: the Qwen3-30B-A3B shape (8 GPUs); tiny: the same family scaled down (8 CPU devices). "
                        "Sizes are defined in experiments/configs/_qwen3_30b_a3b_shape.py (default: %(default)s)")
    p.add_argument("--recipes", default=",".join(RECIPES), help="comma list, a subset of %(default)s")
    p.add_argument("--steps", type=int, default=None,
                   help="RL steps per recipe; the first one compiles and is left out of the medians "
                        "(default: the size's, full 4 / tiny 3)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="config override applied to every recipe, repeatable, e.g. --set rollout.n_samples=8 "
                        "--set mesh.expert=4 --set mesh.fsdp=2 (value parsed as a Python literal)")
    p.add_argument("--cpu-devices", type=int, default=0,
                   help="run on XLA:CPU with this many virtual devices (JAX_PLATFORMS=cpu, "
                        "--xla_force_host_platform_device_count); 0: whatever devices JAX finds (default)")
    p.add_argument("--fast-compile", action="store_true",
                   help="XLA:CPU --xla_backend_optimization_level=0 (compiles ~2x faster, runs slower; the tests use it)")
    p.add_argument("--out", default=None,
                   help="results JSON path; the PNG goes next to it with .png "
                        "(default: experiments/benchmarks/results/scale_run_<device><count>_<size>.json)")
    p.add_argument("--runs-dir", default=None,
                   help="parent of the per-recipe workdirs (metrics.jsonl; default runs/scale_run_<size>/, not versioned)")
    p.add_argument("--skip-done", action="store_true",
                   help="reuse a recipe's <runs-dir>/<recipe>.result.json from an earlier command instead of running it "
                        "again (e.g. one recipe per command on a machine with a per-command time limit, then all merged)")
    p.add_argument("--timeout", type=int, default=3600, help="seconds per recipe subprocess (default %(default)s)")
    p.add_argument("--child", default="", help=argparse.SUPPRESS)  # internal: run one recipe, write --out
    return p


def recipe_config(recipe: str, size: str, steps: int | None, workdir: str, overrides):
    """The shape config of one recipe with the run's steps, workdir and overrides."""
    import runpy

    sys.path.insert(0, HERE)
    from recipe_curves import apply_override  # one KEY=VALUE parser for the experiment scripts

    c = runpy.run_path(os.path.join(CONFIGS, CONFIG_FILE[recipe]))["get_config"](size)
    for assignment in overrides:
        apply_override(c, assignment)
    if steps is not None:
        c.total_steps = steps
    c.workdir = workdir
    c.checkpoint.resume = False
    return c


def _memory_per_device(devices) -> list:
    """peak / current bytes per local device, or None where the backend keeps no statistics (XLA:CPU)."""
    out = []
    for d in devices:
        try:
            stats = d.memory_stats()
        except Exception:  # some backends raise instead of returning None
            stats = None
        out.append(None if not stats else {k: stats.get(k) for k in ("peak_bytes_in_use", "bytes_in_use", "bytes_limit")})
    return out


def child(args) -> None:
    """One recipe in this process: train.run with a metrics writer that also records device memory."""
    import jaxrl_fp8  # noqa: F401  (first: it sets the XLA flags the contract needs)
    import jax

    from jaxrl_fp8 import metrics as metrics_lib
    from jaxrl_fp8 import train
    from jaxrl_fp8.config import ConfigError, validate_config
    from jaxrl_fp8.metrics import read_metrics
    from jaxrl_fp8.sharding.mesh import MeshConfig, MeshError

    recipe = args.child
    workdir = os.path.join(args.runs_dir, recipe)
    c = recipe_config(recipe, args.size, args.steps, workdir, args.set)
    validate_config(c)
    try:  # train.run only builds a mesh with > 1 device; this run must be sharded as configured
        sizes = MeshConfig.from_config(c.mesh).sizes(jax.device_count())
    except MeshError as e:
        raise ConfigError(f"{e} (the scale run is expert-parallel; run it on 8 devices, or --cpu-devices 8)") from e
    if os.path.exists(os.path.join(workdir, "metrics.jsonl")):
        os.remove(os.path.join(workdir, "metrics.jsonl"))
    devices = jax.local_devices()
    memory_rows: dict[int, list] = {}
    base_writer = metrics_lib.MetricsWriter

    class MemoryWriter(base_writer):  # train.run imports MetricsWriter from jaxrl_fp8.metrics when it runs
        def write(self, step, metrics):
            mem = _memory_per_device(devices)
            memory_rows[int(step)] = mem
            peaks = [m["peak_bytes_in_use"] for m in mem if m and m.get("peak_bytes_in_use") is not None]
            extra = {"peak_bytes_in_use_max_device": float(max(peaks))} if peaks else {}
            return super().write(step, {**metrics, **extra})

    metrics_lib.MetricsWriter = MemoryWriter
    t0 = time.time()
    try:
        train.run(c)
    finally:
        metrics_lib.MetricsWriter = base_writer
    wall = time.time() - t0
    records = read_metrics(workdir)
    rows = []
    for r in records:
        row = {"step": r["step"]}
        for k in TIME_KEYS + MISMATCH_KEYS + EXTRA_KEYS:
            v = r.get(k)
            row[k] = v if isinstance(v, float) else (None if v is None else str(v))
        row["peak_bytes_in_use_per_device"] = [None if m is None else m.get("peak_bytes_in_use") for m in memory_rows.get(r["step"], [])]
        rows.append(row)
    import flax
    import numpy as np

    d0 = devices[0]
    result = dict(
        recipe=recipe, workdir=os.path.relpath(workdir, REPO) if workdir.startswith(REPO + os.sep) else workdir,
        device=dict(platform=d0.platform, kind=getattr(d0, "device_kind", d0.platform), count=jax.device_count(),
                    processor=platform.processor() or platform.machine(),
                    memory_stats_available=any(m is not None for m in _memory_per_device(devices))),
        versions=dict(python=platform.python_version(), jax=jax.__version__, jaxlib=importlib.metadata.version("jaxlib"), flax=flax.__version__, numpy=np.__version__),
        mesh=sizes, xla_flags=os.environ.get("XLA_FLAGS", ""), wall_seconds=wall,
        config=json.loads(c.to_json_best_effort()), rows=rows)
    _write_json(args.out, result)


def _write_json(path: str, obj) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


def _median(values):
    vals = sorted(v for v in values if isinstance(v, float))
    if not vals:
        return None
    n = len(vals)
    return vals[n // 2] if n % 2 else 0.5 * (vals[n // 2 - 1] + vals[n // 2])


def summarize(runs: dict) -> tuple[dict, dict]:
    """Per recipe: medians over the steps after the first (compile) step (all steps if there is only one), the
    first step alone, and the max over devices of the peak memory; then fp8_block vs bf16 ratios."""
    per = {}
    for recipe, run in runs.items():
        rows = run["rows"]
        steady = rows[1:] if len(rows) > 1 else rows
        med = {k: _median([r[k] for r in steady]) for k in TIME_KEYS + MISMATCH_KEYS + ("train_rollout_tis_clipfrac",)}
        peaks = [p for r in rows for p in r["peak_bytes_in_use_per_device"] if p is not None]
        per[recipe] = dict(steps=len(rows), median_over_steps=[r["step"] for r in steady], median=med,
                           first_step={k: rows[0][k] for k in TIME_KEYS} if rows else {},
                           max_abs_logprob_diff=max((r["train_rollout_max_abs_diff"] for r in rows
                                                     if isinstance(r["train_rollout_max_abs_diff"], float)), default=None),
                           peak_bytes_in_use_max_device=max(peaks) if peaks else None)
    ratios = {}
    if "fp8_block" in per and "bf16" in per:
        f, b = per["fp8_block"], per["bf16"]
        tf, tb = f["median"]["tokens_per_second"], b["median"]["tokens_per_second"]
        sf, sb = f["median"]["step_seconds"], b["median"]["step_seconds"]
        ratios = dict(
            fp8_vs_bf16_tokens_per_second=(tf / tb) if tf and tb else None,
            fp8_vs_bf16_step_seconds=(sf / sb) if sf and sb else None,
            fp8_vs_bf16_peak_memory=(f["peak_bytes_in_use_max_device"] / b["peak_bytes_in_use_max_device"])
            if f["peak_bytes_in_use_max_device"] and b["peak_bytes_in_use_max_device"] else None)
    return per, ratios


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    per = result["summary"]
    recipes = list(per)
    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(11, 4))
    x = np.arange(len(recipes))
    bottom = np.zeros(len(recipes))
    for key, color in (("rollout_seconds", "tab:blue"), ("train_seconds", "tab:orange"), ("sync_seconds", "tab:green")):
        vals = np.array([per[r]["median"][key] or 0.0 for r in recipes])
        ax0.bar(x, vals, bottom=bottom, color=color, label=key.replace("_seconds", ""))
        bottom += vals
    for i, r in enumerate(recipes):
        tps = per[r]["median"]["tokens_per_second"]
        ax0.text(i, bottom[i], f"{tps:.3g} tok/s" if tps else "", ha="center", va="bottom", fontsize=8)
    ax0.set_xticks(x, recipes, fontsize=8)
    ax0.set_ylabel("seconds per RL step (median, after step 1)")
    ax0.set_title("step time breakdown", fontsize=10)
    ax0.legend(fontsize=8)
    width = 0.25
    for j, key in enumerate(MISMATCH_KEYS):
        vals = [per[r]["median"][key] or 0.0 for r in recipes]
        ax1.bar(x + (j - 1) * width, vals, width, label=key)
    ax1.set_yscale("symlog", linthresh=1e-6)
    ax1.set_xticks(x, recipes, fontsize=8)
    ax1.set_title("train-rollout mismatch (median over steps; 0 = bitwise)", fontsize=10)
    ax1.legend(fontsize=7)
    d = result["device"]
    fig.suptitle(f"scale run, {result['size']} Qwen3-30B-A3B shape, {d['count']} x {d['kind']}, mesh "
                 + " x ".join(f"{k}={v}" for k, v in result["mesh"].items()), fontsize=10)
    fig.tight_layout()
    tmp = path[: -len(".png")] + f".tmp-{os.getpid()}.png"
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)


def device_tag(device: dict) -> str:
    if device["platform"] == "cpu":
        name = "cpu"
    else:
        tokens = re.findall(r"[a-z]+\d+[a-z]*", device["kind"].lower())
        name = tokens[-1] if tokens else re.sub(r"\W+", "_", device["kind"].lower())
    return f"{name}{device['count']}" if device["platform"] == "cpu" else f"{name}_x{device['count']}"


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.runs_dir is None:
        args.runs_dir = os.path.join(REPO, "runs", f"scale_run_{args.size}")
    args.runs_dir = os.path.abspath(args.runs_dir)
    if args.child:
        child(args)
        return 0
    recipes = [r.strip() for r in args.recipes.split(",") if r.strip()]
    bad = [r for r in recipes if r not in RECIPES]
    if bad or not recipes:
        print(f"error: --recipes: unknown {bad or 'empty list'}; choose from {', '.join(RECIPES)}", file=sys.stderr)
        return 2
    if args.steps is not None and args.steps < 1:
        print(f"error: --steps must be >= 1, got {args.steps}", file=sys.stderr)
        return 2
    for a in args.set:  # fail before any subprocess: the override must parse and name a key
        if "=" not in a:
            print(f"error: --set {a!r}: expected KEY=VALUE", file=sys.stderr)
            return 2
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(REPO, "src"), REPO, env.get("PYTHONPATH", "")])
    if args.cpu_devices:
        env["JAX_PLATFORMS"] = "cpu"
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={args.cpu_devices}").strip()
    if args.fast_compile:
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()
    runs = {}
    os.makedirs(args.runs_dir, exist_ok=True)
    for recipe in recipes:
        part = os.path.join(args.runs_dir, f"{recipe}.result.json")
        if args.skip_done and os.path.exists(part):
            with open(part) as f:
                runs[recipe] = json.load(f)
            print(f"[scale_run] {recipe}: reusing {part}", file=sys.stderr, flush=True)
            continue
        cmd = [sys.executable, os.path.abspath(__file__), "--child", recipe, "--size", args.size, "--out", part,
               "--runs-dir", args.runs_dir] + (["--steps", str(args.steps)] if args.steps else [])
        for a in args.set:
            cmd += ["--set", a]
        print(f"[scale_run] {recipe}: {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
        t0 = time.time()
        p = subprocess.run(cmd, env=env, timeout=args.timeout)
        if p.returncode:
            print(f"error: recipe {recipe} failed (rc {p.returncode})", file=sys.stderr)
            return 1
        with open(part) as f:
            runs[recipe] = json.load(f)
        print(f"[scale_run] {recipe}: done in {time.time() - t0:.1f}s", file=sys.stderr, flush=True)
    first = runs[recipes[0]]
    summary, ratios = summarize(runs)
    result = dict(
        what="RL steps per recipe through jaxrl_fp8.train.run, Qwen3-30B-A3B shape (random weights), collocated rollout",
        command="python experiments/scale_run.py " + " ".join(sys.argv[1:] if argv is None else argv),
        date=time.strftime("%Y-%m-%dT%H:%M:%S%z"), size=args.size, device=first["device"], versions=first["versions"],
        mesh=first["mesh"], xla_flags=first["xla_flags"],
        memory_note=None if first["device"]["memory_stats_available"] else
        "device.memory_stats() is None on this backend (XLA:CPU keeps no allocator statistics): peak memory is null",
        medians_exclude="the first step (it compiles the rollout, logprob and update programs)" if
        all(len(r["rows"]) > 1 for r in runs.values()) else "nothing: a recipe ran a single step, its median is that step",
        summary=summary, ratios=ratios,
        config={r: runs[r]["config"] for r in recipes},
        rows={r: runs[r]["rows"] for r in recipes},
        wall_seconds={r: runs[r]["wall_seconds"] for r in recipes})
    out = args.out or os.path.join(RESULTS, f"scale_run_{device_tag(first['device'])}_{args.size}.json")
    _write_json(out, result)
    png = out[: -len(".json")] + ".png" if out.endswith(".json") else out + ".png"
    plot(result, png)
    print(json.dumps(dict(summary={r: s["median"] for r, s in summary.items()}, ratios=ratios), indent=1))
    print(out)
    print(png)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
