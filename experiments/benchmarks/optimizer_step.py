"""The optimizer step's non-finite skip: `rl.trainer.apply_if_finite` (a `lax.cond` around the trainer's global-norm
clip and AdamW, the norm passed in) against the `where` over the updated and the old trees it replaced (optax's clip,
which computes the norm again), on donated masters and moments of a chosen size.

Why measure it: the update of a Qwen3-30B-A3B slice is bound by passes over its ~2.5 B parameters (every micro-batch's
gradient add, AdamW, the FP8 weight quantization), and the `where` was one more pass over the masters and both
moments (22 ms an update on an H100 in results/step_profile_update_accum_h100.json). Prints a table; writes JSON
(`--out`) with the device, the versions, the sizes and both forms timed in this run beside the bytes' floor.

  python experiments/benchmarks/optimizer_step.py --params 536870912 --leaves 4 --out experiments/benchmarks/results/optimizer_step_h100.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import optax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import timing  # noqa: E402

from jaxrl_fp8.rl.trainer import apply_if_finite, clip_by_global_norm  # noqa: E402

MAX_NORM = 1.0  # the RL configs' rl.grad_clip


def optimizers():
    """(the `where` form's chain: optax's clip, the `cond` form's: the trainer's, which takes the norm), + AdamW."""
    adamw = lambda: optax.adamw(1e-4, weight_decay=0.1)  # noqa: E731
    return optax.chain(optax.clip_by_global_norm(MAX_NORM), adamw()), optax.chain(clip_by_global_norm(MAX_NORM), adamw())


def where_skip(optimizer, grads, params, opt_state, finite, global_norm=None):
    """The form `apply_if_finite` replaced: both trees computed, then selected element by element."""
    del global_norm  # optax's clip computes the norm itself (XLA shares it with the caller's: same program level)
    updates, new_opt = optimizer.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)  # noqa: E731
    return keep(new_params, params), keep(new_opt, opt_state)


def _step(skip, optimizer):
    def step(params, opt_state, grads):
        norm = optax.tree.norm(grads)
        return skip(optimizer, grads, params, opt_state, jnp.isfinite(norm), norm)
    return jax.jit(step, donate_argnums=(0, 1))


def time_form(skip, optimizer, leaves: int, size: int, reps: int) -> dict:
    """Median and min seconds of one step on fresh donated trees (the step's outputs feed the next call)."""
    params = {f"w{i}": jnp.full((size,), 0.5 + i, jnp.float32) for i in range(leaves)}
    grads = jax.tree.map(lambda p: p * 1e-3, params)
    opt_state = optimizer.init(params)
    step = _step(skip, optimizer).lower(params, opt_state, grads).compile()  # timed as compiled: one compile
    memory = step.memory_analysis()
    for _ in range(2):
        params, opt_state = step(params, opt_state, grads)
    jax.block_until_ready(params)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        params, opt_state = step(params, opt_state, grads)
        jax.block_until_ready(params)
        times.append(time.perf_counter() - t)
    return {"median_ms": statistics.median(times) * 1e3, "min_ms": min(times) * 1e3,
            "temp_bytes": getattr(memory, "temp_size_in_bytes", None)}


def same_bits(size: int) -> dict:
    """Both forms, each one jitted program, on a finite gradient under the clip's norm, one over it and a non-finite
    one: the same masters and moments, bit for bit."""
    params = {"w": jnp.linspace(-1.0, 1.0, size, dtype=jnp.float32)}
    out = {}
    w = params["w"]
    for label, g in (("finite", w * 1e-4), ("clipped", w * 10.0), ("nan", w.at[size // 2].set(jnp.nan))):
        grads = {"w": g}
        norm = optax.tree.norm(grads)
        a, b = (jax.jit(lambda g, p, s, n, skip=skip, opt=opt: skip(opt, g, p, s, jnp.isfinite(n), n))(
                    grads, params, opt.init(params), norm)
                for skip, opt in zip((where_skip, apply_if_finite), optimizers()))
        out[label] = all(bool(jnp.array_equal(x, y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--params", type=int, default=3 * 2**22, help="float32 masters in all (split over --leaves arrays)")
    p.add_argument("--leaves", type=int, default=3, help="arrays the masters are split into")
    p.add_argument("--reps", type=int, default=15, help="timed steps a form (median reported)")
    p.add_argument("--out", default=None, help="JSON path (written through a temp file and renamed)")
    args = p.parse_args(argv)
    if args.params < args.leaves or args.leaves < 1:
        raise SystemExit(f"--params ({args.params}) must be >= --leaves ({args.leaves}) >= 1")
    size = args.params // args.leaves
    rows = {name: time_form(skip, optimizer, args.leaves, size, args.reps)
            for (name, skip), optimizer in zip((("where", where_skip), ("cond", apply_if_finite)), optimizers())}
    bits = same_bits(min(size, 4096))
    n = size * args.leaves
    floor_bytes = n * 4 * 8  # read the gradient (its norm), then masters, both moments and the gradient; write three
    # the copy anchor is a GPU roofline: XLA:CPU's one-op copy runs on fewer threads than a fused AdamW does
    copy_bps = timing.copy_bandwidth(256) if jax.devices()[0].platform == "gpu" else None
    result = dict(timing.run_header("optimizer_step.py", argv), params=n, leaves=args.leaves, optimizer=f"clip by global norm {MAX_NORM} + optax.adamw",
                  copy_bytes_per_s=copy_bps, floor_ms_at_copy_bandwidth=floor_bytes / copy_bps * 1e3 if copy_bps else None, forms=rows,
                  same_bits=bits,
                  cond_speedup=rows["where"]["median_ms"] / rows["cond"]["median_ms"])
    print(f"device={result['device']['kind']} params={n:,} (float32, clip + AdamW)")
    print(f"{'form':8s} {'median ms':>10s} {'min ms':>10s} {'temp MB':>10s}")
    for name, r in rows.items():
        temp = r["temp_bytes"] / 1e6 if r["temp_bytes"] is not None else float("nan")
        print(f"{name:8s} {r['median_ms']:10.3f} {r['min_ms']:10.3f} {temp:10.1f}")
    floor = result["floor_ms_at_copy_bandwidth"]
    print((f"floor (8 float32 passes at the copy bandwidth): {floor:.3f} ms; " if floor else "") +
          f"cond / where speedup {result['cond_speedup']:.2f}x; same bits (finite, clipped, NaN gradient): {bits}")
    if args.out:
        timing.write_results(args.out, result)
    return result


if __name__ == "__main__":
    main()
