"""The RL step yardstick (issue 23): is a whole RL step with `fp8_block` faster than with `bf16` on one H200?

    # the measurement (one H200; stages of experiments/h200_runs.sh: rl_step = 1k responses, rl_step_long = 4k)
    python experiments/benchmarks/rl_step.py --response-lengths 1024 --out $OUT/rl_step_h200_1k.json
    python experiments/benchmarks/rl_step.py --response-lengths 4096 --out $OUT/rl_step_h200_4k.json
    # one file from both (no device needed): comparison, table and PNG recomputed
    python experiments/benchmarks/rl_step.py --merge a.json,b.json --out experiments/benchmarks/results/rl_step_h200.json
    # CPU smoke run (CI test): a tiny model, < 2 minutes
    python experiments/benchmarks/rl_step.py --tiny --recipes fp8_block --steps 2 --fast-compile --out /tmp/r.json

What runs: for every (recipe, response length) point, in a subprocess of its own (so its peak memory is its own and an
out-of-memory error kills only that point), `jaxrl_fp8.train.run(config, on_step=...)` - the real trainer loop: grain
prompts, the embedded JAX rollout engine (recipe's rollout format, KV cache, routed experts returned), R3 routing replay
in the trainer, old log-probs recomputed in the training format, PPO clip x TIS updates with AdamW on FP32 masters in the
recipe's backward mode, and the weight push through the precision contract to the engine (version v+1). Recipes:
`bf16` (BF16/BF16; its expert GEMMs on the Pallas grouped BF16 kernel on Hopper), `bf16_train_fp8_rollout`, `fp8_block`
(unified block FP8). Model: a Qwen3-30B-A3B-shaped slice from random init (nothing is downloaded): hidden 2048, 128
experts top-8, expert intermediate 768, 32 query / 4 KV heads of 128, vocab 151936, every layer MoE, `--layers` deep.
Prompts: exactly 256 tokens (`<254 digits>=` with the built-in character tokenizer, the scale run's committed dataset;
the vocabulary is padded to 151936). Responses: exactly the asked length (`rollout.ignore_eos`: no stop ids).
Routing: the random slice is drawn so that it routes like a trained MoE (decision record 0013): the embedding at
`--embed-init-std` (default 1.0, config model.embed_init_std) and the residual-stream outputs (attention o_proj,
expert down_proj) at init_std / sqrt(2 * layers) (`--scaled-output-init`, default on, config
model.scaled_output_init: Megatron's scaled init). With the init's 0.02 everywhere every token of a row routes like
the others (the residual is mostly attention's near-uniform average of these digit prompts); with the embedding alone
at 1.0 the first layer spreads but the deeper ones collapse again (CPU, 6 layers, 64 rows of these prompts: 115 /
102 / 86 / 75 / 58 / 57 experts per decode step; the H200 run of 2026-12-05 averaged 45-47 over 1k responses), and
with both 125 / 125 / 124 / 122 / 122 / 120 (a load-balanced router: ~126). Fewer experts mean less weight traffic
per decode step, which understates FP8's saving; each step records the spread it got (`rollout_experts_touched`:
distinct experts a decode step reads, mean over steps and layers; the median per point).

What is measured, per point: per step the trainer's own phase timers - rollout (prompt batch, generate, rewards), train
= logprob (batch layout, old log-probs, mismatch metrics) + update (minibatch forward / backward / optimizer), sync (the
weight push: masters cast, quantized through the contract into the engine, blocking) and the step; medians over the
steps after `--warmup-steps` (default 1: the first step compiles every program). Output tokens/s = response tokens of a
step / seconds, end to end and per phase. Peak device memory: `jax.devices()[0].memory_stats()["peak_bytes_in_use"]`
after each step (peak since the process started: the point's own, as each point is a process; XLA:CPU keeps no
statistics, so null on CPU). Mismatch: `train_rollout_logprob_abs_diff` and K3 KL (`train_rollout_kl`) from the
trainer's metrics. Comparison per length: fp8_block / bf16 ratios of tokens/s end to end and of the train phase, the
memory ratio, the issue's targets (end to end >= 1.3x, train >= 1.4x, peak memory lower) met / missed, and which phase
holds it back: per phase p the speed-up t_bf16(p) / t_fp8(p) and the shortfall t_fp8(p) - t_bf16(p) / 1.3 (the seconds
phase p is over its part of a step 1.3x faster than bf16's); the phase with the largest shortfall holds it back (a
small speed-up weighted by the phase's share of step time). Each point goes into the JSON as soon as it ends (temp file
renamed), a failing point (e.g. out of memory, a time-out) is recorded with its error, and `--time-budget` skips points
that cannot finish in the time left (recorded as skipped).

Memory (H200, 141 GB, ~132 GB usable at XLA_PYTHON_CLIENT_MEM_FRACTION=0.94, which the script sets for its points
unless preallocation is off). Parameters P = 2 x 151936 x 2048 (embedding, lm_head: 0.62B) + 0.623B a layer (experts
3 x 128 x 2048 x 768 = 604M, attention 18.9M, router 0.26M): 2.49B at 3 layers, 3.12B at 4, 3.74B at 5.
- weights: the update program takes FP32 masters + Adam moments (12 B/param), donated (updated in place), and needs
  the float32 gradient (4 B/param; with micro-batches their sum), plus the engine's BF16 rollout weights (2 B/param;
  ~1.2 with FP8 projections): ~18 B/param = 56 GB at 4 layers, 79 GB at 6 (measured: 6 layers at 1k with
  `rl_step_accum`'s micro-batches peaked at 112.4 / 119.2 GB (fp8_block / bf16), which includes a float32 copy of
  the model, 4 B/param, that `train.run` no longer keeps; not re-measured without it). fp8_block with the fp8 backward
  also holds its projections' e4m3 operands and their transposes for the whole update (`Trainer._prepared`: made
  once, not per micro-batch), ~2 B/param of the projections, of which the transposes (1 B) would otherwise live
  only during each layer's backward; not measured yet.
- activations of one training row of T = prompt + response tokens (no rematerialisation): ~24 x 151936 B a token for
  the float32 logits and what the loss, the entropy and their gradient make of them, plus per layer ~0.39 MB a token
  (MoE rows, attention, norms) and 12 x 32 x T B a token (XLA attention's probabilities). XLA:CPU's memory analysis
  of the real update program at these shapes (`--memory-analysis`, results/rl_step_memory_analysis_cpu.json, section
  compiled_for_cpu; bf16, XLA attention) gives ~5 GB + 0.6 GB a layer per row at 1k (T = 1280) and ~16 GB + 9 GB a
  layer per row at 4k (T = 4352).
- the old-log-prob pass (forward only, `--logprob-chunk` rows a call, default the minibatch) and the rollout (KV cache
  ~1 GB, prefill of 64 x 256 tokens) peak lower than the update.
Defaults: 1k: 4 layers, 64 rows a step (16 prompts x 4), minibatches of 2 rows: ~56 + 2 x 7.5 = ~71 GB;
4k: 3 layers, 16 rows (4 x 4), minibatches of 1 row: ~45 + 43 = ~88 GB. `--layers` sets the depth for every length;
experiments/h200_runs.sh rl_step_accum runs 6 layers at 1k. XLA:CPU's memory analysis of the default programs
(results/rl_step_memory_analysis_cpu.json, compiled_for_cpu; arguments + outputs - aliased (the update's donated
state) + temporaries, bf16 / fp8_block): update 1k 73.1 / 83.7 GB and 4k 84.6 / 94.2 GB, plus the engine's weights
(6.2 / 3.7 GB at 1k, 5.0 / 3.1 GB at 4k); rollout 1k 28 / 33 GB, logprob 22 / 37 GB (on CPU the FP8 path's XLA
quantizers keep float32 temporaries the GPU's Pallas kernels do not).
All four programs of a step (rollout, logprob, update, weight push) also lower for CUDA with the Hopper kernels at
these shapes on a CPU machine (`--memory-analysis --lower-platform cuda`: results/rl_step_memory_analysis_cpu.json,
section lowered_for_cuda). `--memory-analysis` writes one section per mode (compiled_for_<host backend>,
lowered_for_<platform>) into results/rl_step_memory_analysis_<host backend>.json and keeps the other sections there.
Time (estimates; the stages' --time-budget skips what does not fit): 1k: ~1024 decode steps of ~5-10 ms (rollout
5-10 s), ~2-6 s train, < 1 s sync, 1-3 min of compilation and init: 2-4 min a point (4 steps); 4k: ~4096 decode steps
(rollout 20-40 s), 2 steps: 3-4 min a point.
"""

from __future__ import annotations

import argparse
import collections
import importlib.metadata
import json
import os
import platform
import runpy
import subprocess
import sys
import threading
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
RESULTS = os.path.join(HERE, "results")
SHAPE_MODULE = os.path.join(REPO, "experiments", "configs", "_qwen3_30b_a3b_shape.py")
RECIPES = ("bf16", "bf16_train_fp8_rollout", "fp8_block", "fp8_block_kv")
MEMORY_ANALYSIS = "rl_step_memory_analysis"  # the --memory-analysis result: results/rl_step_memory_analysis_<host backend>.json
TARGETS = {"tokens_per_second_end_to_end": 1.3, "train_phase_tokens_per_second": 1.4, "peak_memory_ratio_below": 1.0}
PHASES = ("rollout", "logprob", "update", "sync")  # train = logprob + update
TIME_KEYS = ("rollout_seconds", "logprob_seconds", "update_seconds", "train_seconds", "sync_seconds", "step_seconds",
             "tokens_per_second")
MISMATCH_KEYS = ("train_rollout_logprob_abs_diff", "train_rollout_kl", "train_rollout_tis_clipfrac",
                 "train_rollout_max_abs_diff", "tis_clipfrac")

# Qwen3-30B-A3B's shape (every layer MoE) and a tiny one of the same family for CPU tests
FULL = dict(hidden_size=2048, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, intermediate_size=6144,
            num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936, rope_theta=1_000_000.0)
TINY = dict(hidden_size=128, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=128, intermediate_size=256,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=2048, rope_theta=1_000_000.0)
# per response length: prompts, samples per prompt, minibatch rows, steps (defaults; flags override every length)
FULL_DEFAULTS = {"prompt_tokens": 256, "response_lengths": (1024, 4096)}
TINY_DEFAULTS = {"prompt_tokens": 32, "response_lengths": (16,)}


def length_defaults(tiny: bool, length: int) -> dict:
    if tiny:
        return dict(layers=2, prompts=2, samples=2, batch=2, steps=2)
    if length <= 1024:
        return dict(layers=4, prompts=16, samples=4, batch=2, steps=4)
    if length <= 2048:
        return dict(layers=3, prompts=8, samples=4, batch=1, steps=3)
    return dict(layers=3, prompts=4, samples=4, batch=1, steps=2)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python experiments/benchmarks/rl_step.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipes", default=",".join(RECIPES), help="comma list, a subset of %(default)s (run in this order)")
    p.add_argument("--response-lengths", default=None,
                   help="comma list of response tokens (default: 1024,4096; --tiny: 16)")
    p.add_argument("--layers", type=int, default=None,
                   help="decoder layers, all MoE, for every length (default: 4 at <= 1k responses, 3 above; --tiny: 2)")
    p.add_argument("--prompt-tokens", type=int, default=None, help="prompt tokens (default 256; --tiny 32)")
    p.add_argument("--steps", type=int, default=None,
                   help="RL steps per point, warm-up included (default: 4 at <= 1k, 3 at 2k, 2 at 4k; --tiny 2)")
    p.add_argument("--warmup-steps", type=int, default=1, help="first steps left out of the medians (default 1: compile)")
    p.add_argument("--prompts", type=int, default=None, help="prompts per step (default: 16 at 1k, 4 at 4k; --tiny 2)")
    p.add_argument("--samples-per-prompt", type=int, default=None, help="responses per prompt, the GRPO group (default 4)")
    p.add_argument("--batch", type=int, default=None,
                   help="rows per optimizer update (minibatch; rows a step / batch = minibatches) (default: 2 at 1k, 1 at 4k)")
    p.add_argument("--micro-batch", type=int, default=None,
                   help="rows per micro-batch of an update (config rl.micro_batch_rows: the minibatch's gradient "
                        "accumulated over micro-batches, one optimizer update per minibatch; default: the whole minibatch)")
    p.add_argument("--logit-chunk", type=int, default=None,
                   help="at most this many token positions per (equal) chunk of the loss's head / log-softmax / entropy (config "
                        "rl.logit_chunk_tokens; recomputed in the backward: no [tokens, vocab] logits; default: off)")
    p.add_argument("--logprob-chunk", type=int, default=None,
                   help="rows per call of the old-log-prob pass (config rl.logprob_chunk_rows; default: --micro-batch, else --batch)")
    p.add_argument("--attention-impl", default=None,
                   help="config.model.attention_impl (default: the config's, 'auto': the flash kernels on a Hopper GPU, "
                        "the exact scan on CPU)")
    p.add_argument("--embed-init-std", type=float, default=1.0,
                   help="config model.embed_init_std of the random slice (default %(default)s): at the init's 0.02 every "
                        "token of a row routes alike and a 64-row decode step touches ~30-40 of 128 experts, where a "
                        "trained (load-balanced) router spreads them over ~120; the JSON records the measured spread "
                        "(rollout_experts_touched: distinct experts a decode step reads, mean over steps and layers)")
    p.add_argument("--scaled-output-init", action=argparse.BooleanOptionalAction, default=True,
                   help="config model.scaled_output_init (default on): attention o_proj and expert down_proj drawn at "
                        "init_std / sqrt(2 * layers), Megatron's scaled init; without it the deeper layers of the random "
                        "slice route alike on the digit prompts (45-47 of 128 experts a decode step measured, ~123 with it)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="config override for every point, repeatable (value parsed as a Python literal)")
    p.add_argument("--tiny", action="store_true", help="a tiny model of the same family (CPU test; < 2 minutes)")
    p.add_argument("--out", default=None,
                   help="results JSON; the PNG goes next to it (default: results/rl_step_h200.json; --tiny: "
                        "results/rl_step_cpu_tiny.json)")
    p.add_argument("--runs-dir", default=None, help="parent of the per-point workdirs (default: runs/rl_step[_tiny])")
    p.add_argument("--time-budget", type=float, default=0.0,
                   help="seconds for the whole command (0: none); a point is not started with less than "
                        "--min-point-seconds left, and a running point is stopped when the budget ends")
    p.add_argument("--min-point-seconds", type=float, default=90.0,
                   help="least time a point needs to be started (default %(default)s; raised to the longest finished "
                        "point of the same length)")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per point subprocess (default %(default)s)")
    p.add_argument("--compile-cache", default="", help="JAX persistent compilation cache directory for the points")
    p.add_argument("--fast-compile", action="store_true", help="XLA:CPU --xla_backend_optimization_level=0 (CPU tests)")
    p.add_argument("--merge", default="", help="comma list of result JSONs: merge their points into --out (no run)")
    p.add_argument("--memory-analysis", action="store_true",
                   help="compile the rollout, logprob, update and weight-push programs for this host's backend at the "
                        "points' shapes (abstract arrays, nothing runs) and report XLA's memory analysis, then exit; "
                        "writes its section of --out (default: results/rl_step_memory_analysis_<host backend>.json; "
                        "--tiny: ..._cpu_tiny.json), keeping the other sections")
    p.add_argument("--lower-platform", default="",
                   help="with --memory-analysis: instead of compiling for this host, lower the programs for this platform "
                        "(e.g. cuda on a CPU machine, ops choosing their Hopper kernels) and report whether they lower")
    p.add_argument("--child", default="", help=argparse.SUPPRESS)  # internal: "recipe:length", writes --child-out
    p.add_argument("--child-out", default="", help=argparse.SUPPRESS)
    return p


# --------------------------------------------------------------------------------------------------- configs


def _shape_module():
    return runpy.run_path(SHAPE_MODULE)


def resolve_args(args) -> None:
    """Fill the size-dependent defaults in place; raises ValueError on a bad value (before any compute)."""
    d = TINY_DEFAULTS if args.tiny else FULL_DEFAULTS
    args.prompt_tokens = d["prompt_tokens"] if args.prompt_tokens is None else args.prompt_tokens
    if args.response_lengths is None:
        args.lengths = list(d["response_lengths"])
    else:
        try:
            args.lengths = [int(x) for x in str(args.response_lengths).split(",") if x.strip()]
        except ValueError:
            raise ValueError(f"--response-lengths {args.response_lengths!r}: expected a comma list of ints") from None
    args.recipe_list = [r.strip() for r in args.recipes.split(",") if r.strip()]
    bad = [r for r in args.recipe_list if r not in RECIPES]
    if bad or not args.recipe_list:
        raise ValueError(f"--recipes: unknown {bad or 'empty list'}; choose from {', '.join(RECIPES)}")
    if not args.lengths or any(n < 1 for n in args.lengths):
        raise ValueError(f"--response-lengths: need positive ints, got {args.response_lengths!r}")
    if args.layers is not None and args.layers < 1:
        raise ValueError("--layers must be >= 1")
    if args.prompt_tokens < 3:
        raise ValueError("--prompt-tokens must be >= 3 (BOS, a digit, '=')")
    if args.warmup_steps < 0:
        raise ValueError("--warmup-steps must be >= 0")
    if args.attention_impl is not None:
        from jaxrl_fp8.model.config import ATTENTION_IMPLS

        if args.attention_impl not in ATTENTION_IMPLS:
            raise ValueError(f"--attention-impl {args.attention_impl!r}: expected one of {', '.join(ATTENTION_IMPLS)}")


def point_sizes(args, length: int) -> dict:
    d = length_defaults(args.tiny, length)
    s = dict(layers=args.layers or d["layers"], prompts=args.prompts or d["prompts"], samples=args.samples_per_prompt or d["samples"],
             batch=args.batch or d["batch"], steps=args.steps or d["steps"])
    s["rows"] = s["prompts"] * s["samples"]
    s["micro_batch"] = args.micro_batch or s["batch"]
    s["logprob_chunk"] = args.logprob_chunk or s["micro_batch"]
    for k in ("layers", "prompts", "samples", "batch", "steps", "micro_batch", "logprob_chunk"):
        if s[k] < 1:
            raise ValueError(f"{k} must be >= 1, got {s[k]}")
    if s["samples"] < 2:
        raise ValueError("--samples-per-prompt must be >= 2 (GRPO groups)")
    if s["rows"] % s["batch"]:
        raise ValueError(f"--batch {s['batch']} must divide prompts x samples = {s['rows']} rows")
    if s["batch"] % s["micro_batch"]:
        raise ValueError(f"--micro-batch {s['micro_batch']} must divide --batch {s['batch']}")
    return s


def point_config(args, recipe: str, length: int, workdir: str):
    """The training config of one point (validated by the caller with jaxrl_fp8.config.validate_config)."""
    from jaxrl_fp8.config import as_benchmark_run, base_config

    sys.path.insert(0, os.path.dirname(HERE))
    from recipe_curves import apply_override  # one KEY=VALUE parser for the experiment scripts

    shape = _shape_module()
    s = point_sizes(args, length)
    c = base_config()
    c.workdir = workdir
    c.seed = args.seed
    c.recipe = recipe
    c.hardware = "auto"
    c.total_steps = s["steps"]
    m = c.model
    m.checkpoint = ""
    m.dtype = "bfloat16"  # activations; masters stay FP32
    for key, value in (TINY if args.tiny else FULL).items():
        m[key] = value
    m.num_hidden_layers = s["layers"]
    m.embed_init_std = args.embed_init_std
    m.scaled_output_init = bool(args.scaled_output_init)
    m.decoder_sparse_step = 1
    m.mlp_only_layers = ()
    m.norm_topk_prob = True
    m.tie_word_embeddings = False
    if args.attention_impl is not None:
        m.attention_impl = args.attention_impl
    c.data.source = "jsonl"
    c.data.path = shape["dataset_path"](args.prompt_tokens)
    c.data.tokenizer = shape["tokenizer_dir"]()
    c.data.reward = "positional_match"
    c.data.prompts_per_step = s["prompts"]
    c.data.max_prompt_tokens = args.prompt_tokens
    r = c.rollout
    r.engine = "embedded"
    r.placement = "separate"
    r.n_samples = s["samples"]
    r.max_new_tokens = length
    r.max_batch = s["rows"]  # every row of a step decodes together
    r.routing_replay = True  # R3
    r.ignore_eos = True  # every response exactly `length` tokens (no stop ids)
    c.rl.use_tis = True
    c.rl.tis_clip = 2.0
    c.rl.learning_rate = 1e-6
    c.rl.kl_coef = 0.0
    c.rl.num_minibatches = s["rows"] // s["batch"]
    c.rl.logprob_chunk_rows = s["logprob_chunk"]
    c.rl.micro_batch_rows = 0 if s["micro_batch"] == s["batch"] else s["micro_batch"]
    c.rl.logit_chunk_tokens = args.logit_chunk or 0
    as_benchmark_run(c)
    for assignment in args.set:
        apply_override(c, assignment)
    return c


def validate_point(c) -> None:
    from jaxrl_fp8.config import validate_config

    validate_config(c)


def param_counts(model: dict, layers: int) -> dict:
    h, v, e, i = model["hidden_size"], model["vocab_size"], model["num_experts"], model["moe_intermediate_size"]
    q, kv = model["num_attention_heads"] * model["head_dim"], model["num_key_value_heads"] * model["head_dim"]
    attn = h * q + 2 * h * kv + q * h + 2 * model["head_dim"] + 2 * h
    experts = 3 * e * h * i
    router = e * h
    per_layer = attn + experts + router
    total = 2 * v * h + h + layers * per_layer
    active = 2 * v * h + layers * (attn + router + 3 * model["num_experts_per_tok"] * h * i)
    return dict(total=total, per_layer=per_layer, experts_per_layer=experts, attention_per_layer=attn,
                embedding=v * h, lm_head=v * h, active_per_token=active)


def memory_estimate(model: dict, layers: int, batch: int, seq: int, logit_chunk: int = 0) -> dict:
    """The docstring's estimate of the update's peak (bytes): weights-related + the activations of the `batch` rows
    live at once (the minibatch, or one micro-batch with gradient accumulation); with `logit_chunk` positions per
    head chunk (rl.logit_chunk_tokens) the ~24 x vocab bytes a token of logits are live for one chunk only. The
    activation terms were fitted to XLA:CPU's memory analysis of the real update program (bf16 recipe, XLA attention;
    results/rl_step_memory_analysis_cpu.json, section compiled_for_cpu); the weights' 18 B/param is the donated
    update's buffers, an upper bound of the H200's peaks (module docstring)."""
    p = param_counts(model, layers)["total"]
    weights = 18 * p
    v, nh = model["vocab_size"], model["num_attention_heads"]
    per_token_layer = 8 * (2 * model["hidden_size"] + 4 * model["moe_intermediate_size"]) * 4 + 20 * model["hidden_size"] * 4
    logits_per_token = 0 if logit_chunk else 24 * v
    row = seq * (logits_per_token + layers * (per_token_layer + 12 * nh * seq))
    logits = 24 * v * min(logit_chunk, batch * seq) if logit_chunk else 0
    return dict(weights_bytes=weights, activations_per_row_bytes=row, minibatch_rows=batch, logit_chunk_bytes=logits,
                update_peak_bytes=weights + batch * row + logits,
                rule="18 B/param (update arguments, donated: FP32 masters 4 + Adam 8; the float32 gradient or, with "
                     "micro-batches, its sum 4; the engine's BF16 rollout weights 2) + rows x T x (24 x vocab "
                     "(once per chunk instead with logit chunks) + layers x (MoE/attention ~0.39 MB + 12 x heads x T))")


# --------------------------------------------------------------------------------------------------- child


def _memory(device) -> dict | None:
    try:
        stats = device.memory_stats()
    except Exception:  # some backends raise instead of returning None
        stats = None
    if not stats:
        return None
    return {k: stats.get(k) for k in ("peak_bytes_in_use", "bytes_in_use", "bytes_limit")}


def _write_json(path: str, obj) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, default=str)
        f.write("\n")
    os.replace(tmp, path)


def child(args) -> int:
    """One (recipe, length) point in this process; its part JSON is rewritten after every step."""
    recipe, length = args.child.split(":")
    length = int(length)
    t_start = time.time()
    part = dict(recipe=recipe, response_tokens=length, status="starting", rows=[], started=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    _write_json(args.child_out, part)
    try:
        import jaxrl_fp8  # noqa: F401  (first: the XLA flags of the precision contract)
        import jax

        import jax.numpy as jnp

        from jaxrl_fp8 import train
        from jaxrl_fp8.model.attention import resolve_impl

        dev = jax.devices()[0]
        workdir = os.path.join(args.runs_dir, f"{recipe}_{length}")
        c = point_config(args, recipe, length, workdir)
        validate_point(c)
        if os.path.exists(os.path.join(workdir, "metrics.jsonl")):
            os.remove(os.path.join(workdir, "metrics.jsonl"))
        try:
            from jaxrl_fp8.ops.high_precision import effective_form

            hp_form = effective_form()
        except Exception as e:  # informative only
            hp_form = f"unknown ({e})"
        part.update(
            status="running", sizes=point_sizes(args, length),
            device=dict(platform=dev.platform, kind=getattr(dev, "device_kind", dev.platform), count=jax.device_count(),
                        memory_stats_available=_memory(dev) is not None),
            versions=dict(python=platform.python_version(), jax=jax.__version__, jaxlib=importlib.metadata.version("jaxlib"),
                          flax=importlib.metadata.version("flax"), numpy=importlib.metadata.version("numpy")),
            attention_impl=c.model.attention_impl,
            attention_runs=resolve_impl(c.model.attention_impl, c.model.head_dim, jnp.dtype(c.model.dtype)),
            high_precision_form=hp_form,
            config=json.loads(c.to_json_best_effort()))
        _write_json(args.child_out, part)
        last = [time.time()]

        def on_step(step, metrics):
            now = time.time()
            row = {"step": int(step)}
            for k, v in metrics.items():
                try:
                    row[k] = float(v)
                except (TypeError, ValueError):
                    pass
            row["since_start_seconds"] = now - t_start
            row["wall_seconds_since_previous"] = now - last[0]
            last[0] = now
            mem = _memory(dev)
            row.update(mem or {"peak_bytes_in_use": None, "bytes_in_use": None, "bytes_limit": None})
            part["rows"].append(row)
            _write_json(args.child_out, part)  # a point cut short keeps the steps it measured
            print(f"[rl_step] {recipe} {length}: step {step} {metrics.get('step_seconds', 0):.2f}s "
                  f"(rollout {metrics.get('rollout_seconds', 0):.2f} train {metrics.get('train_seconds', 0):.2f} "
                  f"sync {metrics.get('sync_seconds', 0):.2f}) peak {((mem or {}).get('peak_bytes_in_use') or 0) / 1e9:.1f} GB",
                  flush=True)

        train.run(c, on_step=on_step)
        part["status"] = "ok"
    except Exception as e:  # recorded, not raised: the next point still runs
        msg = f"{type(e).__name__}: {e}"
        part.update(status="error", error=msg[:4000], traceback=traceback.format_exc()[-6000:],
                    oom=any(s in msg for s in ("RESOURCE_EXHAUSTED", "Out of memory", "out of memory", "OOM")))
        try:
            import jax

            part["memory_at_error"] = _memory(jax.devices()[0])
        except Exception:
            pass
        print(f"[rl_step] {recipe} {length}: FAILED {msg[:500]}", file=sys.stderr, flush=True)
    part["wall_seconds"] = time.time() - t_start
    _write_json(args.child_out, part)
    return 0


# --------------------------------------------------------------------------------------------------- summary


def _median(values):
    vals = sorted(v for v in values if isinstance(v, (int, float)))
    if not vals:
        return None
    n = len(vals)
    return vals[n // 2] if n % 2 else 0.5 * (vals[n // 2 - 1] + vals[n // 2])


def summarize_point(point: dict, warmup: int) -> dict | None:
    rows = point.get("rows") or []
    if not rows:
        return None
    steady = rows[warmup:] if len(rows) > warmup else rows[-1:]
    med = {k: _median([r.get(k) for r in steady]) for k in TIME_KEYS + MISMATCH_KEYS + ("response_length", "rollout_experts_touched")}
    rows_per_step = (point.get("sizes") or {}).get("rows")
    tokens = med["response_length"] * rows_per_step if med["response_length"] is not None and rows_per_step else None
    per_phase = {}
    for ph in PHASES + ("train",):
        sec = med.get(f"{ph}_seconds")
        per_phase[ph] = tokens / sec if tokens and sec else None
    peaks = [r.get("peak_bytes_in_use") for r in rows if r.get("peak_bytes_in_use") is not None]
    return dict(
        steps_measured=[r["step"] for r in steady], warmup_excluded=len(rows) - len(steady),
        median=med, response_tokens_per_step=tokens,
        tokens_per_second_end_to_end=(tokens / med["step_seconds"]) if tokens and med["step_seconds"] else med["tokens_per_second"],
        tokens_per_second_per_phase=per_phase,
        first_step_seconds=rows[0].get("step_seconds"), setup_seconds=rows[0].get("since_start_seconds", 0) - (rows[0].get("step_seconds") or 0),
        peak_bytes_in_use=max(peaks) if peaks else None, bytes_limit=rows[-1].get("bytes_limit"))


def _ratio(a, b):
    return (a / b) if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else None


def compare(points: list[dict]) -> dict:
    """Per response length: fp8_block vs bf16 (and bf16_train_fp8_rollout, fp8_block_kv vs bf16), targets (for both
    unified FP8 recipes), the phase holding back."""
    out = {}
    by = {(p["recipe"], p["response_tokens"]): p for p in points}
    for length in sorted({p["response_tokens"] for p in points}):
        entry = {}
        b = by.get(("bf16", length), {}).get("summary")
        for other in ("fp8_block", "bf16_train_fp8_rollout", "fp8_block_kv"):
            f = by.get((other, length), {}).get("summary")
            if not (b and f):
                if other != "fp8_block_kv":  # absent unless asked for (an opt-in recipe)
                    entry[f"{other}_vs_bf16"] = None
                continue
            e2e = _ratio(f["tokens_per_second_end_to_end"], b["tokens_per_second_end_to_end"])
            train = _ratio(b["median"]["train_seconds"], f["median"]["train_seconds"])
            mem = _ratio(f["peak_bytes_in_use"], b["peak_bytes_in_use"])
            phases = {}
            target = TARGETS["tokens_per_second_end_to_end"]
            step_b, step_f = b["median"]["step_seconds"], f["median"]["step_seconds"]
            for ph in PHASES:
                tb, tf = b["median"].get(f"{ph}_seconds"), f["median"].get(f"{ph}_seconds")
                if tb is None or tf is None:
                    continue
                phases[ph] = dict(bf16_seconds=tb, seconds=tf, speedup=_ratio(tb, tf),
                                  share_of_bf16_step=_ratio(tb, step_b), share_of_step=_ratio(tf, step_f),
                                  shortfall_seconds=tf - tb / target)
            if step_b is not None and step_f is not None and phases:
                ob = step_b - sum(v["bf16_seconds"] for v in phases.values())
                of = step_f - sum(v["seconds"] for v in phases.values())
                phases["other"] = dict(bf16_seconds=ob, seconds=of, speedup=_ratio(ob, of), share_of_bf16_step=_ratio(ob, step_b),
                                       share_of_step=_ratio(of, step_f), shortfall_seconds=of - ob / target)
            holds = max(phases, key=lambda k: phases[k]["shortfall_seconds"]) if phases else None
            res = dict(tokens_per_second_end_to_end=e2e, train_phase_tokens_per_second=train, peak_memory=mem,
                       rollout_phase_tokens_per_second=_ratio(b["median"]["rollout_seconds"], f["median"]["rollout_seconds"]),
                       sync_phase_speedup=_ratio(b["median"]["sync_seconds"], f["median"]["sync_seconds"]), phases=phases,
                       holds_back=holds)
            if other in ("fp8_block", "fp8_block_kv"):
                res["targets"] = {
                    "tokens_per_second_end_to_end >= 1.3x": None if e2e is None else ("met" if e2e >= 1.3 else "missed"),
                    "train_phase >= 1.4x": None if train is None else ("met" if train >= 1.4 else "missed"),
                    "peak_memory lower": None if mem is None else ("met" if mem < 1.0 else "missed"),
                }
            entry[f"{other}_vs_bf16"] = res
        out[str(length)] = entry
    return out


HOLDS_BACK_RULE = ("per phase p (rollout, logprob, update, sync, other = step - their sum): speedup = t_bf16(p) / t_fp8(p) "
                   "and shortfall = t_fp8(p) - t_bf16(p) / 1.3, the seconds p is over its part of a step 1.3x faster "
                   "than bf16's (= t_bf16(p) x (1/speedup - 1/1.3): a small speed-up weighted by the phase's share of "
                   "step time); holds_back = the phase with the largest shortfall. train = logprob + update.")


def assemble(meta: dict, points: list[dict], warmup: int) -> dict:
    for p in points:
        p["summary"] = summarize_point(p, warmup)
    first = next((p for p in points if p.get("device")), {})
    result = dict(meta)
    result.update(device=first.get("device"), versions=first.get("versions"), targets=TARGETS,
                  holds_back_rule=HOLDS_BACK_RULE,
                  memory_note=None if (first.get("device") or {}).get("memory_stats_available") else
                  "device.memory_stats() is None on this backend (XLA:CPU keeps no allocator statistics): peak memory is null",
                  points=points, comparison=compare(points))
    return result


def table(result: dict) -> str:
    hdr = (f"{'recipe':<24} {'resp':>5} {'status':<8} {'rollout':>8} {'logprob':>8} {'update':>8} {'sync':>6} {'step':>8} "
           f"{'tok/s':>9} {'trn tok/s':>9} {'peak GB':>8} {'|dlogp|':>9} {'K3 KL':>9} {'experts':>7}")
    lines = [hdr, "-" * len(hdr)]
    f = lambda v, w, p=3: f"{v:>{w}.{p}g}" if isinstance(v, (int, float)) else f"{'-':>{w}}"  # noqa: E731
    for p in result["points"]:
        s = p.get("summary") or {}
        m = s.get("median") or {}
        peak = s.get("peak_bytes_in_use")
        lines.append(f"{p['recipe']:<24} {p['response_tokens']:>5} {p['status']:<8} {f(m.get('rollout_seconds'), 8)} "
                     f"{f(m.get('logprob_seconds'), 8)} {f(m.get('update_seconds'), 8)} {f(m.get('sync_seconds'), 6)} "
                     f"{f(m.get('step_seconds'), 8)} {f(s.get('tokens_per_second_end_to_end'), 9, 4)} "
                     f"{f((s.get('tokens_per_second_per_phase') or {}).get('train'), 9, 4)} {f(peak / 1e9 if peak else None, 8)} "
                     f"{f(m.get('train_rollout_logprob_abs_diff'), 9, 2)} {f(m.get('train_rollout_kl'), 9, 2)} "
                     f"{f(m.get('rollout_experts_touched'), 7)}")
        if p["status"] not in ("ok",):
            lines.append(f"    {p['status']}: {(p.get('error') or '')[:200]}")
    for length, entry in result["comparison"].items():
        c = entry.get("fp8_block_vs_bf16")
        if not c:
            lines.append(f"{length} tokens: fp8_block vs bf16: not both measured")
            continue
        lines.append(f"{length} tokens: fp8_block / bf16 tokens/s end to end {f(c['tokens_per_second_end_to_end'], 5)}x, "
                     f"train {f(c['train_phase_tokens_per_second'], 5)}x, rollout {f(c['rollout_phase_tokens_per_second'], 5)}x, "
                     f"peak memory {f(c['peak_memory'], 5)}x; targets {c['targets']}; held back by: {c['holds_back']}")
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    lengths = sorted({p["response_tokens"] for p in result["points"]})
    fig, axes = plt.subplots(1, len(lengths), figsize=(4.8 * len(lengths) + 1, 4.2), squeeze=False)
    colors = {"rollout": "tab:blue", "logprob": "tab:purple", "update": "tab:orange", "sync": "tab:green"}
    for ax, length in zip(axes[0], lengths):
        pts = [p for p in result["points"] if p["response_tokens"] == length]
        x = np.arange(len(pts))
        bottom = np.zeros(len(pts))
        for ph in PHASES:
            vals = np.array([((p.get("summary") or {}).get("median") or {}).get(f"{ph}_seconds") or 0.0 for p in pts])
            ax.bar(x, vals, bottom=bottom, color=colors[ph], label=ph)
            bottom += vals
        for i, p in enumerate(pts):
            s = p.get("summary") or {}
            tps = s.get("tokens_per_second_end_to_end")
            label = f"{tps:.4g} tok/s" if p["status"] == "ok" and tps else p["status"]
            ax.text(i, bottom[i], label, ha="center", va="bottom", fontsize=8)
        ax.set_xticks(x, [p["recipe"].replace("_train_fp8_rollout", "\ntrain/fp8\nrollout") for p in pts], fontsize=8)
        ax.set_ylabel("seconds per RL step (median after warm-up)")
        c = (result["comparison"].get(str(length)) or {}).get("fp8_block_vs_bf16")
        sub = (f"fp8/bf16: {c['tokens_per_second_end_to_end']:.3g}x e2e, train {c['train_phase_tokens_per_second']:.3g}x"
               if c and c.get("tokens_per_second_end_to_end") and c.get("train_phase_tokens_per_second") else "")
        layers = {(p.get("sizes") or {}).get("layers") for p in pts} - {None}
        ax.set_title(f"{length}-token responses, {'/'.join(map(str, sorted(layers))) or '?'} layers\n{sub}", fontsize=9)
        ax.legend(fontsize=7)
    d = result.get("device") or {}
    fig.suptitle(f"RL step phases, Qwen3-30B-A3B-shaped slice"
                 f"{' (tiny)' if result.get('tiny') else ''}, {d.get('kind', '?')}", fontsize=10)
    fig.tight_layout()
    tmp = path[: -len(".png")] + f".tmp-{os.getpid()}.png"
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)


def write_result(result: dict, out: str, with_plot: bool = True) -> str:
    _write_json(out, result)
    png = (out[: -len(".json")] if out.endswith(".json") else out) + ".png"
    if with_plot:
        try:
            plot(result, png)
        except Exception as e:  # the JSON is what matters; say why the picture is missing
            print(f"[rl_step] plot failed: {type(e).__name__}: {e}", file=sys.stderr)
    return png


# --------------------------------------------------------------------------------------------------- parent


def _run_child(cmd, env, timeout: float):
    """Run a point; forward its output; return (rc or None on time-out, last lines)."""
    tail = collections.deque(maxlen=60)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                            start_new_session=True)

    def pump():
        for line in proc.stdout:
            tail.append(line.rstrip("\n"))
            sys.stdout.write(line)
            sys.stdout.flush()

    t = threading.Thread(target=pump, daemon=True)
    t.start()
    try:
        rc = proc.wait(timeout=max(timeout, 1.0))
    except subprocess.TimeoutExpired:
        import signal

        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=20)
        except Exception:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        rc = None
    t.join(timeout=5)
    return rc, list(tail)


def memory_analysis(args) -> int:
    """Compile (for this host's backend) the trainer's logprob and update programs at each point's shapes with
    abstract arrays and print XLA's memory analysis (argument / output / temp bytes). Nothing is allocated or run."""
    import jaxrl_fp8  # noqa: F401
    import jax
    import jax.numpy as jnp
    import optax  # noqa: F401
    from flax import nnx

    from jaxrl_fp8 import train
    from jaxrl_fp8.model.config import tiny_config
    from jaxrl_fp8.model.qwen3 import Qwen3
    from jaxrl_fp8.precision import get_recipe
    from jaxrl_fp8.rl.losses import PolicyLossConfig
    from jaxrl_fp8.rl.trainer import Trainer, TrainerSettings, make_optimizer

    backend = jax.default_backend()
    out = os.path.abspath(args.out or os.path.join(RESULTS, f"{MEMORY_ANALYSIS}_{'cpu_tiny' if args.tiny else backend}.json"))
    section_name = f"lowered_for_{args.lower_platform}" if args.lower_platform else f"compiled_for_{backend}"
    try:
        with open(out) as f:
            prior = json.load(f)
    except (OSError, ValueError):
        prior = None
    what = (f"lowered for {args.lower_platform} on this host (the ops choosing their Hopper kernels), not compiled or run"
            if args.lower_platform else "compiled for this host (XLA's memory analysis), not run")
    section = dict(what=what, tiny=args.tiny, date=time.strftime("%Y-%m-%dT%H:%M:%S%z"), jax=jax.__version__,
                   command="python experiments/benchmarks/rl_step.py " + " ".join(sys.argv[1:]), results=[])
    results = section["results"]
    if args.lower_platform == "cuda":  # the ops choose their Mosaic GPU kernels as on an H200
        from jaxrl_fp8.ops import backends

        backends.default_device_is_hopper = lambda: True
        from pallas_kernels import interpret as interpret_mode

        real_num_sms = interpret_mode.num_sms  # the kernels size their persistent grid from the device: an H200's 132 SMs
        interpret_mode.num_sms = lambda interpret: real_num_sms(interpret) if interpret else 132
    for length in args.lengths:
        s = point_sizes(args, length)
        for recipe_name in args.recipe_list:
            c = point_config(args, recipe_name, length, os.path.join(args.runs_dir, "memory_analysis"))
            validate_point(c)
            recipe = get_recipe(c.recipe)
            m = c.model
            cfg = tiny_config(vocab_size=m.vocab_size, hidden_size=m.hidden_size, num_hidden_layers=m.num_hidden_layers,
                              num_attention_heads=m.num_attention_heads, num_key_value_heads=m.num_key_value_heads,
                              head_dim=m.head_dim, num_experts=m.num_experts, num_experts_per_tok=m.num_experts_per_tok,
                              moe_intermediate_size=m.moe_intermediate_size, intermediate_size=m.intermediate_size,
                              mlp_only_layers=(), norm_topk_prob=True, rope_theta=m.rope_theta,
                              attention_impl=m.attention_impl)
            abstract = nnx.eval_shape(lambda: Qwen3(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0)))
            graphdef, params = nnx.split(abstract)
            params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float32), params)
            optimizer, schedule = make_optimizer(c.rl, 10)
            opt_state = jax.eval_shape(optimizer.init, params)
            train_policy, _ = train._policies(c, recipe, cfg)
            t = object.__new__(Trainer)  # the trainer's own pure pieces, without arrays
            t.s = TrainerSettings(total_steps=1, prompts_per_step=s["prompts"], n_samples=s["samples"],
                                  seq_len=args.prompt_tokens + length, temperature=1.0, top_p=1.0, top_k=-1,
                                  max_new_tokens=length, routing_replay=True, advantage="grpo", std_normalize=True,
                                  num_minibatches=s["rows"] // s["batch"], loss=PolicyLossConfig(use_tis=True),
                                  backward=recipe.backward, compute_dtype=jnp.bfloat16, seed=0,
                                  micro_batch_rows=c.rl.micro_batch_rows, logit_chunk_tokens=c.rl.logit_chunk_tokens)
            t.graphdef, t.optimizer, t.train_policy, t.plan, t.moe_impl = graphdef, optimizer, train_policy, None, None
            seq = args.prompt_tokens + length
            k = cfg.num_experts_per_tok

            def abs_rows(n):
                return (jax.ShapeDtypeStruct((n, seq), jnp.int32),
                        jax.ShapeDtypeStruct((n, seq, cfg.num_hidden_layers, k), jnp.int32))

            entry = dict(recipe=recipe_name, response_tokens=length, layers=cfg.num_hidden_layers, sizes=s,
                         backend=jax.default_backend(), params=param_counts(FULL if not args.tiny else TINY, cfg.num_hidden_layers),
                         estimate=memory_estimate(FULL if not args.tiny else TINY, cfg.num_hidden_layers,
                                                  s["micro_batch"], seq, c.rl.logit_chunk_tokens))
            push, rollout, rollout_args = _engine_programs(graphdef, params, train_policy.with_format(recipe.rollout_format),
                                                           s["rows"], args.prompt_tokens, length)
            for name, fn, call in (
                ("rollout", rollout, lambda: rollout_args),
                ("logprob", t._logprobs, lambda: (params, *abs_rows(s["logprob_chunk"]))),
                ("update", t._update, lambda: (params, opt_state, _abstract_mb(*abs_rows(s["batch"]), seq),
                                               jax.ShapeDtypeStruct((), jnp.float32))),
                ("sync", push, lambda: (jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.bfloat16), params),)),
            ):
                t0 = time.time()
                try:
                    if args.lower_platform:
                        txt = jax.jit(fn).trace(*call()).lower(lowering_platforms=(args.lower_platform,)).as_text()
                        entry[name] = dict(lowered_for=args.lower_platform, lower_seconds=time.time() - t0,
                                           mosaic_gpu_mentions=txt.count("mosaic_gpu"),
                                           flash_attention_mentions=txt.count("attention_fwd") + txt.count("attention_paged"),
                                           hlo_text_chars=len(txt))
                        print(f"[rl_step] lowered {recipe_name} {length} {name} for {args.lower_platform}: {entry[name]}", flush=True)
                        continue
                    donated = Trainer.UPDATE_DONATED if name == "update" else ()  # as the trainer jits it
                    compiled = jax.jit(fn, donate_argnums=donated).lower(*call()).compile()
                    ma = compiled.memory_analysis()
                    entry[name] = dict(compile_seconds=time.time() - t0, **{
                        a: int(getattr(ma, a)) for a in ("argument_size_in_bytes", "output_size_in_bytes",
                                                         "alias_size_in_bytes", "temp_size_in_bytes",
                                                         "generated_code_size_in_bytes")
                        if ma is not None and hasattr(ma, a)})
                except Exception as e:
                    entry[name] = dict(error=f"{type(e).__name__}: {str(e)[:2000]}", compile_seconds=time.time() - t0)
                print(f"[rl_step] memory analysis {recipe_name} {length} {name}: "
                      + json.dumps({kk: (round(v / 1e9, 3) if kk.endswith("bytes") else v) for kk, v in entry[name].items()}),
                      flush=True)
            results.append(entry)
            _write_json(out, memory_analysis_doc(prior, section_name, section, backend))
    print(out)
    return 0


def memory_analysis_doc(prior: dict | None, name: str, section: dict, backend: str) -> dict:
    """The --memory-analysis result: one section per mode (compiled_for_<backend>, lowered_for_<platform>) of one host
    backend; `section` replaces its namesake in `prior`, whose other sections are kept when they are of the same host
    backend and size (--tiny or not), else dropped."""
    keep = {}
    if prior and prior.get("benchmark") == MEMORY_ANALYSIS and prior.get("host_backend") == backend:
        keep = {k: v for k, v in (prior.get("sections") or {}).items() if k != name and v.get("tiny") == section["tiny"]}
    return dict(benchmark=MEMORY_ANALYSIS,
                what="one RL step's programs (rollout generate, old log-probs, update, weight push) at rl_step.py's "
                     "shapes, analysed without running them; a section per mode (compiled_for_<host backend>: XLA's "
                     "memory analysis; lowered_for_<platform>: whether they lower there)",
                host_backend=backend, sections=dict(sorted({**keep, name: section}.items())))


def _engine_programs(graphdef, params, rollout_precision, rows: int, prompt_tokens: int, length: int):
    """The embedded engine's programs at one step's shapes, for abstract arrays: the weight push (the compute-dtype
    model -> rollout operands through the contract; eager per tensor in the engine, one program here) and
    generate (prefill + the decode while-loop), bucketed as `EmbeddedEngine._run_chunk` buckets a chunk of
    `rows` rows (every row of a step in one chunk: rollout.max_batch = rows)."""
    import functools

    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxrl_fp8.rollout import embedded as E

    def push(state):
        return E.prepare_rollout_params(nnx.merge(graphdef, state), rollout_precision)[1]

    state_r = jax.eval_shape(push, jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.bfloat16), params))
    cfg = E.EngineConfig(max_batch=rows, max_seq_len=prompt_tokens + length)
    b = E._bucket(rows, 1, cfg.max_batch)
    p_b, s_b = E._bucket(prompt_tokens, cfg.min_prompt_bucket), E._bucket(prompt_tokens + length, cfg.min_cache_bucket)
    n_b = E._bucket(length, cfg.min_new_bucket)
    i32, f32 = jnp.int32, jnp.float32
    sd = jax.ShapeDtypeStruct
    row_args = E._Rows(sd((b,), f32), sd((b,), i32), sd((b,), f32), sd((b,), jnp.uint32), sd((b,), i32), sd((b, 1), i32))
    generate = functools.partial(E._generate_while.__wrapped__ if hasattr(E._generate_while, "__wrapped__") else E._generate_while,
                                 graphdef, precision=rollout_precision, cache_len=s_b, max_new=n_b, dtype=jnp.bfloat16)
    return push, generate, (state_r, sd((b, p_b), i32), sd((b,), i32), row_args)


def _abstract_mb(tokens, routed, seq):
    import jax
    import jax.numpy as jnp

    n = tokens.shape[0]
    f = jax.ShapeDtypeStruct((n, seq - 1), jnp.float32)
    return {"tokens": tokens, "old_logp": f, "rollout_logp": f, "mask": f,
            "advantages": jax.ShapeDtypeStruct((n,), jnp.float32), "routed": routed}


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.merge:
        if not args.out:
            print("error: --merge needs --out", file=sys.stderr)
            return 2
        points, meta = {}, None
        for path in [p for p in args.merge.split(",") if p]:
            with open(path) as f:
                r = json.load(f)
            meta = meta or {k: r.get(k) for k in ("benchmark", "what", "tiny", "shapes", "env")}
            sh, new = meta.get("shapes") or {}, r.get("shapes") or {}
            if sh is not new:  # per-length entries of every file (a 1k file and a 4k file)
                for key in ("layers", "params", "sizes", "memory_estimate"):
                    if isinstance(sh.get(key), dict) and isinstance(new.get(key), dict):
                        sh[key] = {**sh[key], **new[key]}
                sh["response_lengths"] = sorted(set(sh.get("response_lengths") or []) | set(new.get("response_lengths") or []))
            meta.setdefault("merged_from", [])
            for p in r["points"]:
                points[(p["recipe"], p["response_tokens"])] = p  # a later file's point replaces an earlier one's
            meta.setdefault("commands", []).append(r.get("command"))
        meta["merged_from"] = args.merge.split(",")
        meta["date"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        order = {r: i for i, r in enumerate(RECIPES)}
        pts = sorted(points.values(), key=lambda p: (p["response_tokens"], order.get(p["recipe"], 9)))
        result = assemble(meta, pts, args.warmup_steps)
        png = write_result(result, args.out)
        print(table(result))
        print(args.out)
        print(png)
        return 0
    try:
        resolve_args(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    args.runs_dir = os.path.abspath(args.runs_dir or os.path.join(REPO, "runs", "rl_step_tiny" if args.tiny else "rl_step"))
    if args.memory_analysis:  # its own result file (default: results/rl_step_memory_analysis_<host backend>.json)
        return memory_analysis(args)
    default_name = "rl_step_cpu_tiny.json" if args.tiny else "rl_step_h200.json"
    args.out = os.path.abspath(args.out or os.path.join(RESULTS, default_name))
    if args.child:
        return child(args)

    # every point's config is built and validated before anything runs
    shape = _shape_module()
    if not os.path.isfile(shape["dataset_path"](args.prompt_tokens)):
        shape["write_dataset"](args.prompt_tokens)
    plan = []
    try:
        for length in args.lengths:
            for recipe in args.recipe_list:
                validate_point(point_config(args, recipe, length, os.path.join(args.runs_dir, f"{recipe}_{length}")))
                plan.append((recipe, length))
    except Exception as e:
        print(f"error: invalid configuration: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    model = dict(TINY if args.tiny else FULL)
    sizes = {n: point_sizes(args, n) for n in args.lengths}
    meta = dict(
        benchmark="rl_step", what="whole RL steps through jaxrl_fp8.train.run (embedded rollout, R3, TIS, weight push), "
        "Qwen3-30B-A3B-shaped slice from random init, one device", tiny=args.tiny,
        command="python experiments/benchmarks/rl_step.py " + " ".join(sys.argv[1:] if argv is None else argv),
        date=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        shapes=dict(model=model, prompt_tokens=args.prompt_tokens, response_lengths=args.lengths,
                    layers={str(n): sizes[n]["layers"] for n in args.lengths},
                    params={str(n): param_counts(model, sizes[n]["layers"]) for n in args.lengths},
                    sizes={str(n): sizes[n] for n in args.lengths},
                    memory_estimate={str(n): memory_estimate(model, sizes[n]["layers"], sizes[n]["micro_batch"],
                                                             args.prompt_tokens + n, args.logit_chunk or 0)
                                     for n in args.lengths}),
        warmup_steps=args.warmup_steps, time_budget_seconds=args.time_budget or None,
        env={k: os.environ.get(k) for k in ("XLA_FLAGS", "XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_PREALLOCATE",
                                            "XLA_PYTHON_CLIENT_ALLOCATOR", "JAXRL_FP8_HIGH_PRECISION", "JAX_PLATFORMS")})
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(REPO, "src"), REPO] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["PYTHONUNBUFFERED"] = "1"
    if env.get("XLA_PYTHON_CLIENT_PREALLOCATE", "").lower() != "false":
        env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.94")  # default 0.75 would leave 35 GB of an H200 unused
    if args.compile_cache:
        env["JAX_COMPILATION_CACHE_DIR"] = args.compile_cache
    if args.fast_compile:
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()
    meta["env"]["child_XLA_PYTHON_CLIENT_MEM_FRACTION"] = env.get("XLA_PYTHON_CLIENT_MEM_FRACTION")
    os.makedirs(args.runs_dir, exist_ok=True)
    t_begin = time.time()
    points: list[dict] = []
    longest: dict[int, float] = {}
    for recipe, length in plan:
        elapsed = time.time() - t_begin
        left = (args.time_budget - elapsed) if args.time_budget else None
        need = max(args.min_point_seconds, longest.get(length, 0.0))
        if left is not None and left < need:
            points.append(dict(recipe=recipe, response_tokens=length, status="skipped", rows=[],
                               error=f"time budget: {left:.0f} s left of {args.time_budget:.0f}, a point needs ~{need:.0f} s"))
            print(f"[rl_step] {recipe} {length}: skipped ({points[-1]['error']})", flush=True)
            write_result(assemble(meta, points, args.warmup_steps), args.out, with_plot=False)
            continue
        part_path = os.path.join(args.runs_dir, f"{recipe}_{length}.part.json")
        if os.path.exists(part_path):
            os.remove(part_path)
        cmd = [sys.executable, os.path.abspath(__file__), "--child", f"{recipe}:{length}", "--child-out", part_path,
               "--out", args.out, "--runs-dir", args.runs_dir,
               "--prompt-tokens", str(args.prompt_tokens), "--response-lengths", str(length), "--seed", str(args.seed),
               "--recipes", recipe, "--embed-init-std", str(args.embed_init_std),
               "--scaled-output-init" if args.scaled_output_init else "--no-scaled-output-init"]
        for flag, v in (("--layers", args.layers), ("--steps", args.steps), ("--prompts", args.prompts), ("--samples-per-prompt", args.samples_per_prompt),
                        ("--batch", args.batch), ("--micro-batch", args.micro_batch), ("--logit-chunk", args.logit_chunk), ("--logprob-chunk", args.logprob_chunk), ("--attention-impl", args.attention_impl)):
            if v is not None:
                cmd += [flag, str(v)]
        if args.tiny:
            cmd.append("--tiny")
        for a in args.set:
            cmd += ["--set", a]
        timeout = min(args.timeout, left) if left is not None else args.timeout
        print(f"[rl_step] {recipe} {length}: starting (timeout {timeout:.0f} s)", flush=True)
        t0 = time.time()
        rc, tail = _run_child(cmd, env, timeout)
        wall = time.time() - t0
        try:
            with open(part_path) as f:
                point = json.load(f)
        except (OSError, ValueError):
            point = dict(recipe=recipe, response_tokens=length, rows=[])
        point["point_wall_seconds"] = wall
        if rc is None:
            point.update(status="timeout", error=f"stopped after {wall:.0f} s (time-out {timeout:.0f} s); "
                                                 f"{len(point.get('rows', []))} steps measured")
        elif rc != 0 and point.get("status") != "error":
            point.update(status="error", error=f"point process exited with {rc}: " + "\n".join(tail[-15:])[-3000:])
        elif point.get("status") not in ("ok", "error"):
            point.update(status="error", error=f"point process ended in state {point.get('status')!r}: " + "\n".join(tail[-15:])[-3000:])
        if point["status"] == "ok":
            longest[length] = max(longest.get(length, 0.0), wall)
        points.append(point)
        result = assemble(meta, points, args.warmup_steps)
        write_result(result, args.out, with_plot=False)  # after every point: a run cut short keeps what it measured
        print(f"[rl_step] {recipe} {length}: {point['status']} in {wall:.0f} s", flush=True)
    result = assemble(meta, points, args.warmup_steps)
    result["wall_seconds"] = time.time() - t_begin
    png = write_result(result, args.out)
    print(table(result))
    print(args.out)
    print(png)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
