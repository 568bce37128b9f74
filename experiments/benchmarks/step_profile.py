"""Where the time of one decode step and of one train update goes, per kernel (JAX's profiler, one device command).

Why: on the H200 a decode step of the embedded engine (Qwen3-30B-A3B-shaped slice, 4 layers, 256 active rows,
256-token prompts; rollout_workload.py) takes 4.16 ms in bf16 and 3.72 ms in fp8_block against HBM rooflines of
1.91 / 1.15 ms, and the trainer's update phase (rl_step.py) takes as long in fp8_block as in bf16. This says which
kernels (or which gaps between them) the time goes to.

Programs (`--programs`, both by default), each for every recipe of `--recipes` (bf16, fp8_block):
- decode: the embedded engine as rollout_workload.step_measurement builds it (`EngineConfig(scheduler="continuous")`,
  `--slots` rows, response buffer and cache buckets of `--max-len` responses, so the shapes are the workload's);
  `--slots` prompts of `--prompt-len` random tokens generate `--step-new` tokens (`ignore_eos`): one prefill, then
  step_new - 1 decode steps in one call of `programs.decode_slots`. Per step = the kernels of that program (XLA
  module `jit_decode_slots`) / the decode steps; the other programs of a generate (prefill_prompts, place_rows,
  take_rows, the slot set-up: the prefill side) are listed per generate beside it. A 1-token generate is profiled
  too: per kernel, (full - 1-token) / (step_new - 1) is the cross-check (`by_difference`), and the per-step
  attribution if the events carry no module name.
- update: one optimizer update of the trainer, `rl.trainer.Trainer._update_jit` (what `Trainer.apply_update`
  runs; forward, loss, backward in the recipe's backward mode, AdamW on FP32 masters), built as train.py builds it
  (`train.trainer_settings`, `train._policies`, `make_optimizer` of `config.base_config()`; compute dtype bfloat16,
  R3 routing replay, TIS), on a minibatch of `--update-rows` rows x `--update-len` tokens (default 2 x 1280:
  rl_step.py's 1k point, prompt 256 + response 1024; the response tokens masked in), random routed experts.

Each program is compiled and run once (`compile_and_first_run_s`), timed without the profiler (best of
`--timing-repeats`: `wall_ms_per_step.no_profiler`, for decode (t(step_new) - t(1)) / (step_new - 1) as
rollout_workload.py), then run `--repeats` times inside `jax.profiler.start_trace` / `stop_trace`, and the XSpace
read back with `jax.profiler.ProfileData`:
- GPU (a plane named "/device:GPU:<n>"): its CUPTI stream lines "Stream #<id>(<event kinds>)", one event per kernel /
  memcpy / memset, named after the CUDA kernel (XLA fusions by their HLO name, "loop_add_fusion"; our Mosaic GPU
  kernels "<name>_mosaic_gpu_kernel": gemm_grouped_fp8, attention_paged, quantize_fp8_g128, ...), with XLA's
  annotations as stats (hlo_op, hlo_module). Derived lines ("XLA Ops", "XLA Modules", "Steps", "Launch Stats", ...)
  repeat those kernels and are not summed; "XLA Ops" is the fallback when there is no stream line. ASSUMED from
  XLA's CUPTI collector, not yet seen on this repository's GPU runs: every plane's lines (name, events, summed
  ms) are written to the JSON (`trace.lines`), so the next reader can fix the parser from a GPU result.
- CPU (no device plane): the host plane "/host:CPU", the events with an `hlo_op` stat (XLA:CPU's thunks on the
  thread lines "tf_XLAPjRtCpuClient/<id>", "tf_XLAEigen/<id>"). A while loop's thunk holds its body's thunks on the
  same line, so each event counts its self time (its duration minus its children's); on the GPU nothing nests.

Reported per (program, recipe), per step (decode) or per call (update): kernel time (the sum of self times;
categories and top kernels sum to it), busy time (the union of the kernels' intervals), span (first kernel start
to last kernel end of each call of the program, summed), kernels per step, time per category (ordered (category,
regex) rules on the kernel name, CATEGORIES) with shares, the `--top` kernels, and the gap = wall (no profiler)
- kernel time: the time the device runs none of the step's kernels (launch and host overhead, the while loop's
condition copied to the host every step, idle). Under the profiler XLA runs without command buffers (CUDA graphs;
XLA's --xla_enable_command_buffers_during_profiling=false; `--command-buffers-in-profile` sets it true) and CUPTI
adds a cost per launch, so the profiled wall is longer than the unprofiled; kernel durations are the device's.

With `--hlo-dump DIR` (the run started with XLA_FLAGS="--xla_dump_to=DIR --xla_dump_hlo_as_text"), each point's top
kernels also carry the source lines of the ops they run and whether that is backward work (`hlo_sources`: XLA's
optimized HLO of the program's module), and `hlo_sources.by_source` sums their time by dominant source line: which
line of the model or the loss an elementwise fusion computes, which the kernel name does not say.

    python experiments/benchmarks/step_profile.py            # the H200 run -> results/step_profile_gpu.json
    python experiments/benchmarks/step_profile.py --tiny     # CPU smoke run (< 2 minutes) -> results/step_profile_cpu_tiny.json
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import math
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
import traceback
import warnings

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import hlo_sources  # noqa: E402
from model_slice import add_model_slice_args, apply_tiny_slice, model_config_from_args, slice_fields  # noqa: E402
from timing import run_header, write_results  # noqa: E402

PROGRAMS = ("decode", "update")
DECODE_MODULE = "decode_slots"  # programs.decode_slots: its XLA module is jit_decode_slots
UPDATE_MODULE = "_update"  # Trainer._update (jit__update)

# Ordered (category, regex) rules; the first regex found (re.search) in the lower-cased kernel name wins. Our
# Mosaic GPU kernels are named "<name>_mosaic_gpu_kernel" (the names given in pallas_kernels: gemm_dense,
# gemm_grouped, gemm_grouped_bf16, gemm_grouped_wgrad, attention_*, quantize_*); XLA's kernels carry the HLO name
# of their fusion / op; cuBLAS and CUTLASS theirs (sm90_xmma_gemm_..., nvjet_..., cutlass...); CUPTI names copies
# Memcpy<kind> / Memset. On CPU the names are XLA:CPU's thunks (ynn_fusion: YNNPACK dots; while.N: loop control).
CATEGORIES = (
    ("fp8 grouped GEMM (ours)", r"gemm_grouped_fp8"),
    ("fp8 grouped wgrad (ours)", r"gemm_wgrad_fp8"),
    ("fp8 dense GEMM (ours)", r"gemm_dense_fp8"),
    ("bf16 grouped GEMM (ours)", r"gemm_grouped_bf16|gemm_wgrad_bf16"),
    ("bf16 dense GEMM (ours: split-BF16 router / lm_head / projections)", r"gemm_dense_bf16"),
    ("flash attention (ours)", r"attention_(fwd|bwd|paged)"),
    ("quantize (ours)", r"quantize_"),
    ("Mosaic GPU, unnamed", r"mosaic_gpu"),
    ("dense GEMM (cuBLAS / CUTLASS / XLA dot)", r"cublas|cutlass|xmma|nvjet|gemm|matmul|^dot|dot_|convolution|ynn_fusion|onednn"),
    ("sort / scatter / gather (routing, sampling, cache writes)",
     r"sort|scatter|gather|radix|cub::|top_?k|dynamic[-_]update[-_]slice|dynamic[-_]slice"),
    ("copies / memcpy / memset", r"memcpy|memset|^(wrapped_)?copy|copy_fusion|transpose|concatenate"),
    ("reductions", r"reduce|reduction|argmax|argmin|cumsum|^input_"),
    ("fusions (loop / elementwise)", r"fusion|^wrapped_|^loop_|triton"),
    ("while-loop control", r"^while|^conditional|^condition"),
    ("other", r""),
)
_RULES = tuple((name, re.compile(rx)) for name, rx in CATEGORIES)
# jaxlib's profiler bindings warn once per stat / event type they convert ("builtin type ... has no __module__")
warnings.filterwarnings("ignore", message="builtin type .* has no __module__", category=DeprecationWarning)

# lines of a device plane that are derived from (and repeat) the kernels of its stream lines
DERIVED_LINES = frozenset({"XLA Ops", "XLA Modules", "Async XLA Ops", "Steps", "Launch Stats", "Framework Ops",
                           "Framework Name Scope", "TensorFlow Ops", "TensorFlow Name Scope", "Source code",
                           "XLA TraceMe", "Host Offload Ops", "_counters_", "CUPTI overhead", "SparseCore Steps",
                           "Sparse Core Steps", "Sparse Core Ops", "Sparse Core Modules"})


def categorize(name: str) -> str:
    """The category of a kernel (or XLA:CPU thunk) name: the first rule of CATEGORIES whose regex it contains."""
    low = name.lower()
    for category, rx in _RULES:
        if rx.search(low):
            return category
    return "other"


# ---------------------------------------------------------------------------------------------- trace parsing


@dataclasses.dataclass
class Kernel:
    name: str
    op: str | None  # the hlo_op stat (XLA's instruction), if any
    module: str | None  # the hlo_module stat (XLA's module, e.g. jit_decode_slots), if any
    start_ns: float
    dur_ns: float
    self_ns: float
    line: str

    @property
    def end_ns(self) -> float:
        return self.start_ns + self.dur_ns


def _stats(obj) -> dict:
    out = {}
    try:
        for key, value in obj.stats:
            out.setdefault(key, value)
    except Exception:  # a stat type the bindings cannot convert: the event still counts, without it
        pass
    return out


def _is_device_plane(name: str) -> bool:
    return name.startswith("/device:") and not name.startswith("/device:CPU") and not name.startswith("/device:CUSTOM")


def line_inventory(profile) -> list[dict]:
    """Every plane's lines: name, event count, summed duration (ms). Written to the JSON so that a trace whose lines
    the parser does not expect can be read and the parser fixed."""
    out = []
    for plane in profile.planes:
        for line in plane.lines:
            n, total = 0, 0.0
            for ev in line.events:
                n += 1
                total += ev.duration_ns
            out.append({"plane": plane.name, "line": line.name, "events": n, "ms": total / 1e6})
        if not any(True for _ in plane.lines):
            out.append({"plane": plane.name, "line": None, "events": 0, "ms": 0.0})
    return out


def _with_self_times(kernels: list[Kernel]) -> list[Kernel]:
    """Self time of events on one line: duration minus the durations of the events nested directly in it."""
    kernels.sort(key=lambda k: (k.start_ns, -k.dur_ns))
    stack: list[Kernel] = []
    for k in kernels:
        while stack and stack[-1].end_ns <= k.start_ns:
            stack.pop()
        if stack:
            parent = stack[-1]
            parent.self_ns -= min(k.end_ns, parent.end_ns) - k.start_ns
        stack.append(k)
    for k in kernels:
        k.self_ns = max(k.self_ns, 0.0)
    return kernels


def _line_kernels(plane_name: str, line, require_op: bool) -> list[Kernel]:
    out = []
    for ev in line.events:
        st = _stats(ev)
        if require_op and "hlo_op" not in st:
            continue
        op, module = st.get("hlo_op"), st.get("hlo_module")
        out.append(Kernel(name=str(ev.name), op=None if op is None else str(op), module=None if module is None else str(module),
                          start_ns=float(ev.start_ns), dur_ns=float(ev.duration_ns), self_ns=float(ev.duration_ns),
                          line=f"{plane_name}:{line.name}"))
    return _with_self_times(out)


def trace_kernels(profile) -> tuple[list[Kernel], str]:
    """(kernels, source) of a profile: the device planes' stream lines when there are any ("device_streams"), else
    their "XLA Ops" lines ("device_xla_ops"), else their other non-derived lines ("device_lines"); without a device
    plane, the host planes' events that carry an hlo_op stat ("host_xla_ops": XLA:CPU)."""
    planes = list(profile.planes)
    device = [p for p in planes if _is_device_plane(p.name)]
    for source, pick in (("device_streams", lambda name: name.startswith("Stream #")),
                         ("device_xla_ops", lambda name: name == "XLA Ops"),
                         ("device_lines", lambda name: name not in DERIVED_LINES)):
        kernels = [k for p in device for line in p.lines if pick(line.name) for k in _line_kernels(p.name, line, False)]
        if kernels:
            return kernels, source
    kernels = [k for p in planes if p.name.startswith("/host:") for line in p.lines for k in _line_kernels(p.name, line, True)]
    return kernels, "host_xla_ops"


def trace_info(profile, kernels: list[Kernel], source: str) -> dict:
    """What the parser used: source, kernel count, how many carry hlo_module / hlo_op, the modules seen, and the stat
    keys of the first event of each line it read (so a GPU result shows which annotations its kernels have)."""
    used = {k.line for k in kernels}
    keys = {}
    for plane in profile.planes:
        for line in plane.lines:
            name = f"{plane.name}:{line.name}"
            if name in used and len(keys) < 8:
                for ev in line.events:
                    st = _stats(ev)
                    if source != "host_xla_ops" or "hlo_op" in st:
                        keys[name] = sorted(st)
                        break
    modules = collections.Counter(k.module for k in kernels if k.module)
    return {"source": source, "kernels": len(kernels), "with_hlo_module": sum(1 for k in kernels if k.module),
            "with_hlo_op": sum(1 for k in kernels if k.op), "modules": dict(modules.most_common(20)),
            "stat_keys_of_first_event": keys}


def load_profile(trace_dir: str):
    """The ProfileData of the newest XSpace (<dir>/plugins/profile/<run>/<host>.xplane.pb) under trace_dir."""
    from jax.profiler import ProfileData

    files = sorted(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True), key=os.path.getmtime)
    if not files:
        raise RuntimeError(f"no *.xplane.pb under {trace_dir}: the profiler wrote no trace")
    return ProfileData.from_file(files[-1]), files[-1]


def profiled(fn, trace_dir: str, repeats: int):
    """Run fn() `repeats` times inside one profiler trace (python tracer off); returns (host seconds per call, the
    values fn returned, kernels, trace description: source, xplane, trace_info, every line)."""
    import jax

    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0  # the Python tracer's events are not needed and cost time per call
    os.makedirs(trace_dir, exist_ok=True)
    jax.profiler.start_trace(trace_dir, profiler_options=options)
    walls, values = [], []
    try:
        for _ in range(repeats):
            t = time.perf_counter()
            values.append(fn())
            walls.append(time.perf_counter() - t)
    finally:
        jax.profiler.stop_trace()
    profile, path = load_profile(trace_dir)
    kernels, source = trace_kernels(profile)
    return walls, values, kernels, dict(trace_info(profile, kernels, source), xplane=path, lines=line_inventory(profile))


# ---------------------------------------------------------------------------------------------- summaries


def busy_ns(kernels: list[Kernel]) -> float:
    """Length of the union of the kernels' intervals (overlapping streams or nested thunks count once)."""
    total, end = 0.0, -math.inf
    for k in sorted(kernels, key=lambda k: k.start_ns):
        if k.end_ns <= end:
            continue
        total += k.end_ns - max(k.start_ns, end)
        end = k.end_ns
    return total


def spans(kernels: list[Kernel], belongs) -> list[tuple[float, float]]:
    """(start, end) of each maximal run, in time order, of kernels for which belongs(kernel) holds (events without a
    module neither break nor extend a run): one run per call of a program when calls are apart."""
    out: list[list[float]] = []
    open_run = False
    for k in sorted(kernels, key=lambda k: k.start_ns):
        if k.module is None and not belongs(k):
            continue
        if belongs(k):
            if open_run:
                out[-1][1] = max(out[-1][1], k.end_ns)
            else:
                out.append([k.start_ns, k.end_ns])
                open_run = True
        else:
            open_run = False
    return [(a, b) for a, b in out]


def summarize(kernels: list[Kernel], per: float, top: int) -> dict:
    """Kernel time, count, categories and the `top` kernels of `kernels`, divided by `per` (steps or calls)."""
    by_name: dict[str, list] = {}
    for k in kernels:
        e = by_name.setdefault(k.name, [0, 0.0, collections.Counter(), collections.Counter()])
        e[0] += 1
        e[1] += k.self_ns
        e[2][k.op] += 1
        e[3][k.module] += 1
    return summarize_totals({n: (c, ns) for n, (c, ns, _, _) in by_name.items()}, per, top,
                            ops={n: e[2].most_common(1)[0][0] for n, e in by_name.items()},
                            modules={n: sorted(m for m in e[3] if m) for n, e in by_name.items()})


def summarize_totals(totals: dict[str, tuple[float, float]], per: float, top: int, ops=None, modules=None) -> dict:
    """`summarize` from per-name (count, self ns) totals (a difference of two profiles may hold negative entries)."""
    kernel_ns = sum(ns for _, ns in totals.values())
    cats: dict[str, list] = {}
    for name, (count, ns) in totals.items():
        c = cats.setdefault(categorize(name), [0.0, 0.0])
        c[0] += ns
        c[1] += count
    share = (lambda ns: ns / kernel_ns) if kernel_ns > 0 else (lambda ns: None)
    categories = [{"category": cat, "ms": ns / per / 1e6, "share": share(ns), "kernels": count / per}
                  for cat, (ns, count) in sorted(cats.items(), key=lambda kv: -kv[1][0])]
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][1])[:top]
    top_kernels = []
    for name, (count, ns) in ranked:
        entry = {"name": name, "category": categorize(name), "count": count / per, "ms": ns / per / 1e6, "share": share(ns)}
        if ops and ops.get(name) and ops[name] != name:
            entry["hlo_op"] = ops[name]
        if modules and modules.get(name):
            entry["modules"] = modules[name]
        top_kernels.append(entry)
    kinds: dict[str, list] = {}
    for name, (count, ns) in totals.items():
        e = kinds.setdefault(kind(name), [0.0, 0.0, 0])
        e[0] += count
        e[1] += ns
        e[2] += 1
    top_kinds = [{"kind": k, "category": categorize(k), "names": n, "count": count / per, "ms": ns / per / 1e6, "share": share(ns)}
                 for k, (count, ns, n) in sorted(kinds.items(), key=lambda kv: -kv[1][1])[:top]]
    return {"kernel_ms": kernel_ns / per / 1e6, "kernels": sum(c for c, _ in totals.values()) / per,
            "categories": categories, "top_kernels": top_kernels, "top_kinds": top_kinds}


def kind(name: str) -> str:
    """A kernel name without its instance numbers ("loop_add_fusion_3", "copy.291" -> "loop_add_fusion", "copy"):
    the per-layer instances of one XLA fusion, which are distinct kernels, as one kind."""
    while True:
        stripped = re.sub(r"[._]\d+$", "", name)
        if stripped == name or not stripped:
            return name
        name = stripped


def _name_totals(kernels: list[Kernel]) -> dict[str, tuple[int, float]]:
    out: dict[str, list] = {}
    for k in kernels:
        e = out.setdefault(k.name, [0, 0.0])
        e[0] += 1
        e[1] += k.self_ns
    return {n: (c, ns) for n, (c, ns) in out.items()}


def module_totals(kernels: list[Kernel], per: float) -> dict:
    """Kernel ms and count per XLA module, divided by `per` (events without a module under "(none)")."""
    out: dict[str, list] = {}
    for k in kernels:
        e = out.setdefault(k.module or "(none)", [0.0, 0])
        e[0] += k.self_ns
        e[1] += 1
    return {m: {"kernel_ms": ns / per / 1e6, "kernels": n / per} for m, (ns, n) in sorted(out.items(), key=lambda kv: -kv[1][0])}


def program_summary(kernels: list[Kernel], module: str, per: float, top: int) -> tuple[dict, str]:
    """The summary of the kernels of XLA module `module` (substring) / per, with busy and span; and the attribution
    ("module", or "all" when no event carries a module: every kernel of the trace)."""
    mine = [k for k in kernels if k.module and module in k.module]
    how = "module"
    if not mine:  # no event names the module (or carries a module at all): every kernel of the trace
        mine, how = list(kernels), "all"
    s = summarize(mine, per, top)
    belongs = (lambda k: bool(k.module) and module in k.module) if how == "module" else (lambda k: True)
    runs = spans(kernels, belongs)
    s.update(busy_ms=busy_ns(mine) / per / 1e6, span_ms=sum(b - a for a, b in runs) / per / 1e6, program_runs=len(runs))
    return s, how


# ---------------------------------------------------------------------------------------------- programs


def _best(values):
    return min(values) if values else math.nan


def _ms(x):
    return x * 1e3 if x is not None and math.isfinite(x) else None


def _finish(point: dict, per_step: dict, wall_s: float | None, wall_profiled_s: float | None) -> None:
    point["per_step"] = per_step
    point["wall_ms_per_step"] = {"no_profiler": _ms(wall_s), "profiled": _ms(wall_profiled_s)}
    k, busy, span = per_step["kernel_ms"], per_step["busy_ms"], per_step["span_ms"]
    w, wp = point["wall_ms_per_step"]["no_profiler"], point["wall_ms_per_step"]["profiled"]
    point["gap_ms_per_step"] = None if w is None else w - k
    point["gap_ms_per_step_profiled"] = None if wp is None else wp - k
    # device time inside the program's runs with no kernel; host time outside them (profiled)
    point["idle_in_program_ms_per_step"] = None if span is None else span - busy
    point["outside_program_ms_per_step_profiled"] = None if wp is None or span is None else wp - span


def decode_point(engine_cls, policy, cfg, args, rng, trace_dir: str) -> dict:
    """The decode step of the continuous engine (see the module docstring)."""
    from jaxrl_fp8.rollout.embedded import EngineConfig
    from jaxrl_fp8.rollout.types import SamplingParams

    n = args.step_new
    seq = args.prompt_len + args.max_len
    ec = EngineConfig(max_batch=args.slots, max_seq_len=seq, kv_pages=args.kv_pages, scheduler="continuous",
                      refill_every=max(n, args.refill_every), progress=False, static_shapes=args.static_shapes,
                      # rollout_workload.py's buckets: the response buffer and cache of --max-len responses
                      min_new_bucket=1 << (args.max_len - 1).bit_length(), min_cache_bucket=1 << (seq - 1).bit_length())
    engine = engine_cls(policy, engine_config=ec)
    prompts = rng.integers(0, cfg.vocab_size, size=(args.slots, args.prompt_len)).tolist()
    full = SamplingParams(temperature=1.0, max_new_tokens=n, ignore_eos=True, seed=1)
    one = SamplingParams(temperature=1.0, max_new_tokens=1, ignore_eos=True, seed=1)

    def gen(params):
        def run():
            samples = engine.generate(prompts, params)
            return float(engine.last_stats.get("decode_steps", 0.0)), len(samples)
        return run

    t = time.perf_counter()
    gen(full)()  # compiles every program of a generate
    gen(one)()
    first = time.perf_counter() - t
    walls_full, walls_one = [], []
    for _ in range(args.timing_repeats):
        t = time.perf_counter()
        steps, _ = gen(full)()
        walls_full.append(time.perf_counter() - t)
        t = time.perf_counter()
        gen(one)()
        walls_one.append(time.perf_counter() - t)
    wall_step = (_best(walls_full) - _best(walls_one)) / steps if steps > 0 else None
    pw_full, v_full, k_full, trace_full = profiled(gen(full), os.path.join(trace_dir, "full"), args.repeats)
    pw_one, _, k_one, trace_one = profiled(gen(one), os.path.join(trace_dir, "one"), args.repeats)
    steps_profiled = sum(s for s, _ in v_full)
    per_step, how = program_summary(k_full, DECODE_MODULE, max(steps_profiled, 1.0), args.top)
    # best of the repeats, as the unprofiled walls: a difference of two means went negative on a loaded 2-core CPU
    wall_profiled = ((_best(pw_full) - _best(pw_one)) / (steps_profiled / args.repeats) if steps_profiled else None)
    # the cross-check: per kernel name, (full - 1-token) / decode steps, over every module
    tf, to = _name_totals(k_full), _name_totals(k_one)
    diff = {name: ((tf.get(name, (0, 0.0))[0] - to.get(name, (0, 0.0))[0]) / args.repeats,
                   (tf.get(name, (0, 0.0))[1] - to.get(name, (0, 0.0))[1]) / args.repeats)
            for name in set(tf) | set(to)}
    by_difference = summarize_totals(diff, max(steps_profiled / args.repeats, 1.0), args.top)
    by_difference["note"] = ("(generate of step_new tokens - generate of 1 token) / decode steps, per kernel name over "
                             "every program: includes what the longer responses cost outside the decode program")
    if how == "all":  # no module names on the events: the difference is the per-step attribution
        per_step = dict(by_difference, busy_ms=None, span_ms=None, program_runs=None)
        how = "difference"
    point = {"program": "decode", "attribution": how, "decode_module": DECODE_MODULE,
             "compile_and_first_run_s": first, "calls_profiled": args.repeats, "steps_per_call": steps,
             "decode_steps_profiled": steps_profiled,
             "wall_s": {"generate_step_new": _best(walls_full), "generate_1": _best(walls_one),
                        "profiled_generate_step_new": _best(pw_full), "profiled_generate_1": _best(pw_one)},
             "other_modules_per_generate": {m: v for m, v in module_totals(k_full, args.repeats).items() if DECODE_MODULE not in m},
             "prefill_side_per_generate_1": module_totals(k_one, args.repeats),
             "by_difference": by_difference,
             "trace": dict(trace_full, one_token=trace_one)}
    _finish(point, per_step, wall_step, wall_profiled)
    return point


def build_update(args, recipe_name: str, model):
    """(the jitted update, its arguments, its Trainer) for a minibatch of --update-rows x --update-len tokens."""
    import jax.numpy as jnp

    from jaxrl_fp8 import train
    from jaxrl_fp8.config import base_config
    from jaxrl_fp8.precision import get_recipe
    from jaxrl_fp8.rl.trainer import Trainer, make_optimizer

    cfg = model.cfg
    c = base_config()  # the trainer's defaults: PPO clip, TIS, AdamW (lr, clipping), precision policy
    c.recipe = recipe_name
    c.model.dtype = "bfloat16"  # activations; masters FP32 (rl_step.py's points)
    c.rollout.routing_replay = True  # R3
    c.rl.use_tis = True
    c.rl.micro_batch_rows = args.update_micro_batch  # gradient accumulation inside the update (0: off)
    c.rl.logit_chunk_tokens = args.update_logit_chunk  # the loss's logits in chunks (0: all at once)
    recipe = get_recipe(recipe_name)
    train_policy, _ = train._policies(c, recipe, cfg)
    settings = train.trainer_settings(c, recipe, cfg, args.update_len)
    optimizer, schedule = make_optimizer(c.rl, max(c.total_steps * c.rl.num_minibatches, 2))
    trainer = Trainer(model=model, settings=settings, optimizer=optimizer, schedule=schedule, engine=None, tokenizer=None,
                      loader=None, reward_fn=None, train_policy=train_policy, push_weights=None)
    rng = np.random.default_rng(args.seed + 1)
    n, t, k = args.update_rows, args.update_len, max(cfg.num_experts_per_tok, 1)
    prompt = min(args.prompt_len, t - 1)
    mask = np.zeros((n, t - 1), np.float32)
    mask[:, prompt - 1:] = 1.0  # the response tokens' predictions
    # routed experts (R3): k distinct experts per token and layer, uniform (a random-init router spreads so too)
    routed = np.argsort(rng.random((n, t, cfg.num_hidden_layers, cfg.num_experts), dtype=np.float32), axis=-1)[..., :k]
    logp = np.full((n, t - 1), -math.log(cfg.vocab_size), np.float32)
    mb = {"tokens": jnp.asarray(rng.integers(0, cfg.vocab_size, (n, t)), jnp.int32),
          "old_logp": jnp.asarray(logp), "rollout_logp": jnp.asarray(logp), "mask": jnp.asarray(mask),
          "advantages": jnp.asarray(rng.standard_normal(n), jnp.float32), "routed": jnp.asarray(routed, jnp.int32)}
    num_tokens = jnp.float32(mask.sum())
    return trainer._update_jit, (trainer.params, trainer.opt_state, mb, num_tokens), trainer


def update_point(args, recipe_name: str, model, trace_dir: str) -> dict:
    import jax

    update, inputs, trainer = build_update(args, recipe_name, model)
    state = list(inputs)

    def call():  # the update donates masters and moments: each call updates the previous call's state, as training does
        params, opt_state, metrics = jax.block_until_ready(update(*state))
        state[:2] = params, opt_state
        return {k: float(v) for k, v in metrics.items() if np.ndim(v) == 0}

    t = time.perf_counter()
    metrics = call()
    first = time.perf_counter() - t
    walls = []
    for _ in range(args.timing_repeats):
        t = time.perf_counter()
        call()
        walls.append(time.perf_counter() - t)
    pw, _, kernels, trace = profiled(call, trace_dir, args.repeats)
    per_call, how = program_summary(kernels, UPDATE_MODULE, args.repeats, args.top)
    point = {"program": "update", "attribution": how, "update_module": UPDATE_MODULE, "compile_and_first_run_s": first,
             "calls_profiled": args.repeats, "steps_per_call": 1,
             "wall_s": {"best": _best(walls), "median": statistics.median(walls) if walls else None,
                        "profiled_mean": statistics.mean(pw)},
             "metrics_first_call": metrics,
             "other_modules_per_call": {m: v for m, v in module_totals(kernels, args.repeats).items() if UPDATE_MODULE not in m},
             "trace": trace}
    _finish(point, per_call, _best(walls), statistics.mean(pw))
    return point


# The products fp8_block moves onto FP8 kernels, by category: in fp8_block its FP8 GEMMs and the quantizers that feed
# them; in bf16 its grouped kernels whole, and of the dense categories the part fp8_block no longer runs there (both
# recipes keep the split-BF16 router / lm_head on the dense BF16 kernel and the lm_head's backward on XLA dots).
FP8_PRODUCT_CATEGORIES = ("fp8 grouped GEMM (ours)", "fp8 grouped wgrad (ours)", "fp8 dense GEMM (ours)", "quantize (ours)")
BF16_PRODUCT_CATEGORIES = ("bf16 grouped GEMM (ours)",)
BF16_PRODUCT_CATEGORIES_BY_DIFFERENCE = ("bf16 dense GEMM (ours: split-BF16 router / lm_head / projections)",
                                         "dense GEMM (cuBLAS / CUTLASS / XLA dot)")


def amdahl(categories: dict[str, dict[str, float]], bf16_kernel_ms: float, fp8_kernel_ms: float) -> dict:
    """How much of a program FP8 can speed up, from the per-category kernel times of bf16 and fp8_block: the products
    fp8_block runs on FP8 kernels (with their quantizers) against the same products in bf16, the rest of each recipe,
    and the kernel-time ratio if FP8's products and quantizers took no time (the rest of fp8_block alone): a target
    ratio above that ceiling needs the rest to shrink, not faster FP8 kernels. None where fp8_block ran no FP8 kernel
    (CPU: its products are XLA dots, not told apart from the rest by name)."""
    get = lambda cat, r: categories.get(cat, {}).get(r, 0.0) or 0.0  # noqa: E731
    fp8 = sum(get(c, "fp8_block") for c in FP8_PRODUCT_CATEGORIES)
    if fp8 <= 0:
        return None
    bf16 = sum(get(c, "bf16") for c in BF16_PRODUCT_CATEGORIES) + sum(
        max(0.0, get(c, "bf16") - get(c, "fp8_block")) for c in BF16_PRODUCT_CATEGORIES_BY_DIFFERENCE)
    fp8_rest, bf16_rest = fp8_kernel_ms - fp8, bf16_kernel_ms - bf16
    return {"bf16_ms_of_the_products": bf16, "fp8_ms_of_the_products_with_quantizers": fp8,
            "quantizers_ms": get("quantize (ours)", "fp8_block"),
            "products_speedup": bf16 / fp8,
            "bf16_share_of_the_products": bf16 / bf16_kernel_ms if bf16_kernel_ms else None,
            "bf16_ms_of_the_rest": bf16_rest, "fp8_ms_of_the_rest": fp8_rest,
            "rest_speedup": bf16_rest / fp8_rest if fp8_rest > 0 else None,
            "ceiling_if_fp8_products_took_no_time": bf16_kernel_ms / fp8_rest if fp8_rest > 0 else None}


def compare(points: list[dict]) -> dict:
    """Per program: every recipe's wall, kernel time, gap and per-category ms side by side."""
    out = {}
    for program in PROGRAMS:
        pts = {p["recipe"]: p for p in points if p["program"] == program and p.get("status") == "ok"}
        if not pts:
            continue
        cats = sorted({c["category"] for p in pts.values() for c in p["per_step"]["categories"]},
                      key=lambda c: [r[0] for r in CATEGORIES].index(c))
        entry = {key: {r: p.get(key) for r, p in pts.items()} for key in ("gap_ms_per_step", "idle_in_program_ms_per_step")}
        entry["wall_ms_per_step"] = {r: p["wall_ms_per_step"]["no_profiler"] for r, p in pts.items()}
        entry["kernel_ms_per_step"] = {r: p["per_step"]["kernel_ms"] for r, p in pts.items()}
        entry["categories_ms_per_step"] = {c: {r: next((x["ms"] for x in p["per_step"]["categories"] if x["category"] == c), 0.0)
                                              for r, p in pts.items()} for c in cats}
        b, f = pts.get("bf16"), pts.get("fp8_block")
        if b and f:
            wb, wf = b["wall_ms_per_step"]["no_profiler"], f["wall_ms_per_step"]["no_profiler"]
            entry["fp8_block_over_bf16"] = {
                "wall": wb / wf if wb and wf else None,
                "kernels": b["per_step"]["kernel_ms"] / f["per_step"]["kernel_ms"] if f["per_step"]["kernel_ms"] else None}
            split = amdahl(entry["categories_ms_per_step"], b["per_step"]["kernel_ms"], f["per_step"]["kernel_ms"])
            if split is not None:
                entry["amdahl"] = split
        out[program] = entry
    return out


# ---------------------------------------------------------------------------------------------- output


def _f(v, p=3):
    return "-" if v is None or (isinstance(v, float) and not math.isfinite(v)) else f"{v:.{p}f}"


def table(points: list[dict], comparison: dict) -> str:
    lines = []
    for p in points:
        head = f"## {p['program']}, {p['recipe']}"
        if p.get("status") != "ok":
            lines += [head + f": {p.get('status')}: {(p.get('error') or '')[:300]}", ""]
            continue
        s, unit = p["per_step"], "step" if p["program"] == "decode" else "call"
        lines.append(f"{head} ({p['attribution']}; trace {p['trace']['source']}): wall {_f(p['wall_ms_per_step']['no_profiler'])} "
                     f"ms/{unit} (profiled {_f(p['wall_ms_per_step']['profiled'])}), kernels {_f(s['kernel_ms'])} ms "
                     f"({s['kernels']:.1f} per {unit}), busy {_f(s['busy_ms'])}, span {_f(s['span_ms'])}, "
                     f"gap {_f(p['gap_ms_per_step'])} ms, idle in program {_f(p['idle_in_program_ms_per_step'])} ms")
        lines += ["", f"| category | ms/{unit} | share | kernels/{unit} |", "|---|---|---|---|"]
        for c in s["categories"]:
            lines.append(f"| {c['category']} | {_f(c['ms'])} | {_f(100 * c['share'] if c['share'] is not None else None, 1)} % "
                         f"| {c['kernels']:.1f} |")
        lines += ["", f"| kernel | category | count/{unit} | ms/{unit} | share | source lines (backward?) |",
                  "|---|---|---|---|---|---|"]
        for k in s["top_kernels"]:
            where = "; ".join(k.get("sources", [])[:2]) + (" (bwd)" if k.get("backward") else "")
            lines.append(f"| {k['name'][:90]} | {k['category']} | {k['count']:.1f} | {_f(k['ms'])} | "
                         f"{_f(100 * k['share'] if k['share'] is not None else None, 1)} % | {where} |")
        if p.get("hlo_sources", {}).get("by_source"):
            hs = p["hlo_sources"]
            lines += ["", f"| top kernels' time by dominant source line ({hs['dump']}) | ms/{unit} |", "|---|---|"]
            lines += [f"| {x['source']} | {_f(x['ms'])} |" for x in hs["by_source"][:15]]
            lines.append(f"| (not attributed) | {_f(hs['unattributed_ms'])} |")
        lines += ["", f"| kernel kind (instance numbers dropped) | names | count/{unit} | ms/{unit} | share |",
                  "|---|---|---|---|---|"]
        for k in s["top_kinds"][:10]:
            lines.append(f"| {k['kind'][:90]} | {k['names']} | {k['count']:.1f} | {_f(k['ms'])} | "
                         f"{_f(100 * k['share'] if k['share'] is not None else None, 1)} % |")
        lines.append("")
    for program, entry in comparison.items():
        recipes = list(entry["wall_ms_per_step"])
        lines += [f"## {program}: recipes side by side (ms per {'step' if program == 'decode' else 'call'})",
                  "| | " + " | ".join(recipes) + " |", "|---|" + "---|" * len(recipes)]
        for key in ("wall_ms_per_step", "kernel_ms_per_step", "gap_ms_per_step", "idle_in_program_ms_per_step"):
            lines.append(f"| {key} | " + " | ".join(_f(entry[key].get(r)) for r in recipes) + " |")
        for cat, by in entry["categories_ms_per_step"].items():
            lines.append(f"| {cat} | " + " | ".join(_f(by.get(r)) for r in recipes) + " |")
        if "fp8_block_over_bf16" in entry:
            lines.append(f"fp8_block over bf16: wall {_f(entry['fp8_block_over_bf16']['wall'], 2)}x, "
                         f"kernels {_f(entry['fp8_block_over_bf16']['kernels'], 2)}x")
        if "amdahl" in entry:
            a = entry["amdahl"]
            lines.append(f"the products fp8_block runs in FP8: bf16 {_f(a['bf16_ms_of_the_products'])} ms "
                         f"({_f(100 * (a['bf16_share_of_the_products'] or 0), 1)} % of its kernels), fp8_block "
                         f"{_f(a['fp8_ms_of_the_products_with_quantizers'])} ms with {_f(a['quantizers_ms'])} ms of quantizers "
                         f"({_f(a['products_speedup'], 2)}x); the rest {_f(a['bf16_ms_of_the_rest'])} / "
                         f"{_f(a['fp8_ms_of_the_rest'])} ms ({_f(a['rest_speedup'], 2)}x); ceiling if FP8's products took "
                         f"no time: {_f(a['ceiling_if_fp8_products_took_no_time'], 2)}x")
        lines.append("")
    return "\n".join(lines)


def source_lines(point: dict, dump_dir: str) -> dict:
    """The point's top kernels attributed to source lines from the dump of its program's module (`hlo_sources`)."""
    module = DECODE_MODULE if point["program"] == "decode" else UPDATE_MODULE
    files = hlo_sources.dump_files(dump_dir, module)
    if not files:
        return {"dump": None, "error": f"no *{module}*after_optimizations.txt under {dump_dir} (was XLA_FLAGS set "
                                       "with --xla_dump_to before the run, and the program compiled, not loaded from a cache?)"}
    names = [k["name"] for k in point["per_step"]["top_kernels"]]
    path, mapping = hlo_sources.best_module(files, names)
    return {"dump": os.path.basename(path), **hlo_sources.attribute(point["per_step"], mapping)}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="tiny model and shapes: a CPU smoke run (< 2 minutes)")
    add_model_slice_args(p, layers=4)  # Qwen3-30B-A3B's shapes: 128 experts top-8, vocab 151936
    p.add_argument("--programs", default="decode,update", help="comma list of %s (default %%(default)s)" % ", ".join(PROGRAMS))
    p.add_argument("--recipes", default="bf16,fp8_block", help="comma list of recipe names (default %(default)s)")
    p.add_argument("--slots", type=int, default=256, help="decode: active rows (EngineConfig.max_batch; default %(default)s)")
    p.add_argument("--prompt-len", type=int, default=256,
                   help="decode: prompt tokens; update: the prompt part of a row (masked out of the loss) (default %(default)s)")
    p.add_argument("--step-new", type=int, default=64,
                   help="decode: tokens of the profiled generate (step_new - 1 decode steps; default %(default)s)")
    p.add_argument("--max-len", type=int, default=8192,
                   help="decode: the longest response the engine is configured for (EngineConfig.max_seq_len = prompt + "
                        "this; the response-buffer and cache buckets as rollout_workload.py; default %(default)s)")
    p.add_argument("--kv-pages", type=int, default=0, help="decode: EngineConfig.kv_pages (0: slots x pages of the longest row)")
    p.add_argument("--refill-every", type=int, default=64, help="decode: EngineConfig.refill_every (raised to --step-new)")
    p.add_argument("--static-shapes", action="store_true", help="decode: EngineConfig.static_shapes (--tiny sets it)")
    p.add_argument("--attention", default="auto", choices=["auto", "flash", "xla", "exact"],
                   help="model attention_impl (auto: the flash kernels on a Hopper GPU, the exact scan on CPU)")
    p.add_argument("--update-rows", type=int, default=2, help="update: minibatch rows (default %(default)s: rl_step.py's 1k point)")
    p.add_argument("--update-micro-batch", type=int, default=0,
                   help="update: rows per micro-batch (config rl.micro_batch_rows; 0: the whole minibatch at once)")
    p.add_argument("--update-logit-chunk", type=int, default=0,
                   help="update: token positions per logit chunk (config rl.logit_chunk_tokens; 0: all at once)")
    p.add_argument("--update-len", type=int, default=1280,
                   help="update: tokens per row, prompt + response (default %(default)s = 256 + 1024)")
    p.add_argument("--repeats", type=int, default=2, help="profiled calls per program (default %(default)s)")
    p.add_argument("--timing-repeats", type=int, default=3, help="timed calls without the profiler, best kept (default %(default)s)")
    p.add_argument("--top", type=int, default=20, help="kernels listed per program (default %(default)s)")
    p.add_argument("--command-buffers-in-profile", action="store_true",
                   help="keep XLA's command buffers (CUDA graphs) under the profiler "
                        "(--xla_enable_command_buffers_during_profiling=true; kernels then may lose XLA's annotations)")
    p.add_argument("--seed", type=int, default=0, help="model init, prompts and minibatch (default %(default)s)")
    p.add_argument("--trace-dir", default="", help="keep the raw traces here (default: a temp dir, deleted at the end)")
    p.add_argument("--hlo-dump", default="",
                   help="XLA's text dump of this run (XLA_FLAGS='--xla_dump_to=DIR --xla_dump_hlo_as_text' set before the run): "
                        "the top kernels get the source lines of their ops, each point a time-by-source-line table")
    p.add_argument("--out", default=None,
                   help="JSON path (default: results/step_profile_<platform>.json; --tiny: results/step_profile_cpu_tiny.json)")
    args = p.parse_args(argv)
    if args.tiny:
        apply_tiny_slice(args)
        args.slots, args.prompt_len, args.step_new, args.max_len, args.refill_every = 4, 12, 8, 40, 8
        args.update_rows, args.update_len, args.repeats, args.timing_repeats = 2, 32, 1, 1
        args.static_shapes = True
    args.program_list = [x.strip() for x in args.programs.split(",") if x.strip()]
    bad = [x for x in args.program_list if x not in PROGRAMS]
    if bad or not args.program_list:
        p.error(f"--programs: unknown {bad or 'empty list'}; choose from {', '.join(PROGRAMS)}")
    args.recipe_list = [x.strip() for x in args.recipes.split(",") if x.strip()]
    if args.step_new < 2 or args.step_new > args.max_len:
        p.error("--step-new must be in [2, --max-len]")
    if args.update_len < 2 or args.repeats < 1 or args.timing_repeats < 1:
        p.error("--update-len must be >= 2, --repeats and --timing-repeats >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.command_buffers_in_profile:  # before JAX creates its backends
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_enable_command_buffers_during_profiling=true").strip()
    import jaxrl_fp8  # noqa: F401  (first: the precision contract's XLA flags before JAX starts)
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxrl_fp8.model import Policy, Qwen3
    from jaxrl_fp8.ops.high_precision import effective_form
    from jaxrl_fp8.precision import get_recipe
    from jaxrl_fp8.rollout.embedded import EmbeddedEngine

    for r in args.recipe_list:
        get_recipe(r)  # an unknown name fails here, before any compile
    dev = jax.devices()[0]
    cfg = model_config_from_args(args, max_position_embeddings=max(8192, args.prompt_len + args.max_len, args.update_len))
    path = args.out or os.path.join(HERE, "results", f"step_profile_{'cpu_tiny' if args.tiny else dev.platform}.json")
    keep = bool(args.trace_dir)
    trace_root = os.path.abspath(args.trace_dir) if keep else tempfile.mkdtemp(prefix="step_profile_")
    points: list[dict] = []
    t_begin = time.time()

    def write(complete: bool):
        write_results(path, {
            "benchmark": "step_profile: per-kernel time of one decode step and one train update (jax.profiler)",
            **run_header("step_profile.py", argv),
            "tiny": args.tiny,
            "env": {k: os.environ.get(k) for k in ("XLA_FLAGS", "XLA_PYTHON_CLIENT_MEM_FRACTION", "JAXRL_FP8_HIGH_PRECISION")},
            "high_precision_form": effective_form(),
            "model": slice_fields(cfg),
            "shapes": {"decode": {"slots": args.slots, "prompt_len": args.prompt_len, "step_new": args.step_new,
                                  "max_len": args.max_len, "kv_pages": args.kv_pages, "refill_every": max(args.step_new, args.refill_every),
                                  "static_shapes": args.static_shapes, "scheduler": "continuous"},
                       "update": {"rows": args.update_rows, "tokens_per_row": args.update_len,
                                  "micro_batch_rows": args.update_micro_batch, "logit_chunk_tokens": args.update_logit_chunk,
                                  "prompt_tokens": min(args.prompt_len, args.update_len - 1)}},
            "profile": {"repeats": args.repeats, "timing_repeats": args.timing_repeats,
                        "command_buffers_in_profile": args.command_buffers_in_profile,
                        "trace_dir": trace_root if keep else None},
            "categories": [{"category": c, "regex": rx} for c, rx in CATEGORIES],
            "notes": [
                "per_step: decode = kernels of the XLA module jit_decode_slots / decode steps (attribution 'module'; "
                "'difference': (generate step_new - generate 1) / steps, when events carry no module); update = kernels "
                "of jit__update / calls. kernel_ms = sum of self times = sum of the categories = what top_kernels rank",
                "gap_ms_per_step = wall without the profiler - kernel_ms; idle_in_program = span of the program's runs "
                "- busy (device time inside the program with no kernel); outside_program = profiled wall - span",
                "under the profiler XLA runs without command buffers (unless --command-buffers-in-profile) and CUPTI "
                "adds a cost per launch: the profiled wall is an upper bound, kernel durations are the device's",
                "trace.lines lists every plane / line of the trace (GPU: the stream lines are summed, derived lines not)",
            ],
            "complete": complete,
            "wall_seconds": time.time() - t_begin,
            "points": points,
            "comparison": compare(points),
        })

    def run_point(program, recipe_name, fn):
        t0 = time.time()
        try:
            point = fn()
            point["status"] = "ok"
        except Exception as e:  # recorded (e.g. out of memory), the next point still runs
            msg = f"{type(e).__name__}: {e}"
            point = {"program": program, "status": "error", "error": msg[:4000], "traceback": traceback.format_exc()[-4000:],
                     "oom": any(s in msg for s in ("RESOURCE_EXHAUSTED", "Out of memory", "out of memory"))}
            print(f"[step_profile] {program} {recipe_name}: FAILED {msg[:500]}", file=sys.stderr, flush=True)
        point["recipe"] = recipe_name
        if point["status"] == "ok" and args.hlo_dump:
            point["hlo_sources"] = source_lines(point, args.hlo_dump)
        point["point_seconds"] = time.time() - t0
        source = (point.get("trace") or {}).get("source", "")
        if point["status"] == "ok" and dev.platform != "cpu" and not source.startswith("device"):
            point["warning"] = (f"no device plane with kernels on {dev.platform} (CUPTI did not trace?): the times are "
                                "host-side XLA thunk times, not kernel times; see trace.lines")
            print(f"[step_profile] warning: {program} {recipe_name}: {point['warning']}", file=sys.stderr, flush=True)
        if not keep:  # the traces go with the temp dir
            for t in (point.get("trace") or {}, (point.get("trace") or {}).get("one_token") or {}):
                t.pop("xplane", None)
        points.append(point)
        write(False)
        if point["status"] == "ok":
            s = point["per_step"]
            print(f"[step_profile] {program} {recipe_name}: wall {_f(point['wall_ms_per_step']['no_profiler'])} ms, kernels "
                  f"{_f(s['kernel_ms'])} ms ({s['kernels']:.0f}), gap {_f(point['gap_ms_per_step'])} ms "
                  f"[{point['attribution']}, {point['trace']['source']}] in {point['point_seconds']:.0f} s", flush=True)

    print(f"device {dev.device_kind} ({dev.platform}); programs {args.program_list}, recipes {args.recipe_list}; "
          f"traces in {trace_root}", flush=True)
    try:
        if "decode" in args.program_list:
            model = Qwen3(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(args.seed))
            rng = np.random.default_rng(args.seed)
            for recipe_name in args.recipe_list:
                policy = Policy(model, recipe=get_recipe(recipe_name))
                run_point("decode", recipe_name, lambda: decode_point(
                    EmbeddedEngine, policy, cfg, args, rng, os.path.join(trace_root, f"decode_{recipe_name}")))
                del policy
            del model
        if "update" in args.program_list:
            model = Qwen3(cfg, dtype=jnp.float32, rngs=nnx.Rngs(args.seed))  # the FP32 masters the trainer keeps
            for recipe_name in args.recipe_list:
                run_point("update", recipe_name, lambda: update_point(
                    args, recipe_name, model, os.path.join(trace_root, f"update_{recipe_name}")))
            del model
    finally:
        if not keep:
            shutil.rmtree(trace_root, ignore_errors=True)
    write(True)
    print()
    print(table(points, compare(points)))
    print(f"wrote {path}")
    return 0 if all(p["status"] == "ok" for p in points) else 1


if __name__ == "__main__":
    sys.exit(main())
