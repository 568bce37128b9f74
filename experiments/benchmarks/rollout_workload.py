"""A realistic RL rollout on the embedded engine (issue 22): continuous batching vs the static engine, BF16 vs FP8.

Workload: `--prompts` prompts x `--samples` samples (default 64 x 16 = 1024 rows, a GRPO batch), prompts of exactly
`--prompt-len` random tokens (256), response lengths drawn per sample from a lognormal (median `--median-len`,
sigma `--sigma`) clipped to [1, `--max-len`] (8192), EOS forced at the drawn length (`max_new_tokens` = the
length, `ignore_eos`). Each sample is its own request (its own length); the 16 requests of a prompt carry the
same prompt, so the continuous scheduler prefills it once and shares its pages. Model: a Qwen3-30B-A3B-shaped
slice from random init (hidden 2048, 32 / 4 heads of 128, 128 experts of 768 top-8, vocab 151936, `--layers`
layers, every layer MoE).

Per recipe (bf16, fp8_block; fp8_block_kv adds the FP8 KV cache, `kv_cache="fp8"`) in one process:
- continuous: `EmbeddedEngine.generate` with `EngineConfig(scheduler="continuous")`, `--slots` decode slots;
- static: the static engine of today (`scheduler="static"`, chunks of `--slots` rows decoded until their longest
  row stops). `--static-order request` (default) hands it the rows `--slots` at a time in request order, which is
  what it does in RL, where every row asks for the same max_new_tokens and nobody knows the lengths; `sorted`
  gives it all rows in one call, so it sorts them by the (here known) lengths into chunks: a lower bound;
- the two must return the same samples bit for bit (recorded as `bitwise_equal`);
- a decode-step measurement at `--slots` active rows: `--step-new` tokens after `--prompt-len`-token prompts,
  (t(generate step_new) - t(generate step_new / 2)) / (step_new / 2), medians of interleaved runs, against the HBM
  roofline of the bytes those steps read
  (`--step-prompt-lens` adds points at longer caches, reported apart from the target's point)
  (weights in the rollout format, experts = those the batch routed to, measured; + the live KV), at the
  datasheet bandwidth and at the device-to-device copy bandwidth measured in the same run (as decode.py).
Compile time inside the timed runs is measured (jax.monitoring compile events) and reported; tokens/s are given
end to end and without it (`steady`, what an RL run sees after its first step). With `--passes 2` the steady figure
comes from a second pass over the same workload on the same engine, so one-off costs that no compile event counts
(first launches of newly compiled kernels) stay out of it, and the second pass must give the first's bits. The
continuous scheduler's last pass is split into its decode loops (`decode_loops_ms_per_step`: the step at the
workload's own caches and active rows) and the rest (`outside_decode_loops_s`: prefills, placements, collection;
`outside_split_s`: waiting for the prefills and placements on the device, collecting finished rows, the host's
admission work).

Targets (issue 22), met or missed in the JSON: continuous >= 3x static output tokens/s; decode steps >= 50 % of the
copy-bandwidth roofline at 256 active rows; FP8 >= 1.3x BF16 tokens/s (continuous): `fp8_over_bf16` for
fp8_block (BF16 keys and values), `fp8_kv_over_bf16` for fp8_block_kv.

    python experiments/benchmarks/rollout_workload.py          # the H200 run -> results/rollout_workload_<device>.json
    python experiments/benchmarks/rollout_workload.py --tiny   # CPU smoke run (< 2 minutes)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import decode as decode_bench  # noqa: E402  (bytes per step, experts touched)
import timing  # noqa: E402  (the copy-bandwidth anchor)
from model_slice import add_model_slice_args, apply_tiny_slice, model_config_from_args, slice_fields  # noqa: E402
from timing import run_header, write_results  # noqa: E402

TARGETS = {"continuous_over_static": 3.0, "roofline_fraction_at_slots": 0.5, "fp8_over_bf16": 1.3}
COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
                  "/jax/core/compile/backend_compile_duration")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="tiny model and workload: a CPU smoke run")
    add_model_slice_args(p, layers=4)  # Qwen3-30B-A3B's shapes: 128 experts top-8, vocab 151936
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--samples", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--max-len", type=int, default=8192, help="longest response (the lognormal is clipped here)")
    p.add_argument("--median-len", type=float, default=1024.0)
    p.add_argument("--sigma", type=float, default=1.0)
    p.add_argument("--slots", type=int, default=256, help="EngineConfig.max_batch (decode slots / static chunk rows)")
    p.add_argument("--kv-pages", type=int, default=0, help="EngineConfig.kv_pages (0: slots x pages of the longest row)")
    p.add_argument("--refill-every", type=int, default=64, help="EngineConfig.refill_every")
    p.add_argument("--refill-batch", type=int, default=0,
                   help="EngineConfig.refill_batch (0: the engine's default, slots // 32): finished slots per refill")
    p.add_argument("--recipes", default="bf16,fp8_block",
                   help="comma list of recipes (precision.RECIPES), e.g. bf16,fp8_block,fp8_block_kv")
    p.add_argument("--schedulers", default="continuous,static")
    p.add_argument("--static-order", default="request", choices=["request", "sorted"])
    p.add_argument("--step-new", type=int, default=64, help="tokens of the decode-step measurement (<= --max-len)")
    p.add_argument("--step-prompt-lens", default="",
                   help="comma list of longer prompt lengths for more decode-step points (the KV read of a step grows with "
                        "the cache; the workload's mean cache is ~1.3k tokens); the target's point stays at --prompt-len")
    p.add_argument("--repeats", type=int, default=3,
                   help="timed runs of each length in the step measurement (medians reported, every run kept)")
    p.add_argument("--attention", default="auto", choices=["auto", "flash", "xla", "exact"])
    p.add_argument("--mode", default="bitwise", choices=["bitwise", "fast"],
                   help="bitwise: the engine as it ships (row-invariant products); fast: the non-bitwise engine for "
                        "comparison - JAXRL_FP8_HIGH_PRECISION=xla (router, lm_head and BF16 projections as cuBLAS dots), "
                        "set before any program is traced, so run it as its own process. The attention stays --attention: "
                        "the 'xla' path would read the paged pool as a dense cache every step, no fair fast engine, and "
                        "the paged flash kernel is at 89-100 %% of the KV roofline at 256 rows with 4k-16k caches")
    p.add_argument("--passes", type=int, default=1,
                   help="runs of the whole workload on each engine: the first is end to end (compilation included); "
                        "with 2 or more the steady figures come from the last, on programs already compiled and loaded "
                        "(what an RL run's later steps see: one-off costs the compile events do not count, e.g. first "
                        "launches of new kernels, do not enter it), and every pass must give the same bits")
    p.add_argument("--copy-mib", type=int, default=2048)
    p.add_argument("--progress", action="store_true", help="tqdm bar of the continuous scheduler")
    p.add_argument("--static-shapes", action="store_true",
                   help="EngineConfig.static_shapes: one program per engine (--tiny: compile time dominates on CPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    p.add_argument("--append", action="store_true",
                   help="keep the points of other recipes already in --out (one recipe per device command, one JSON)")
    p.add_argument("--merge", default="",
                   help="comma list of result JSONs of the same workload (one recipe each): merge them into --out (no run)")
    args = p.parse_args(argv)
    if args.passes < 1:
        p.error(f"--passes must be at least 1; got {args.passes}")
    if args.tiny:
        apply_tiny_slice(args)
        args.prompts, args.samples, args.prompt_len, args.max_len, args.median_len = 3, 4, 12, 40, 8.0
        args.slots, args.refill_every, args.step_new, args.repeats, args.copy_mib = 4, 8, 8, 1, 16
        args.static_shapes = True
    try:
        args.step_prompt_lens = [int(x) for x in args.step_prompt_lens.split(",") if x.strip()]
    except ValueError:
        p.error(f"--step-prompt-lens must be a comma list of ints; got {args.step_prompt_lens!r}")
    for plen in args.step_prompt_lens:
        if not 1 <= plen <= args.prompt_len + args.max_len - args.step_new:
            p.error(f"--step-prompt-lens: {plen} must be in [1, prompt-len + max-len - step-new = "
                    f"{args.prompt_len + args.max_len - args.step_new}]")
    return args


def draw_lengths(args, rng) -> np.ndarray:
    n = args.prompts * args.samples
    raw = rng.lognormal(mean=math.log(args.median_len), sigma=args.sigma, size=n)
    return np.clip(np.rint(raw), 1, args.max_len).astype(np.int64)


def mean_decode_cache(lengths: np.ndarray, prompt_len: int) -> float:
    """The cache length a decode step reads, averaged over the decoded tokens: token j >= 1 of a response is drawn
    over prompt_len + j cached tokens (token 0 comes from the prefill), so long responses weigh in with their
    length. The decode step's roofline fraction at this length is the workload's typical one."""
    lengths = np.asarray(lengths, np.float64)
    decoded = np.maximum(lengths - 1, 0)
    return float(prompt_len + (decoded * (decoded + 1) / 2).sum() / max(decoded.sum(), 1.0))


def step_counts(lengths: np.ndarray, samples: int, slots: int) -> dict:
    """Decode steps each scheduler needs on these lengths, from the lengths alone (no model): static chunks of
    `slots` rows in request order / sorted by length (a chunk runs to its longest row), and continuous slots refilled
    the moment a row ends, prompt groups longest first (the scheduler's order). The ratio bounds what continuous
    batching can gain if a step cost the same at any number of active rows."""
    import heapq

    chunks = lambda xs: [xs[i : i + slots] for i in range(0, len(xs), slots)]  # noqa: E731
    groups = sorted((list(range(g, g + samples)) for g in range(0, len(lengths), samples)),
                    key=lambda g: -max(lengths[i] for i in g))
    queue = [i for g in groups for i in g][::-1]
    running, t = [], 0
    while queue or running:
        while queue and len(running) < slots:
            heapq.heappush(running, t + int(lengths[queue.pop()]))
        t = heapq.heappop(running)
    return {"static_request_order": int(sum(c.max() for c in chunks(lengths))),
            "static_sorted": int(sum(c.max() for c in chunks(np.sort(lengths)))),
            "continuous": int(t), "all_slots_busy": float(lengths.sum() / slots)}


class CompileClock:
    """Seconds spent tracing / lowering / compiling while it is active (jax.monitoring events)."""

    def __init__(self):
        import jax

        self.total, self.active = 0.0, False
        jax.monitoring.register_event_duration_secs_listener(self._on)

    def _on(self, event, duration, **_):
        if self.active and event in COMPILE_EVENTS:
            self.total += duration

    def __enter__(self):
        self.total, self.active = 0.0, True
        return self

    def __exit__(self, *exc):
        self.active = False


def run_workload(engine, scheduler, prompts, params, slots, order, clock):
    """(samples, wall seconds, compile seconds, stats) of the whole workload on one engine."""
    t = time.perf_counter()
    with clock:
        if scheduler == "static" and order == "request":
            samples, stats = [], {"chunks": 0.0}
            for i in range(0, len(prompts), slots):
                samples += engine.generate(prompts[i : i + slots], params[i : i + slots])
                stats["chunks"] += 1
        else:
            samples = engine.generate(prompts, params)
            stats = dict(engine.last_stats)
    return samples, time.perf_counter() - t, clock.total, stats


def same_bits(a, b) -> bool:
    return len(a) == len(b) and all(
        np.array_equal(x.response_ids, y.response_ids)
        and np.array_equal(x.rollout_logprobs.view(np.uint32), y.rollout_logprobs.view(np.uint32)) for x, y in zip(a, b))


def step_measurement(engine_cls, policy, engine_config, cfg, args, rng, bw_copy):
    """Decode step time at `--slots` active rows and its roofline (see the module docstring), on the continuous
    engine of the workload (its response buffer holds step_new tokens, so the half-length run has the same shapes).
    The step is the difference of two generates that pay the same prefill and per-call costs
    (`decode.time_decode`: step_new and step_new / 2 tokens, medians of interleaved runs)."""
    n = args.step_new
    h = n // 2
    engine = engine_cls(policy, engine_config=dataclasses.replace(
        engine_config, scheduler="continuous", progress=False, refill_every=max(n, engine_config.refill_every)))
    prompts = rng.integers(0, cfg.vocab_size, size=(args.slots, args.prompt_len)).tolist()
    samples, _, t_full, t_half, times_full, times_half = decode_bench.time_decode(engine, prompts, n, args.repeats)
    touched = decode_bench.distinct_experts_per_step(samples, args.prompt_len, n, cfg.num_experts)
    cache_len = args.prompt_len + n
    # the timed steps are the last n - h of the full run: their live caches start at prompt_len + h
    sb = decode_bench.step_bytes(engine, cfg, args.slots, args.prompt_len + h, n - h, cache_len, touched,
                                 kv_itemsize=decode_bench.kv_itemsize(engine, cfg))
    decode_s = t_full - t_half
    step_s = decode_s / (n - h) if decode_s > 0 and n > h else math.nan
    ideal = sb["weights_read"] + sb["kv_read_live"]
    roof_step_s = ideal / bw_copy
    return {
        "rows": args.slots, "prompt_len": args.prompt_len, "new_tokens": n,
        "generate_s": t_full, "generate_half_s": t_half, "timed_steps": n - h,
        "generate_s_runs": times_full, "generate_half_s_runs": times_half,
        "step_ms": step_s * 1e3 if math.isfinite(step_s) else None,
        "bytes_per_step": sb, "experts_touched_per_layer": touched,
        "roofline_step_ms_at_copy_bw": roof_step_s * 1e3,
        "roofline_step_ms_at_spec_bw": ideal / spec * 1e3 if (spec := timing.hbm_spec_bandwidth()) else None,
        "fraction_of_copy_roofline": roof_step_s / step_s if math.isfinite(step_s) else None,
    }


def mode_of(point: dict) -> str:
    """A point's engine mode (`--mode`); points written before the flag existed are bitwise."""
    return point.get("mode", "bitwise")


def key_of(point: dict) -> tuple[str, str]:
    return point["recipe"], mode_of(point)


# comparison entries recorded while the points run (continuous vs static samples, per recipe), not recomputed,
# with the mode of the points they compare
RECORDED = {"bitwise_equal": "bitwise", "fast_mode_schedulers_equal": "fast"}


def compare(results: list[dict], steps: list[dict], recorded: dict) -> dict:
    """The targets' ratios over every recipe's points (steady tokens/s: what an RL run sees after its first step;
    end to end beside it), met or missed."""
    comparison: dict = {k: dict(recorded[k]) for k in RECORDED if recorded.get(k)}

    def point(recipe, scheduler, mode="bitwise"):
        return next((p for p in results if p["recipe"] == recipe and p["scheduler"] == scheduler
                     and mode_of(p) == mode), None)

    for recipe_name in sorted({p["recipe"] for p in results}):
        c, s = point(recipe_name, "continuous"), point(recipe_name, "static")
        if c and s:
            ratio = c["steady_tokens_per_s"] / s["steady_tokens_per_s"]
            comparison.setdefault("continuous_over_static", {})[recipe_name] = {
                "steady": ratio, "end_to_end": c["tokens_per_s"] / s["tokens_per_s"],
                "target": TARGETS["continuous_over_static"], "met": ratio >= TARGETS["continuous_over_static"]}
    for recipe_name in sorted({p["recipe"] for p in results}):
        c, f = point(recipe_name, "continuous"), point(recipe_name, "continuous", "fast")
        if c and f:  # what bit-exactness costs: the non-bitwise engine's tokens/s over the bitwise one's
            comparison.setdefault("fast_over_bitwise", {})[recipe_name] = {
                "steady": f["steady_tokens_per_s"] / c["steady_tokens_per_s"], "end_to_end": f["tokens_per_s"] / c["tokens_per_s"],
                "bitwise_cost_steady": 1.0 - c["steady_tokens_per_s"] / f["steady_tokens_per_s"]}
    for step in steps:
        if mode_of(step) != "bitwise":
            continue
        f = step["fraction_of_copy_roofline"]
        entry = {"fraction": f, "target": TARGETS["roofline_fraction_at_slots"],
                 "met": f is not None and f >= TARGETS["roofline_fraction_at_slots"]}
        if step.get("target_point", True):  # at the workload's prompt length (not a --step-prompt-lens point)
            comparison.setdefault("roofline_fraction_at_slots", {})[step["recipe"]] = entry
        else:  # informative: the step at a longer cache, where the KV read weighs more (not the target's point)
            comparison.setdefault("roofline_fraction_at_longer_caches", {}).setdefault(
                str(step["prompt_len"] + step["new_tokens"]), {})[step["recipe"]] = entry
    b = point("bf16", "continuous")
    # fp8_block keeps a BF16 KV cache; fp8_block_kv also reads FP8 keys and values (kv_cache="fp8")
    for key, name in (("fp8_over_bf16", "fp8_block"), ("fp8_kv_over_bf16", "fp8_block_kv")):
        f8 = point(name, "continuous")
        if b and f8:
            ratio = f8["steady_tokens_per_s"] / b["steady_tokens_per_s"]
            comparison[key] = {"steady": ratio, "end_to_end": f8["tokens_per_s"] / b["tokens_per_s"],
                               "target": TARGETS["fp8_over_bf16"], "met": ratio >= TARGETS["fp8_over_bf16"]}
    return comparison


def merge(paths: list[str], out: str) -> dict:
    """One result from runs of the same workload and model (one recipe per device command): their points side by
    side, the comparisons recomputed over all of them. A point of a recipe in a later file replaces an earlier one."""
    docs = []
    for path in paths:
        with open(path) as f:
            docs.append(json.load(f))
    first = docs[0]
    same_model = lambda d: {k: v for k, v in d.get("model", {}).items() if k != "attention_impl"}  # noqa: E731
    for path, doc in zip(paths[1:], docs[1:]):
        for key in ("workload", "engine"):
            if doc.get(key) != first.get(key):
                raise SystemExit(f"--merge: {path} has another {key} than {paths[0]}")
        if same_model(doc) != same_model(first):
            raise SystemExit(f"--merge: {path} has another model than {paths[0]}")
    results, steps, recorded = [], [], {}
    for doc in docs:
        keys = {key_of(p) for p in doc["results"]} | {key_of(p) for p in doc["decode_step"]}
        results = [p for p in results if key_of(p) not in keys] + doc["results"]
        steps = [p for p in steps if key_of(p) not in keys] + doc["decode_step"]
        for k in RECORDED:
            recorded.setdefault(k, {}).update(doc.get("comparison", {}).get(k, {}))
    bitwise_docs = [d for d in docs if d.get("mode", "bitwise") == "bitwise"] or docs
    merged = dict(bitwise_docs[-1], results=results, decode_step=steps, complete=all(d.get("complete") for d in docs),
                  comparison=compare(results, steps, recorded),
                  merged_from=[{"command": d["command"], "date": d["date"], "bandwidth": d["bandwidth"]} for d in docs])
    write_results(out, merged)
    return merged


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.merge:
        if not args.out:
            raise SystemExit("--merge needs --out")
        merged = merge(args.merge.split(","), args.out)
        for name, entry in merged["comparison"].items():
            print(f"{name}: {json.dumps(entry)}")
        print(f"wrote {args.out}")
        return 0
    if args.mode == "fast":  # before anything is traced: ops.high_precision reads it when a program is built
        from jaxrl_fp8.ops.high_precision import ENV

        os.environ[ENV] = "xla"
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxrl_fp8.model import Policy, Qwen3
    from jaxrl_fp8.precision import get_recipe
    from jaxrl_fp8.rollout.embedded import EmbeddedEngine, EngineConfig
    from jaxrl_fp8.rollout.types import SamplingParams
    from pallas_kernels.attention import FlashConfig  # the kernels' settings the run used

    dev = jax.devices()[0]
    cfg = model_config_from_args(args, max_position_embeddings=max(8192, args.prompt_len + args.max_len))
    model = Qwen3(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(args.seed))
    counts = decode_bench.param_counts(cfg, model)
    rng = np.random.default_rng(args.seed)
    lengths = draw_lengths(args, rng)
    base_prompts = rng.integers(0, cfg.vocab_size, size=(args.prompts, args.prompt_len)).tolist()
    prompts, params = [], []
    for i, prompt in enumerate(base_prompts):
        for j in range(args.samples):
            r = i * args.samples + j
            prompts.append(prompt)
            params.append(SamplingParams(temperature=1.0, max_new_tokens=int(lengths[r]), ignore_eos=True,
                                         seed=(1000 * i + j) % (2**31 - 1)))
    total_tokens = int(lengths.sum())
    print(f"device {dev.device_kind} ({dev.platform}); model {counts['total'] / 1e9:.3f}B params; "
          f"{len(prompts)} rows, {total_tokens} response tokens (mean {lengths.mean():.0f}, max {lengths.max()})", flush=True)
    print(f"decode steps from the lengths alone: {step_counts(lengths, args.samples, args.slots)}", flush=True)
    bw_copy = timing.copy_bandwidth(args.copy_mib)
    print(f"copy bandwidth {bw_copy / 1e12:.3f} TB/s", flush=True)
    clock = CompileClock()
    path = args.out or os.path.join(HERE, "results", f"rollout_workload_{'cpu_tiny' if args.tiny else dev.platform}.json")
    results, steps = [], []
    comparison: dict = {}
    recipes = args.recipes.split(",")
    if args.append and os.path.exists(path):  # keep the other recipes' points of an earlier run (same workload)
        with open(path) as f:
            prior = json.load(f)
        if prior.get("workload", {}).get("response_tokens") != total_tokens or prior.get("model", {}).get("num_hidden_layers") != cfg.num_hidden_layers:
            raise SystemExit(f"--append: {path} holds another workload or model; use another --out")
        mine = {(r, args.mode) for r in recipes}
        results += [p for p in prior["results"] if key_of(p) not in mine]
        steps += [p for p in prior["decode_step"] if key_of(p) not in mine]
        for name, mode in RECORDED.items():
            kept = {p["recipe"] for p in results if mode_of(p) == mode}
            comparison[name] = {k: v for k, v in prior.get("comparison", {}).get(name, {}).items() if k in kept}

    def write(complete: bool):
        out = {
            "benchmark": "embedded engine RL rollout workload: continuous batching vs static chunks (issue 22)",
            **run_header("rollout_workload.py", argv),
            "tiny": args.tiny,
            "mode": args.mode,
            "model": slice_fields(cfg),
            "params": counts,
            "workload": {
                "prompts": args.prompts, "samples_per_prompt": args.samples, "rows": len(prompts),
                "prompt_len": args.prompt_len, "length_distribution": f"lognormal(median {args.median_len}, sigma {args.sigma}) "
                f"clipped to [1, {args.max_len}]; EOS forced at the drawn length (max_new_tokens, ignore_eos)",
                "response_tokens": total_tokens,
                "length_stats": {"mean": float(lengths.mean()), "p50": float(np.percentile(lengths, 50)),
                                 "p90": float(np.percentile(lengths, 90)), "p99": float(np.percentile(lengths, 99)),
                                 "max": int(lengths.max()), "at_cap": int((lengths == args.max_len).sum()),
                                 "mean_decode_cache": mean_decode_cache(lengths, args.prompt_len)},
                "sampling": "temperature 1, no top-k / top-p, one request per sample (the prompt repeated), per-sample seeds",
                "decode_steps_from_lengths": step_counts(lengths, args.samples, args.slots),
            },
            "engine": {"slots": args.slots, "kv_pages": args.kv_pages, "refill_every": args.refill_every,
                       "refill_batch": EngineConfig(max_batch=args.slots, refill_batch=args.refill_batch).effective_refill_batch,
                       "static_order": args.static_order, "static_shapes": args.static_shapes,
                       "flash_config": dataclasses.asdict(FlashConfig())},
            "bandwidth": {"hbm_spec_Bps": timing.hbm_spec_bandwidth(), "copy_measured_Bps": bw_copy, "copy_mib": args.copy_mib},
            "notes": [
                "tokens_per_s = response tokens / wall of the first pass; steady_tokens_per_s = response tokens / "
                "(wall - compile_s) of the last pass (--passes; with one pass, the first), compile_s from jax.monitoring "
                "compile events inside the timed run; passes after the first gave the first's bits (checked)",
                "static with static_order=request: rows handed over --slots at a time in request order (RL: lengths "
                "unknown); static_order=sorted: one call, the engine sorts rows by their known lengths",
                "decode_step: roofline = weights read once per step (experts the batch routed to, measured) + live KV; "
                "activations / logits traffic not counted, so the roofline is an upper bound",
            ],
            "targets": TARGETS,
            "complete": complete,
            "results": results,
            "decode_step": steps,
            "comparison": comparison,
        }
        write_results(path, out)

    schedulers = args.schedulers.split(",")
    for recipe_name in recipes:
        recipe = get_recipe(recipe_name)
        policy = Policy(model, recipe=recipe)
        by_scheduler = {}
        for scheduler in schedulers:
            seq = args.prompt_len + args.max_len
            ec = EngineConfig(
                max_batch=args.slots, max_seq_len=seq, kv_pages=args.kv_pages, refill_every=args.refill_every,
                refill_batch=args.refill_batch,
                scheduler=scheduler, progress=args.progress and scheduler == "continuous", static_shapes=args.static_shapes,
                # every static chunk shares the response-buffer and cache-length buckets: one program per pool size
                min_new_bucket=1 << (args.max_len - 1).bit_length(), min_cache_bucket=1 << (seq - 1).bit_length())
            engine = EmbeddedEngine(policy, engine_config=ec)
            passes = []
            for i in range(args.passes):
                run = run_workload(engine, scheduler, prompts, params, args.slots, args.static_order, clock)
                if passes and not same_bits(passes[0][0], run[0]):
                    raise RuntimeError(f"{recipe_name} / {scheduler}: pass {i + 1} gave other bits than pass 1")
                passes.append(run)
            samples, wall, compile_s, _ = passes[0]
            _, last_wall, last_compile_s, stats = passes[-1]
            produced = sum(s.response_ids.size for s in samples)
            assert produced == total_tokens, (produced, total_tokens)
            steady = max(last_wall - last_compile_s, 1e-9)
            point = {"recipe": recipe_name, "mode": args.mode, "rollout_format": recipe.rollout_format, "scheduler": scheduler,
                     "wall_s": wall, "compile_s": compile_s, "tokens_per_s": produced / wall,
                     "steady_tokens_per_s": produced / steady, "stats": stats,
                     "passes": [{"wall_s": w, "compile_s": c} for _, w, c, _ in passes],
                     "steady_from": "last pass" if args.passes > 1 else "first pass minus its compile events"}
            if stats.get("decode_steps"):
                point["mean_step_ms_steady"] = steady / stats["decode_steps"] * 1e3
            if stats.get("decode_seconds"):  # continuous: the last pass's wall inside decode loops and outside them
                point["decode_loops_ms_per_step"] = stats["decode_seconds"] / stats["decode_steps"] * 1e3
                point["outside_decode_loops_s"] = last_wall - stats["decode_seconds"]
                point["outside_split_s"] = {k: stats[f"{k}_seconds"] for k in ("sync", "collect", "admit")}
            by_scheduler[scheduler] = samples
            results.append(point)
            again = f", last pass {last_wall:.2f}s (compile {last_compile_s:.2f}s)" if args.passes > 1 else ""
            print(f"{recipe_name:10s} {scheduler:10s}: wall {wall:8.2f}s (compile {compile_s:6.2f}s{again})  "
                  f"{point['tokens_per_s']:10.1f} tok/s  steady {point['steady_tokens_per_s']:10.1f} tok/s  "
                  f"steps {stats.get('decode_steps', float('nan')):.0f}  active {stats.get('mean_active_slots', float('nan')):.1f}"
                  + (f"  in decode loops {point['decode_loops_ms_per_step']:.3f} ms/step, outside "
                     f"{point['outside_decode_loops_s']:.2f}s ("
                     + ", ".join(f"{k} {v:.2f}s" for k, v in point["outside_split_s"].items()) + ")"
                     if "decode_loops_ms_per_step" in point else ""), flush=True)
            del engine
            write(False)
        if len(by_scheduler) > 1:
            key = "bitwise_equal" if args.mode == "bitwise" else "fast_mode_schedulers_equal"
            comparison.setdefault(key, {})[recipe_name] = same_bits(*by_scheduler.values())
        del by_scheduler
        for plen in [args.prompt_len] + [p for p in args.step_prompt_lens if p != args.prompt_len]:
            step = step_measurement(EmbeddedEngine, policy, ec, cfg, argparse.Namespace(**{**vars(args), "prompt_len": plen}),
                                    rng, bw_copy)
            step["recipe"], step["mode"], step["target_point"] = recipe_name, args.mode, plen == args.prompt_len
            steps.append(step)
            print(f"{recipe_name:10s} decode step at {args.slots} rows, {plen}-token prompts: "
                  f"{step['step_ms'] or float('nan'):.3f} ms, roofline {step['roofline_step_ms_at_copy_bw']:.3f} ms "
                  f"({100 * (step['fraction_of_copy_roofline'] or math.nan):.1f} %)", flush=True)
            write(False)

    comparison = compare(results, steps, comparison)
    write(True)

    print("\n| recipe | scheduler | wall s | compile s | tok/s | steady tok/s | decode steps | mean active |")
    print("|---|---|---|---|---|---|---|---|")
    for p in results:
        st = p["stats"]
        print(f"| {p['recipe']} | {p['scheduler']} | {p['wall_s']:.2f} | {p['compile_s']:.2f} | {p['tokens_per_s']:.1f} | "
              f"{p['steady_tokens_per_s']:.1f} | {st.get('decode_steps', float('nan')):.0f} | {st.get('mean_active_slots', float('nan')):.1f} |")
    for name, entry in comparison.items():
        print(f"{name}: {json.dumps(entry)}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
