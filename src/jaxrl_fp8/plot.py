"""`python -m jaxrl_fp8.plot WORKDIR`: PNG curves of a training run's metrics.jsonl.

Writes `<WORKDIR>/plots/<group>.png` for reward, mismatch, optimisation and timing groups, plus one PNG
with everything, so a run can be judged by eye without TensorBoard.
"""

from __future__ import annotations

import os
import sys

from absl import app, flags

from jaxrl_fp8.metrics import read_metrics

GROUPS = {
    "reward": ["reward_mean", "reward_std", "eval_reward_mean", "response_length"],
    "mismatch": ["train_rollout_logprob_abs_diff", "train_rollout_kl", "tis_mean", "tis_clipfrac"],
    "optimization": ["loss", "pg_loss", "pg_clipfrac", "ppo_kl", "entropy", "grad_norm", "learning_rate"],
    "timing": ["rollout_seconds", "train_seconds", "sync_seconds", "step_seconds", "tokens_per_second"],
}


def plot_workdir(workdir: str, out_dir: str | None = None) -> list[str]:
    # Figure + Agg canvas directly: no pyplot, so the global backend (e.g. a notebook's inline one) is untouched.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    records = read_metrics(workdir)
    if not records:
        raise ValueError(f"{workdir}: metrics.jsonl has no records")
    out_dir = out_dir or os.path.join(workdir, "plots")
    os.makedirs(out_dir, exist_ok=True)
    written = []
    for group, keys in GROUPS.items():
        keys = [k for k in keys if any(isinstance(r.get(k), float) for r in records)]
        if not keys:
            continue
        fig = Figure(figsize=(4 * len(keys), 3.2))
        FigureCanvasAgg(fig)
        axes = fig.subplots(1, len(keys), squeeze=False)
        for ax, key in zip(axes[0], keys):
            pts = [(r["step"], r[key]) for r in records if isinstance(r.get(key), float)]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="." if len(pts) < 50 else None)
            ax.set_title(key, fontsize=9)
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
        fig.suptitle(f"{os.path.basename(os.path.abspath(workdir))}: {group}")
        fig.tight_layout()
        path = os.path.join(out_dir, f"{group}.png")
        tmp = path + ".tmp.png"
        fig.savefig(tmp, dpi=100)
        os.replace(tmp, path)
        written.append(path)
    return written


FLAGS = flags.FLAGS
flags.DEFINE_string("out", None, "Directory for the PNGs (default: WORKDIR/plots).")


def main(argv):
    if len(argv) != 2:
        raise app.UsageError("usage: python -m jaxrl_fp8.plot WORKDIR [--out DIR]")
    for path in plot_workdir(argv[1], FLAGS.out):
        print(path)


if __name__ == "__main__":
    app.run(main, argv=sys.argv)
