"""The vocabulary side of one decode step, per part: the lm_head product and the sampler's noise.

A decode step of 256 rows spends ~0.8 ms of ~4 ms on the vocabulary (H100 profile, results/
step_profile_decode256_h100.json): the BF16 lm_head product ([rows, 2048] x [151936, 2048]^T, row invariant on our
grouped BF16 kernel) and the sampler's draw. This script times, at decode row counts and in one run:

  * lm_head: our BF16 kernel under the tiling `gemm_grouped_bf16.default_config` picks for the row count against
    the grouped kernels' default tiling (bits compared: a tiling never changes a row's K order), cuBLAS (XLA dot,
    not row invariant) as the anchor, and the weight-read time at the copy bandwidth measured in the same run;
  * noise: the sampler's two-level draw (`sampling.draw_token`: a strided chunk by its mass, then a token in it)
    against one Gumbel-max over the whole vocabulary (argmax(z + gumbel): the anchor, the draw before it; also under
    jax.random's threefry bits, the generator before the hash), alone and as the whole plain sampler with the drawn
    token's log-prob;
  * logprob: the log-prob of a drawn token (`token_logprobs`, the trainer's too) with its pairwise normaliser cut
    into kernels as `numerics` cuts it, against the uncut tree XLA fuses on its own (bits compared).

    python experiments/benchmarks/vocab_side.py --out experiments/benchmarks/results/vocab_side_<card>.json
    python experiments/benchmarks/vocab_side.py --tiny      # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "src"))
from timing import bench, copy_bandwidth, run_header, write_results  # noqa: E402

from jaxrl_fp8.model import numerics  # noqa: E402
from jaxrl_fp8.rollout import sampling  # noqa: E402

F32 = jnp.float32


# --- noise ------------------------------------------------------------------------------------------------------

def threefry_gumbel(keys, vocab):
    """jax.random's threefry bits under the same transform (the generator before the counter-based hash)."""
    bits = jax.vmap(lambda k: jax.random.bits(k, (vocab,), jnp.uint32))(keys)
    u = sampling.open_uniform(bits)
    return -jnp.log(-jnp.log(u))


def one_level_sampler(z, keys):
    """The anchor: one Gumbel-max over the whole vocabulary (two logs a token), then `token_logprobs`."""
    tokens = jnp.argmax(z + sampling.gumbel_noise(keys, z.shape[-1]), -1).astype(jnp.int32)
    return tokens, sampling.token_logprobs(z, tokens)


def noise_points(rows_list, vocab, out):
    key = jax.random.key(0)
    for rows in rows_list:
        z = jax.random.normal(key, (rows, vocab), F32) * 3
        keys = sampling.row_keys(jnp.arange(rows), jnp.full((rows,), 7))
        variants = {
            "two-level draw (draw_token)": lambda z, keys: sampling.draw_token(z, True, keys)[0],
            "one-level Gumbel-max (anchor)": lambda z, keys: jnp.argmax(z + sampling.gumbel_noise(keys, vocab), -1),
            "whole plain sampler": lambda z, keys: sampling.sample_with_logprobs(
                z, 1.0, 0, 1.0, jnp.arange(z.shape[0]), jnp.full((z.shape[0],), 7), plain=True),
            "whole plain sampler, one-level draw (anchor)": one_level_sampler,
            "one-level Gumbel-max, threefry bits (anchor)":
                lambda z, keys: jnp.argmax(z + threefry_gumbel(keys, vocab), -1),
        }
        for name, fn in variants.items():
            t, _ = bench(jax.jit(fn), z, keys)
            out.append({"kind": "noise", "variant": name, "rows": rows, "median_ms": t * 1e3})
            print(f"noise rows {rows:4d} {name:45s} {t * 1e3:.4f} ms")


# --- log-probs ----------------------------------------------------------------------------------------------------

def logprob_points(rows_list, vocab, out):
    """The rollout / trainer log-prob (`token_logprobs`: max, the row-invariant pairwise normaliser, pick) with the
    tree cut into kernels as `numerics` does today, against the same tree left to XLA's fusion (no cuts). Bits
    compared: a cut moves no add."""
    for rows in rows_list:
        z = jax.random.normal(jax.random.key(rows), (rows, vocab), F32) * 3
        tok = jnp.argmax(z, -1)
        ref = None
        for name, split_from in (("cut (numerics today)", numerics.SPLIT_FROM), ("uncut (one fused tree)", 1 << 62)):
            def fn(z, tok, split_from=split_from):
                saved, numerics.SPLIT_FROM = numerics.SPLIT_FROM, split_from
                try:
                    return sampling.token_logprobs(z, tok)
                finally:
                    numerics.SPLIT_FROM = saved
            f = jax.jit(fn)
            y = np.asarray(f(z, tok))
            ref = y if ref is None else ref
            t, _ = bench(f, z, tok)
            same = bool(np.array_equal(y.view(np.uint32), ref.view(np.uint32)))
            out.append({"kind": "logprob", "variant": name, "rows": rows, "median_ms": t * 1e3, "bitwise_vs_cut": same})
            print(f"logprob rows {rows:4d} {name:28s} {t * 1e3:.4f} ms  bitwise {same}")


# --- lm_head ------------------------------------------------------------------------------------------------------

def head_points(rows_list, vocab, hidden, bw, out, interpret: bool):
    from pallas_kernels import gemm_grouped_bf16 as g

    key = jax.random.key(1)
    w = (jax.random.normal(key, (vocab, hidden), F32) * 0.02).astype(jnp.bfloat16)
    for rows in rows_list:
        x = jax.random.normal(jax.random.key(rows), (rows, hidden), F32).astype(jnp.bfloat16)
        sizes = jnp.asarray([rows], jnp.int32)
        ref = None
        roof = w.nbytes / bw * 1e3
        cublas = jax.jit(lambda x, w: jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=F32))
        if not interpret:
            t, _ = bench(cublas, x, w)
            out.append({"kind": "lm_head", "impl": "cuBLAS (XLA dot)", "rows": rows, "median_ms": t * 1e3,
                        "weight_read_ms_at_copy_bw": roof})
            print(f"lm_head rows {rows:4d} cuBLAS {t * 1e3:.4f} ms (weight read at copy bw {roof:.4f} ms)")
        # the tiling `default_config` picks for these rows against the grouped kernels' default (the band of 16, four
        # stages); the other tilings measured lost (the JSON's head_tilings_explored)
        for which, cfg in (("picked by rows", g.default_config(1, rows)), ("grouped default", g.Bf16GroupedConfig())):
            f = jax.jit(lambda x, w, cfg=cfg: g.grouped_matmul(x, w[None], sizes, config=cfg, interpret=interpret))
            label = f"ours, {which}: s{cfg.max_concurrent_steps} w{cfg.grid_tile_width} minor{cfg.grid_minor_dim}"
            try:
                y = np.asarray(f(x, w))
                t, _ = bench(f, x, w, iters=5 if interpret else 20, reps=1 if interpret else 5)
            except Exception as e:  # noqa: BLE001
                out.append({"kind": "lm_head", "impl": label, "rows": rows, "error": traceback.format_exc()[-400:]})
                print(f"lm_head rows {rows:4d} {label}: {repr(e)[:200]}")
                continue
            ref = y if ref is None else ref
            same = bool(np.array_equal(y.view(np.uint32), ref.view(np.uint32)))
            out.append({"kind": "lm_head", "impl": label, "rows": rows, "median_ms": t * 1e3, "bitwise_vs_default": same,
                        "fraction_of_copy_roofline": roof / (t * 1e3)})
            print(f"lm_head rows {rows:4d} {label:32s} {t * 1e3:.4f} ms  bitwise {same}  {roof / (t * 1e3):.2f} of roofline")


KIND_OF_PART = {"noise": "noise", "logprob": "logprob", "head": "lm_head"}


def keep_other_parts(path: str | None, result: dict, parts: list[str]) -> None:
    """One file per card holds every part: the points of the parts not run now are kept from the file already at
    `path` (if any), and `runs` says which run (date, command, copy anchor) measured each part."""
    prior = json.load(open(path)) if path and os.path.exists(path) else {}
    kinds = {pt.get("kind") for pt in prior.get("points", [])}
    header = ("date", "command", "copy_bytes_per_s")
    runs = prior.get("runs") or {p: {k: prior.get(k) for k in header} for p, kind in KIND_OF_PART.items() if kind in kinds}
    rerun = {KIND_OF_PART[p] for p in parts}
    result["points"][:0] = [pt for pt in prior.get("points", []) if pt.get("kind") not in rerun]
    result["runs"] = {**runs, **{p: {k: result.get(k) for k in header} for p in parts}}
    for key, value in prior.items():  # e.g. a part's notes and explored variants
        result.setdefault(key, value)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="64,128,256,512,1024", help="decode / prefill row counts")
    p.add_argument("--parts", default="head,noise,logprob", help="comma list of head, noise, logprob")
    p.add_argument("--tiny", action="store_true", help="CPU smoke run: vocab 1024, hidden 128, the kernel interpreted")
    p.add_argument("--out", default=None, help="JSON path (written after each part; the points of parts not run are "
                                               "kept from the file already there)")
    args = p.parse_args(argv)
    rows = [int(r) for r in args.rows.split(",")]
    vocab, hidden = (1024, 128) if args.tiny else (151936, 2048)
    result = run_header("vocab_side.py", argv)
    result.update({"vocab": vocab, "hidden": hidden, "rows": rows, "points": []})
    bw = copy_bandwidth(64 if args.tiny else 1024)
    result["copy_bytes_per_s"] = bw
    parts = args.parts.split(",")
    unknown = set(parts) - set(KIND_OF_PART)
    if unknown:
        p.error(f"--parts: unknown {sorted(unknown)}; choose from {', '.join(KIND_OF_PART)}")
    keep_other_parts(args.out, result, parts)
    if "noise" in parts:
        noise_points(rows, vocab, result["points"])
        if args.out:
            write_results(args.out, result)
    if "logprob" in parts:
        logprob_points(rows, vocab, result["points"])
        if args.out:
            write_results(args.out, result)
    if "head" in parts:
        head_points(rows, vocab, hidden, bw, result["points"], interpret=args.tiny)
    if args.out:
        write_results(args.out, result)


if __name__ == "__main__":
    main()
