"""Where does an fp8_block rollout stop giving the trainer's bits? (GPU; one variant per process.)

Runs the embedded engine on the Qwen3-30B-A3B-shaped slice of `experiments/benchmarks/train_step_long.py`
(hidden 2048, 32/4 heads of 128, 128 experts of 768 top-8, layer 1 dense; attention "auto": flash on Hopper), then
the trainer's recomputation of the same tokens (one row per forward and all rows in one), and prints the fraction of
bit-identical response log-probs and each row's first differing step (step 0 is the prefill's logits, later steps the
decode loop's). A variant forces one FP8 piece onto the XLA block math, for both sides:

    default      as shipped (Mosaic kernels on Hopper)
    grouped_xla  the grouped (expert) FP8 GEMMs
    dense_xla    the dense FP8 GEMMs
    quant_xla    the FP8 quantizers of activations and weights
    all_xla      every FP8 GEMM and quantizer

Traced programs keep the form they were traced with, so each variant needs a process of its own:

    for v in default grouped_xla dense_xla quant_xla; do
        PYTHONPATH=src:. python experiments/checks/fp8_bits_diag.py --variant $v; done
"""

from __future__ import annotations

import argparse
import os
import runpy
import time

import numpy as np

VARIANTS = ("default", "grouped_xla", "dense_xla", "quant_xla", "all_xla")


def force_xla(variant: str) -> None:
    """Patch the ops layer so that `variant`'s FP8 piece takes the XLA path (before anything is traced)."""
    from jaxrl_fp8.ops import backends, block_scaled, operands

    if variant == "all_xla":
        backends.resolve = lambda backend, fmt, n, k: "xla"
    elif variant == "grouped_xla":
        grouped = block_scaled.grouped_block_scaled_matmul
        block_scaled.grouped_block_scaled_matmul = lambda *a, backend, **kw: grouped(*a, backend="xla", **kw)
    elif variant == "dense_xla":
        dense = block_scaled.block_scaled_matmul
        block_scaled.block_scaled_matmul = lambda *a, backend, **kw: dense(*a, backend="xla", **kw)
    elif variant == "quant_xla":
        act, weight = operands.fp8_act, operands.fp8_weight
        operands.fp8_act = lambda x, backend=None: act(x, "xla")
        operands.fp8_weight = lambda w, backend=None: weight(w, "xla")


def _slice_shapes() -> dict:
    """The Qwen3-30B-A3B-shaped slice and its small twin as the long-sequence benchmark defines them (one definition)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks", "train_step_long.py")
    shapes = runpy.run_path(path)
    return {"SLICE": shapes["SLICE"], "TINY": shapes["TINY"]}


def main(argv=None) -> int:
    """Exit status 0 when every comparison is bit-identical, 1 otherwise."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", choices=VARIANTS, default="default", help="which FP8 piece runs the XLA path")
    ap.add_argument("--recipe", default="fp8_block", help="precision recipe (bf16 as the control)")
    ap.add_argument("--rows", type=int, default=4, help="rollout rows (one generate call)")
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens per row (random ids)")
    ap.add_argument("--new", type=int, default=64, help="response tokens per row (EOS ignored)")
    ap.add_argument("--layers", type=int, default=2, help="decoder layers of the slice")
    ap.add_argument("--small", action="store_true",
                    help="train_step_long's small slice instead (hidden 128, 4/2 heads of 64, 8 experts of 128 top-2, "
                         "vocab 512; every projection a multiple of 128, so the kernels take it): runs on CPU in seconds")
    args = ap.parse_args(argv)
    force_xla(args.variant)

    from jaxrl_fp8.model import random_policy, tiny_config
    from jaxrl_fp8.precision import get_recipe
    from jaxrl_fp8.rollout import sampling
    from jaxrl_fp8.rollout.embedded import EmbeddedEngine
    from jaxrl_fp8.rollout.types import SamplingParams

    shapes = _slice_shapes()["TINY" if args.small else "SLICE"]
    cfg = tiny_config(**{**shapes, "num_hidden_layers": args.layers, "attention_impl": "auto"})
    policy = random_policy(cfg, seed=7, dtype="bfloat16", recipe=get_recipe(args.recipe))
    engine = EmbeddedEngine(policy, max_batch=args.rows, max_seq_len=args.prompt + args.new)
    prompts = np.random.default_rng(1).integers(0, cfg.vocab_size, (args.rows, args.prompt)).tolist()
    t0 = time.perf_counter()
    samples = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=args.new, ignore_eos=True, seed=5))
    gen_s = time.perf_counter() - t0
    ids_all = np.stack([s.token_ids for s in samples]).astype(np.int32)
    rollout = np.stack([s.rollout_logprobs for s in samples])
    span = slice(args.prompt - 1, args.prompt - 1 + args.new)
    scored = {}
    for per_forward in sorted({1, args.rows}):
        parts = []
        for start in range(0, args.rows, per_forward):
            ids = ids_all[start:start + per_forward]
            logits = policy.forward(ids, precision="train").logits
            lp = sampling.token_logprobs(logits, np.roll(ids, -1, axis=1), np.ones(ids.shape, np.float32))
            parts.append(np.asarray(lp)[:, span])
        scored[per_forward] = np.concatenate(parts)
    same = True
    head = f"{args.variant:11s} {args.recipe} rows {args.rows} prompt {args.prompt} new {args.new} layers {args.layers}"
    for per_forward, lp in scored.items():
        d = lp - rollout
        same &= bool(np.all(d == 0))
        first = [int(np.argmax(r != 0)) if np.any(r != 0) else -1 for r in d]
        print(f"{head}: trainer ({per_forward} rows a forward) vs rollout: identical {np.mean(d == 0):.4f}, "
              f"max |dlogp| {np.abs(d).max():.3e}, first differing step per row {first[:8]}", flush=True)
    if len(scored) == 2:
        d = scored[1] - scored[args.rows]
        print(f"{head}: trainer 1 row vs {args.rows} rows a forward: identical {np.mean(d == 0):.4f}, "
              f"max {np.abs(d).max():.3e} (generate {gen_s:.1f} s)", flush=True)
        same &= bool(np.all(d == 0))
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
