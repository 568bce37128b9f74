"""Decode throughput of the embedded JAX rollout engine, BF16 vs block-FP8, against the HBM roofline.

A ~1B-parameter random Qwen3-MoE (default: Qwen3-30B-A3B's layer shapes — hidden 2048, 32 query / 4 KV
heads of 128, expert intermediate 768, top-4 — with 32 experts and 6 layers, vocab 32768) generates
`--gen-len` tokens after `--prompt-len`-token prompts at each batch size. Per (format, batch) the JSON
holds: end-to-end tokens/s of `engine.generate`, decode-only tokens/s (generate minus a generate of half the
tokens: prefill and per-call costs cancel, `time_decode`), and the roofline of one decode step:

    bytes/step = weights read (attention + dense + router + lm_head + the experts the batch touches, in the
                 format's storage: BF16 = 2 B/elem, FP8 = 1 B/elem + scales)
               + KV cache read (per row, the live length; and the full cache length our kernels scan)
    roofline tokens/s = batch / (bytes/step / bandwidth)

for the H200's 4.8 TB/s and for the device-to-device copy bandwidth measured in the same run. Distinct
experts per step come from the routed experts the engine returned (not from a formula).

    python experiments/benchmarks/decode.py                 # GPU: the full benchmark
    python experiments/benchmarks/decode.py --tiny          # CPU smoke run (seconds of compute)
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from model_slice import add_model_slice_args, apply_tiny_slice, model_config_from_args, slice_fields  # noqa: E402
import timing  # noqa: E402
from timing import write_results  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="tiny model, small batches: a CPU smoke test")
    add_model_slice_args(p, layers=6, experts=32, top_k=4, vocab=32768)
    p.add_argument("--batches", default="1,32,256", help="comma-separated batch sizes")
    p.add_argument("--recipes", default="bf16,fp8_block", help="comma-separated recipe names (rollout format runs)")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--gen-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3, help="timed runs of each length per point (medians reported)")
    p.add_argument("--attention", default="auto", choices=["auto", "flash", "xla", "exact"],
                   help="model attention_impl: auto (the flash kernels on a Hopper GPU, exact on CPU), flash, xla "
                   "(einsum, not row invariant), exact (the row-invariant scan)")
    p.add_argument("--decode-loop", default="while", choices=["while", "python"])
    p.add_argument("--copy-mib", type=int, default=2048, help="size of the bandwidth-measuring copy")
    p.add_argument("--out", default=None, help="JSON path (default: experiments/benchmarks/results/decode_<device>.json)")
    args = p.parse_args(argv)
    if args.tiny:
        apply_tiny_slice(args)
        args.batches, args.prompt_len, args.gen_len, args.repeats, args.copy_mib = "1,4", 16, 16, 3, 64
    return args


def param_counts(cfg, model) -> dict:
    """Total parameters counted on the model itself; active-per-token from the config."""
    from flax import nnx

    total = sum(int(np.prod(v.get_value().shape)) for _, v in nnx.to_flat_state(nnx.state(model, nnx.Param)))
    h, L = cfg.hidden_size, cfg.num_hidden_layers
    attn = h * cfg.num_attention_heads * cfg.head_dim * 2 + h * cfg.num_key_value_heads * cfg.head_dim * 2
    expert = 3 * h * cfg.moe_intermediate_size
    norms = 2 * h + 2 * cfg.head_dim
    router = cfg.num_experts * h
    per_layer_total = attn + cfg.num_experts * expert + router + norms
    per_layer_active = attn + cfg.num_experts_per_tok * expert + router + norms
    embed = lm_head = cfg.vocab_size * h
    assert total == L * per_layer_total + embed + lm_head + h, "parameter formula out of date with the model"
    return {
        "total": total,
        "active_per_token": L * per_layer_active + lm_head + h + h,  # + one embedding row, final norm
        "experts": L * cfg.num_experts * expert,
        "embedding": embed,
        "lm_head": lm_head,
    }


def classify(path: str) -> str:
    if path.startswith("embed."):
        return "embedding"
    if path.startswith("lm_head."):
        return "lm_head"
    if ".moe." in path and not path.endswith("router.weight"):
        return "experts"
    return "always"  # attention, dense MLPs, norms, router


def distinct_experts_per_step(samples, prompt_len: int, gen_len: int, num_experts: int) -> float:
    """Mean over decode steps and MoE layers of the number of distinct experts the batch routes to
    (`rl.routing_stats.decode_experts_touched` on the samples' R3 routing; every row: prompt_len + gen_len tokens)."""
    from jaxrl_fp8.rl.routing_stats import decode_experts_touched

    routed = np.stack([s.routed_experts for s in samples])  # [B, P + T - 1, L, k]
    b = len(samples)
    touched = decode_experts_touched(routed, np.full(b, prompt_len), np.full(b, gen_len), num_experts)
    return 0.0 if np.isnan(touched) else touched


def kv_itemsize(engine, cfg) -> float:
    """Bytes a cached key or value element costs the engine's recipe: 2 (BF16), or e4m3 plus a float32 scale per
    head_dim elements (kv_cache="fp8", precision.kv)."""
    from jaxrl_fp8.precision.kv import kv_cache_of

    return 1 + 4 / cfg.head_dim if kv_cache_of(engine.precision) == "fp8" else 2


def step_bytes(engine, cfg, batch: int, prompt_len: int, gen_len: int, cache_len: int, experts_touched: float,
               kv_itemsize: float) -> dict:
    by_kind = {"always": 0, "experts": 0, "lm_head": 0, "embedding": 0}
    for path, n in engine.weight_nbytes().items():
        by_kind[classify(path)] += n
    if cfg.tie_word_embeddings:
        by_kind["lm_head"] = by_kind["embedding"]
    moe_layers = len(cfg.moe_layers)
    expert_frac = experts_touched / cfg.num_experts if cfg.num_experts else 0.0
    weights = by_kind["always"] + by_kind["experts"] * expert_frac + by_kind["lm_head"]
    weights += by_kind["embedding"] / cfg.vocab_size * batch  # the embedding rows looked up
    kv_per_token = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * kv_itemsize
    mean_live = prompt_len + (gen_len - 1) / 2.0
    return {
        "weights_stored": by_kind,
        "moe_layers": moe_layers,
        "experts_touched_per_layer": experts_touched,
        "weights_read": weights,
        "kv_read_live": batch * mean_live * kv_per_token,
        "kv_read_full_cache": batch * cache_len * kv_per_token,
    }


def time_decode(engine, prompts, n: int, repeats: int):
    """Decode steps timed as the difference of two generates that pay the same prefill and per-call costs: n and
    n // 2 new tokens (both compiled first, one program when the engine's buckets hold n), medians of interleaved
    runs. A 1-token generate skips the decode loop altogether, and its time moved by 20-30 ms between runs of one
    build (H100, 2026-12-07), which moved a 256-row step by 0.4 ms.
    Returns (samples of the n-token run, first-call seconds, t_n, t_half, every t_n, every t_half)."""
    from jaxrl_fp8.rollout.types import SamplingParams

    full = SamplingParams(temperature=1.0, max_new_tokens=n, ignore_eos=True, seed=1)
    half = SamplingParams(temperature=1.0, max_new_tokens=n // 2, ignore_eos=True, seed=1)
    t = time.perf_counter()
    samples = engine.generate(prompts, full, return_routed_experts=True)  # compiles
    first_s = time.perf_counter() - t
    engine.generate(prompts, half)
    runs_full, runs_half = [], []
    for _ in range(repeats):
        for params, times in ((full, runs_full), (half, runs_half)):
            t = time.perf_counter()
            engine.generate(prompts, params)
            times.append(time.perf_counter() - t)
    assert all(s.response_ids.size == n for s in samples)
    return samples, first_s, float(np.median(runs_full)), float(np.median(runs_half)), runs_full, runs_half


def main(argv=None) -> int:
    args = parse_args(argv)
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxrl_fp8.model import Policy, Qwen3
    from jaxrl_fp8.ops.high_precision import effective_form
    from jaxrl_fp8.precision import get_recipe
    from jaxrl_fp8.rollout.embedded import EmbeddedEngine, EngineConfig

    dev = jax.devices()[0]
    cfg = model_config_from_args(args, max_position_embeddings=8192)
    model = Qwen3(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    counts = param_counts(cfg, model)
    print(f"device {dev.device_kind} ({dev.platform}); model {counts['total'] / 1e9:.3f}B params, "
          f"{counts['active_per_token'] / 1e9:.3f}B active per token", flush=True)
    bw_copy = timing.copy_bandwidth(args.copy_mib)
    print(f"copy bandwidth {bw_copy / 1e12:.3f} TB/s", flush=True)
    path = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                    f"decode_{'cpu_tiny' if args.tiny else dev.platform}.json")

    def write(complete: bool):
        """Rewritten after every point (temp file + rename), so a run cut short keeps what it measured."""
        out = {
            "benchmark": "embedded engine decode throughput",
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": {"platform": dev.platform, "kind": dev.device_kind, "count": jax.device_count()},
            "software": {"jax": jax.__version__, "python": platform.python_version()},
            "tiny": args.tiny,
            "model": slice_fields(cfg),
            "params": counts,
            "prompt_len": args.prompt_len,
            "gen_len": args.gen_len,
            "sampling": "temperature 1, no top-k/top-p, ignore_eos, routed experts returned",
            "decode_loop": args.decode_loop,
            "high_precision_form": effective_form(),  # router / lm_head / BF16 dense products (ops.high_precision)
            "bandwidth": {"hbm_spec_Bps": timing.hbm_spec_bandwidth(), "copy_measured_Bps": bw_copy, "copy_mib": args.copy_mib},
            "notes": [
                "decode_tokens_per_s = batch*(gen_len - gen_len//2) / (t(generate gen_len) - t(generate gen_len//2)), "
                "medians of interleaved runs: prefill and per-call costs cancel",
                "roofline ideal = weights read once per step (experts: those the batch routed to, measured) + live KV; "
                "as_run additionally counts the full KV-cache length the attention kernel scans",
                "the activation / logits traffic is not counted, so the roofline is an upper bound",
            ],
            "complete": complete,
            "results": results,
        }
        write_results(path, out)

    batches = [int(b) for b in args.batches.split(",")]
    rng = np.random.default_rng(0)
    results = []
    # batch-major: a run stopped at a time limit still has every recipe at the batches it reached
    for batch in batches:
        for recipe_name in args.recipes.split(","):
            recipe = get_recipe(recipe_name)
            engine = EmbeddedEngine(Policy(model, recipe=recipe), engine_config=EngineConfig(
                max_batch=batch, max_seq_len=args.prompt_len + args.gen_len, decode_loop=args.decode_loop,
                min_new_bucket=args.gen_len))  # one program serves the gen_len and the half-length runs
            prompts = rng.integers(0, cfg.vocab_size, size=(batch, args.prompt_len)).tolist()
            samples, compile_s, t_full, t_half, runs_full, runs_half = time_decode(engine, prompts, args.gen_len, args.repeats)
            half = args.gen_len // 2
            steps = args.gen_len - half  # the decode steps the two runs differ by
            cache_len = max(16, 1 << (args.prompt_len + args.gen_len - 1).bit_length())  # the engine's bucket
            touched = distinct_experts_per_step(samples, args.prompt_len, args.gen_len, cfg.num_experts)
            # the timed steps are the full run's last `steps`: their live caches start at prompt_len + half
            sb = step_bytes(engine, cfg, batch, args.prompt_len + half, steps, cache_len, touched,
                            kv_itemsize=kv_itemsize(engine, cfg))
            decode_s = t_full - t_half
            if decode_s <= 0:  # timing noise larger than the decode itself (tiny runs): report nothing
                print(f"warning: generate {args.gen_len} ({t_full:.4f}s) was not slower than generate {half} "
                      f"({t_half:.4f}s); no decode rate")
                decode_s = math.nan
            decode_tps = batch * steps / decode_s
            ideal = sb["weights_read"] + sb["kv_read_live"]
            as_run = sb["weights_read"] + sb["kv_read_full_cache"]
            point = {
                "recipe": recipe_name,
                "rollout_format": recipe.rollout_format,
                "batch": batch,
                "compile_and_first_run_s": compile_s,
                "generate_s": t_full,
                "generate_half_s": t_half,
                "timed_steps": steps,
                "generate_s_runs": runs_full,
                "generate_half_s_runs": runs_half,
                "tokens_per_s_end_to_end": batch * args.gen_len / t_full,
                "decode_tokens_per_s": decode_tps if math.isfinite(decode_tps) else None,
                "decode_step_ms": decode_s / steps * 1e3 if math.isfinite(decode_s) else None,
                "bytes_per_step": sb,
                "roofline": {
                    "bytes_per_step_ideal": ideal,
                    "bytes_per_step_as_run": as_run,
                    "tokens_per_s_at_spec_bw": batch / (ideal / spec) if (spec := timing.hbm_spec_bandwidth()) else None,
                    "tokens_per_s_at_copy_bw": batch / (ideal / bw_copy),
                    "tokens_per_s_at_copy_bw_full_cache": batch / (as_run / bw_copy),
                    "fraction_of_copy_roofline": decode_tps / (batch / (ideal / bw_copy)) if math.isfinite(decode_tps) else None,
                },
            }
            results.append(point)
            print(f"{recipe_name:10s} batch {batch:4d}: {decode_tps:10.1f} decode tok/s ({decode_s / steps * 1e3:.2f} ms/step), "
                  f"e2e {point['tokens_per_s_end_to_end']:10.1f} tok/s, roofline@copy {point['roofline']['tokens_per_s_at_copy_bw']:10.1f} "
                  f"({100 * (point['roofline']['fraction_of_copy_roofline'] or math.nan):.1f}%), experts touched {touched:.1f}/{cfg.num_experts}", flush=True)
            del engine
            write(complete=False)
    write(complete=True)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
