"""Block-scaled FP8 GEMM benchmark on one Hopper GPU: our Pallas kernels against XLA/cuBLAS and Pallas anchors.

Everything in one run: XLA BF16 dot, XLA unscaled FP8 dot (NT), our dense kernel (tile variants); lax.ragged_dot
BF16, jax's ragged_dot_mgpu BF16 example, our grouped FP8 and BF16 kernels on Qwen3-30B-A3B MoE shapes, the MoE weight
gradients (our persistent FP8 kernel's configs, its gather predecessor, jax's transposed_ragged_dot_mgpu); fwd+bwd of an
FP8 linear vs BF16; torch's block-wise FP8 `scaled_mm` and grouped GEMMs as anchors (torch_anchors.py, a child
process); a device-to-device copy for the bandwidth ceiling. Correctness of every kernel timing is
checked against a float64 block-math reference on a slice of rows. Prints a table, writes JSON.

    PYTHONPATH=src:. python3 experiments/benchmarks/gemm.py --out results/gemm_h200.json [--quick]
        [--suites dense,dense_decode,moe,grouped,decode,linear,wgrad,torch] [--baseline path/to/previous/gemm_dense.py]

`--baseline` times a previous version of the dense kernel module (same API) in the same run, so a change's
effect is measured against the same machine state.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.util
import platform
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_fp8 import ops
from jaxrl_fp8.ops import block_scaled, reference as R
from jaxrl_fp8.precision.fp8 import quantize_fp8_per_block, quantize_fp8_per_token_group
from pallas_kernels import gemm_dense, gemm_grouped
import timing  # this folder is on sys.path when the script runs
from timing import bench, write_results

ANCHORS = {"xla_bf16_8192": 783, "cublas_fp8_blockwise_8192": 1284, "xla_fp8_nt_8192": 1530, "mosaic_fp8_unscaled_8192": 1465, "ragged_dot_mgpu_bf16_gate_up": 420, "ragged_dot_mgpu_bf16_down": 294}


def rand(key, shape, dtype, scale=1.0):
    return (jax.random.normal(jax.random.key(key), shape, jnp.float32) * scale).astype(dtype)


RESULTS: list[dict] = []


def record(name, shape, flops, t, **extra):
    med, best = t
    row = dict(name=name, shape=shape, median_ms=med * 1e3, min_ms=best * 1e3, tflops=flops / med / 1e12 if flops else None, **extra)
    RESULTS.append(row)
    tf = f"{row['tflops']:8.1f}" if row["tflops"] else "       -"
    print(f"{name:48s} {str(shape):28s} {med*1e3:9.3f} ms {tf} TFLOP/s {extra.get('err', '')}", flush=True)


def try_run(label, f):
    try:
        f()
    except Exception as e:  # keep measuring the rest; the failure goes into the JSON
        msg = f"{type(e).__name__}: {str(e)[:400]}"
        print(f"{label}: FAILED {msg}", flush=True)
        RESULTS.append(dict(name=label, error=msg, trace=traceback.format_exc()[-2000:]))


def check_rows(y, xq, sa, wq, sb, rows=256):
    ref = R.block_scaled_matmul(np.asarray(xq[:rows]), np.asarray(sa[:rows]), np.asarray(wq), np.asarray(sb))
    return R.rel_err(np.asarray(y[:rows], np.float32), ref)


def cfg_label(cfg) -> str:
    kps = getattr(cfg, "k_blocks_per_step", 1)
    extra = f" k{kps}" + (f" split-{cfg.split}" if getattr(cfg, "split", "rows") != "rows" else "")
    cta_m, cta_n = getattr(cfg, "cta_m", cfg.tile_m * 2), getattr(cfg, "cta_n", cfg.tile_n)
    return f"{cta_m}x{cta_n} s{cfg.max_concurrent_steps} w{cfg.grid_tile_width} minor{cfg.grid_minor_dim}{extra}"


def load_module(path):
    spec = importlib.util.spec_from_file_location("gemm_dense_baseline", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def dense_suite(m, n, k, configs, label, baseline=None):
    flops = 2 * m * n * k
    a16, b16 = rand(1, (m, k), jnp.bfloat16), rand(2, (n, k), jnp.bfloat16, 0.05)
    try_run(f"xla_bf16 {label}", lambda: record(f"xla_bf16_dot {label}", (m, n, k), flops,
            bench(jax.jit(lambda a, b: jnp.dot(a, b.T, preferred_element_type=jnp.float32).astype(jnp.bfloat16)), a16, b16)))
    a8, b8 = a16.astype(jnp.float8_e4m3fn), b16.astype(jnp.float8_e4m3fn)
    nt = jax.jit(lambda a, b: jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.bfloat16))
    try_run(f"xla_fp8_nt {label}", lambda: record(f"xla_fp8_nt_unscaled {label}", (m, n, k), flops, bench(nt, a8, b8)))
    xq, sa = quantize_fp8_per_token_group(a16, 128)
    wq, sb = quantize_fp8_per_block(b16, (128, 128))
    xla_path = jax.jit(lambda a, s, b, t: block_scaled.block_scaled_matmul(a, s, b, t, backend="xla", out_dtype=jnp.bfloat16))
    if m * n * k <= 8192**3:
        try_run(f"xla_blockscaled {label}", lambda: record(f"xla_block_scaled(scan) {label}", (m, n, k), flops, bench(xla_path, xq, sa, wq, sb, iters=3, reps=2)))
    variants = [(gemm_dense, cfg, "ours_dense") for cfg in configs]
    if baseline is not None:
        variants.append((baseline, baseline.default_config(n, k), "previous_dense"))
    first = {}
    for mod, cfg, tag in variants:
        def one(mod=mod, cfg=cfg, tag=tag):
            f = jax.jit(functools.partial(mod.block_scaled_matmul, out_dtype=jnp.bfloat16, config=cfg))
            y = f(xq, sa, wq, sb)
            err = check_rows(y, xq, sa, wq, sb)
            # a config other than the default may replace it only if every float32 output bit is the same (row
            # invariance holds per config; a decode-only tiling must not change what a row computes)
            y32 = mod.block_scaled_matmul(xq, sa, wq, sb, config=cfg)
            same = bool(jnp.all(y32 == first.setdefault("ours_dense", y32)))  # the baseline too: a change must keep the bits
            record(f"{tag} {label} {cfg_label(cfg)}", (m, n, k), flops, bench(f, xq, sa, wq, sb), err=f"relerr={err:.2e}",
                   config=str(cfg), bitwise_vs_first_config=same)
        try_run(f"{tag} {label} {cfg}", one)


def in_program(gemm, x, weights, reps: int = 5):
    """(median, min) seconds of one GEMM launched inside a program: `gemm(x, w)` for each of the distinct `weights`
    back to back in one jitted program, divided by their number. Why: a decode-sized GEMM runs 5-20 us on the
    device, less than a jitted call's host dispatch, so timing single calls measures the host (the decode step runs
    them inside one program too). Distinct weights, so each launch reads its weight from HBM, as a step does."""
    f = jax.jit(lambda x, ws: [gemm(x, w) for w in ws])
    med, best = bench(f, x, weights, iters=5, warmup=2, reps=reps)
    return med / len(weights), best / len(weights)


def dense_decode_suite(copy_tbps, copies: int = 16, shapes=None, rows=(64, 256)):
    """The decode step's dense products (the stacked q / k / v projection and o) at 64 / 256 rows, timed in-program:
    our FP8 kernel at the tiling it picks for these rows (`default_config(n, k, m)`, first), at the shape-only tiling
    a training batch gets and at other column tiles / rings (each must keep the first's bits:
    bitwise_vs_first_config), beside the BF16 recipe's product of the same shape (our BF16 kernel, one group: what
    `high_precision_dot` runs on Hopper); bytes moved against the copy bandwidth."""
    from jaxrl_fp8.ops.high_precision import high_precision_dot

    C = gemm_dense.GemmConfig
    hidden, heads, kv, hd = 2048, 32, 4, 128
    variants = [C(64, 64, 4, 16, 0), C(64, 64, 6, 16, 0), C(64, 32, 6, 16, 1), C(64, 32, 8, 16, 0), C(64, 128, 4, 16, 0)]
    for name, n, k in shapes or [("qkv", (heads + 2 * kv) * hd, hidden), ("o", hidden, heads * hd)]:
        w16 = [rand(10 + i, (n, k), jnp.bfloat16, 0.05) for i in range(copies)]
        wq = [quantize_fp8_per_block(w, (128, 128)) for w in w16]
        for m in rows:
            label = f"attn_{name} decode M{m}"
            x16 = rand(1, (m, k), jnp.bfloat16)
            xq, sa = quantize_fp8_per_token_group(x16, 128)
            flops = 2 * m * n * k

            def report(tag, t, weight_bytes, **extra):
                moved = weight_bytes + m * k * (1 if "fp8" in tag else 2) + m * n * 2
                frac = moved / t[0] / (copy_tbps * 1e12) if copy_tbps else None
                record(f"{tag} {label}", (m, n, k), flops, t, bytes=moved, fraction_of_copy_bw=frac, **extra)

            try_run(f"ours_bf16 {label}", lambda: report(
                "ours_bf16_one_group", in_program(lambda x, w: high_precision_dot(x, w, "split3").astype(jnp.bfloat16), x16, w16),
                n * k * 2))
            first = {}
            for cfg in dict.fromkeys([gemm_dense.default_config(n, k, m), gemm_dense.default_config(n, k)] + variants):
                def one(cfg=cfg):
                    y32 = gemm_dense.block_scaled_matmul(xq, sa, *wq[0], config=cfg)
                    same = bool(jnp.all(y32 == first.setdefault("y", y32)))
                    err = check_rows(y32, xq, sa, *wq[0])
                    gemm = lambda x, w: gemm_dense.block_scaled_matmul(x[0], x[1], w[0], w[1], out_dtype=jnp.bfloat16, config=cfg)
                    report(f"ours_fp8 {cfg_label(cfg)}", in_program(gemm, (xq, sa), wq), n * k + n * k // 128**2 * 4,
                           err=f"relerr={err:.2e}", config=str(cfg), bitwise_vs_first_config=same)
                try_run(f"ours_fp8 {label} {cfg}", one)


def moe_suite(configs, quick):
    e, m, sizes, shapes = moe_shapes()
    for name, n, k in shapes:
        flops = 2 * m * n * k
        x16, w16 = rand(3, (m, k), jnp.bfloat16), rand(4, (e, n, k), jnp.bfloat16, 0.05)
        if not quick:
            rd = jax.jit(lambda x, w, g: jax.lax.ragged_dot(x, jnp.swapaxes(w, 1, 2), g, preferred_element_type=jnp.bfloat16))
            try_run(f"ragged_dot {name}", lambda: record(f"lax.ragged_dot_bf16 {name}", (m, n, k, e), flops, bench(rd, x16, w16, sizes, iters=2, warmup=1, reps=2)))
        def mgpu():
            from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu
            best = None
            for bm, bn, st, gbn in [(128, 128, 4, 1), (128, 128, 4, 8), (64, 128, 4, 1), (128, 64, 4, 1), (192, 128, 4, 2)]:
                try:
                    f = jax.jit(functools.partial(ragged_dot_mgpu.ragged_dot, block_m=bm, block_n=bn, block_k=64, max_concurrent_steps=st, grid_block_n=gbn, transpose_rhs=True))
                    t = bench(lambda x, w, g: f(x, w, group_sizes=g), x16, w16, sizes)
                    if best is None or t[0] < best[1][0]:
                        best = ((bm, bn, st, gbn), t)
                except Exception as ex:
                    print("  ragged_dot_mgpu config failed", (bm, bn, st, gbn), str(ex)[:120])
            record(f"ragged_dot_mgpu_bf16 {name}", (m, n, k, e), flops, best[1], config=str(best[0]))
        try_run(f"ragged_dot_mgpu {name}", mgpu)
        from pallas_kernels import gemm_grouped_bf16 as GB
        for bcfg in [GB.Bf16GroupedConfig(), GB.Bf16GroupedConfig(max_concurrent_steps=3, grid_minor_dim=1, grid_tile_width=8)]:
            def ours_bf16(bcfg=bcfg):
                f = jax.jit(functools.partial(GB.grouped_matmul, out_dtype=jnp.bfloat16, config=bcfg))
                record(f"ours_grouped_bf16 {name}", (m, n, k, e), flops, bench(f, x16, w16, sizes), config=str(bcfg))
            try_run(f"ours_grouped_bf16 {name} {bcfg}", ours_bf16)
        wgrad_suite(name, m, n, k, e, sizes, WGRAD_CONFIGS[:1] if quick else WGRAD_CONFIGS[:2])
        grouped_fp8(name, m, n, k, e, sizes, configs)


def grouped_fp8(name, m, n, k, e, sizes, configs):
    """Our grouped FP8 forward under each config (default first) on one MoE shape; every config checked bitwise against
    the first (a promotion chain or grid order must not change a row's bits) and against the block math on expert 0."""
    flops = 2 * m * n * k
    xq, sa = quantize_fp8_per_token_group(rand(3, (m, k), jnp.bfloat16), 128)
    wq, sb = quantize_fp8_per_block(rand(4, (e, n, k), jnp.bfloat16, 0.05), (128, 128))
    first = {}
    for cfg in configs:
        def one(cfg=cfg):
            f = jax.jit(functools.partial(gemm_grouped.grouped_block_scaled_matmul, out_dtype=jnp.bfloat16, config=cfg))
            y = f(xq, sa, wq, sb, sizes)
            s0 = int(sizes[0])
            err = check_rows(y[:s0], xq[:s0], sa[:s0], wq[0], sb[0])
            y32 = gemm_grouped.grouped_block_scaled_matmul(xq, sa, wq, sb, sizes, config=cfg)
            same = bool(jnp.array_equal(jax.lax.bitcast_convert_type(y32, jnp.uint32),
                                        jax.lax.bitcast_convert_type(first.setdefault("y", y32), jnp.uint32)))
            record(f"ours_grouped {name} {cfg_label(cfg)}", (m, n, k, e), flops, bench(f, xq, sa, wq, sb, sizes),
                   err=f"relerr={err:.2e}", config=str(cfg), bitwise_vs_first_config=same)
        try_run(f"ours_grouped {name} {cfg}", one)
    first.clear()


def grouped_only_suite(configs):
    e, m, sizes, shapes = moe_shapes()
    for name, n, k in shapes:
        grouped_fp8(name, m, n, k, e, sizes, configs)


def decode_routing(tokens: int, e: int, k: int, seed: int = 0):
    """Expert-sorted group sizes of `tokens` decode rows routed top-k (k distinct experts each, uniform)."""
    rng = np.random.default_rng(seed)
    experts = np.argsort(rng.random((tokens, e)), axis=1)[:, :k]
    return jnp.asarray(np.bincount(experts.reshape(-1), minlength=e), jnp.int32)


def moe_decode_suite(copy_tbps):
    """The expert GEMMs of one decode step (Qwen3-30B-A3B: 128 experts top-8, gate / up N = 768, K = 2048; down
    N = 2048, K = 768) at 64 and 256 rows: a few rows an expert, so the weight bytes are the cost. Our grouped FP8
    kernel's default 128-row blocks against its narrow split (64-row blocks, a column tile per warpgroup; bits
    compared), our BF16 grouped kernel as the BF16 recipe's anchor; bandwidth = bytes of the touched experts'
    weights (+ scales) / median time, against the copy bandwidth measured in the same run."""
    from pallas_kernels import gemm_grouped_bf16 as GB
    e, topk = 128, 8
    for rows in (64, 256):
        sizes = decode_routing(rows, e, topk)
        touched = int(jnp.sum(sizes > 0))
        m = rows * topk
        for name, n, k in [("gate", 768, 2048), ("down", 2048, 768)]:
            flops = 2 * m * n * k
            x16, w16 = rand(9, (m, k), jnp.bfloat16), rand(10, (e, n, k), jnp.bfloat16, 0.05)
            xq, sa = quantize_fp8_per_token_group(x16, 128)
            wq, sb = quantize_fp8_per_block(w16, (128, 128))
            label = f"{name} decode {rows} rows"
            first = {}
            # candidates beside the default (chains of 2 K blocks): the narrow split; one K block at a time. Deeper
            # rings do not fit beside the full staging tile; staged in two column slices, 5 and 6 stages lost at
            # every point (the note of results/gemm_decode_h100.json)
            for cfg in (gemm_grouped.DEFAULT_CONFIG, gemm_grouped.NARROW_CONFIG,
                        dataclasses.replace(gemm_grouped.DEFAULT_CONFIG, k_blocks_per_step=1)):
                def one(cfg=cfg):
                    # the weights' scales laid out once, as the engine's decode loop holds them (ops.PreparedWeight)
                    op = gemm_grouped.weight_scale_operand(sb, cfg)
                    f = jax.jit(functools.partial(gemm_grouped.grouped_block_scaled_matmul, out_dtype=jnp.bfloat16, config=cfg,
                                                  b_scale_op=op))
                    y32 = gemm_grouped.grouped_block_scaled_matmul(xq, sa, wq, sb, sizes, config=cfg)
                    same = bool(jnp.all(jax.lax.bitcast_convert_type(y32, jnp.uint32) ==
                                        jax.lax.bitcast_convert_type(first.setdefault("y", y32), jnp.uint32)))
                    t = bench(f, xq, sa, wq, sb, sizes)
                    nbytes = touched * n * k * (1 + 4 / (128 * 128))
                    record(f"ours_grouped_fp8 {label} {cfg_label(cfg)}", (m, n, k, e), flops, t, config=str(cfg),
                           bitwise_vs_default=same, weight_bytes=nbytes, tb_per_s=nbytes / t[0] / 1e12,
                           fraction_of_copy=nbytes / t[0] / 1e12 / copy_tbps if copy_tbps else None)
                try_run(f"ours_grouped_fp8 {label} {cfg}", one)

            def bf16():
                f = jax.jit(functools.partial(GB.grouped_matmul, out_dtype=jnp.bfloat16))
                t = bench(f, x16, w16, sizes)
                nbytes = touched * n * k * 2
                record(f"ours_grouped_bf16 {label}", (m, n, k, e), flops, t, config=str(GB.Bf16GroupedConfig()),
                       weight_bytes=nbytes, tb_per_s=nbytes / t[0] / 1e12,
                       fraction_of_copy=nbytes / t[0] / 1e12 / copy_tbps if copy_tbps else None)
            try_run(f"ours_grouped_bf16 {label}", bf16)


WGRAD_OUT_TOKENS = (16384, 4096)  # tokens a step of the wgrad_out suite (x top-8 routed rows)
WGRAD_CONFIGS = None  # filled in main(): the persistent kernel's candidate tilings, default first


def wgrad_suite(name, m, n, k, e, sizes, configs=None, bf16=True):
    """MoE weight gradient dw[g] = dy[rows]^T x[rows] ([E, N, K]): our persistent FP8 kernel (candidate configs), its
    gather predecessor, our BF16 kernel, vs transposed_ragged_dot_mgpu. Each persistent config is checked bitwise
    against the gather kernel on the timed inputs and against the float64 block math on one expert that shares
    both its end blocks."""
    from pallas_kernels import gemm_grouped_wgrad as GW

    flops = 2 * m * n * k
    dy16, x16 = rand(9, (m, n), jnp.bfloat16), rand(10, (m, k), jnp.bfloat16)

    def mgpu():
        from jax.experimental.pallas.ops.gpu import transposed_ragged_dot_mgpu as T
        f = jax.jit(functools.partial(T.transposed_ragged_dot, block_m=128, block_n=128, block_k=64, max_concurrent_steps=4, grid_block_n=1))
        record(f"transposed_ragged_dot_mgpu_bf16 wgrad {name}", (m, n, k, e), flops, bench(lambda a, b, g: f(a, b, group_sizes=g), dy16, x16, sizes))
    try_run(f"transposed_ragged_dot_mgpu {name}", mgpu)

    if bf16:
        bf16_out = {}

        def ours_bf16(fn, label):
            f = jax.jit(functools.partial(fn, num_groups=e))
            bf16_out[label] = f(dy16, x16, sizes)
            same = None
            if len(bf16_out) == 2:  # the persistent kernel must give the gather scheme's bits
                a, b = bf16_out.values()
                same = bool(jnp.array_equal(jax.lax.bitcast_convert_type(a, jnp.uint32),
                                            jax.lax.bitcast_convert_type(b, jnp.uint32)))
            record(f"{label} {name}", (m, n, k, e), flops, bench(f, dy16, x16, sizes), bitwise_equal_to_gather=same)

        for fn, label in ((GW.grouped_wgrad_bf16_gather, "ours_grouped_wgrad_bf16_gather"),
                          (GW.grouped_wgrad_bf16, "ours_grouped_wgrad_bf16")):
            try_run(f"{label} {name}", functools.partial(ours_bf16, fn, label))

    dq, ds = quantize_fp8_per_token_group(dy16.T, 128)
    xq, xs = quantize_fp8_per_token_group(x16.T, 128)
    gather = {}

    def ours_gather():
        f = jax.jit(functools.partial(GW.grouped_wgrad_fp8_gather, num_groups=e))
        gather["out"] = f(dq, ds, xq, xs, sizes)
        record(f"ours_grouped_wgrad_fp8_gather {name}", (m, n, k, e), flops, bench(f, dq, ds, xq, xs, sizes))
    try_run(f"ours_grouped_wgrad_fp8_gather {name}", ours_gather)

    # float64 reference of expert 1 (rows start..end: shares its first and last 128-row block with experts 0 and 2)
    host_sizes = np.asarray(sizes)
    start, end = int(host_sizes[0]), int(host_sizes[0] + host_sizes[1])
    def deq(q, sc):
        v = np.asarray(q[:, start:end].astype(jnp.float32), np.float64)
        cols = np.arange(start, end) // 128
        return v * np.asarray(sc, np.float64)[:, cols]
    ref1 = deq(dq, ds) @ deq(xq, xs).T  # [N, K]

    for cfg in configs or [GW.DEFAULT_WGRAD_CONFIG]:
        def one(cfg=cfg):
            f = jax.jit(functools.partial(GW.grouped_wgrad_fp8, num_groups=e, config=cfg))
            y = f(dq, ds, xq, xs, sizes)
            same = bool(jnp.all(jax.lax.bitcast_convert_type(y, jnp.uint32) ==
                                jax.lax.bitcast_convert_type(gather["out"], jnp.uint32))) if "out" in gather else None
            err = R.rel_err(np.asarray(y[1]), ref1)
            record(f"ours_grouped_wgrad_fp8 {name} {cfg}", (m, n, k, e), flops, bench(f, dq, ds, xq, xs, sizes),
                   err=f"relerr(expert 1 vs float64)={err:.2e}", config=str(cfg), bitwise_vs_gather_kernel=same)
        try_run(f"ours_grouped_wgrad_fp8 {name} {cfg}", one)
    gather.clear()


def moe_shapes():
    e, rows_per_e, hidden, inter = 128, 1024, 2048, 768
    m = e * rows_per_e
    # 16384 tokens x top-8 = 131072 routed rows; uneven but realistic routing: multinomial sizes (torch_anchors.py: same)
    rng = np.random.default_rng(0)
    sizes = jnp.asarray(rng.multinomial(m, np.ones(e) / e), jnp.int32)
    return e, m, sizes, [("gate_up", 2 * inter, hidden), ("down", hidden, inter)]


def wgrad_out_suite():
    """The MoE wgrad kernels' float32 output against BF16 rounded in the kernel's store (`out_dtype`: what the trainer
    asks for with BF16 compute weights), at 16384 and 4096 tokens a step (131072 / 32768 routed rows): f32 alone, f32
    then XLA's convert (the BF16 result as it was made before, in one program), bf16 at 4 and 5 ring stages. Each BF16
    result is checked bitwise against the float32 one cast."""
    from pallas_kernels import gemm_grouped_wgrad as GW

    e, _, _, shapes = moe_shapes()
    bits16 = lambda a: jax.lax.bitcast_convert_type(a.astype(jnp.bfloat16), jnp.uint16)  # noqa: E731
    for tokens in WGRAD_OUT_TOKENS:
        m = tokens * 8
        sizes = jnp.asarray(np.random.default_rng(tokens).multinomial(m, np.ones(e) / e), jnp.int32)
        for name, n, k in shapes:
            flops = 2 * m * n * k
            dy16, x16 = rand(9, (m, n), jnp.bfloat16), rand(10, (m, k), jnp.bfloat16)
            dq, ds = quantize_fp8_per_token_group(dy16.T, 128)
            xq, xs = quantize_fp8_per_token_group(x16.T, 128)
            kernels = (("fp8", GW.grouped_wgrad_fp8, (dq, ds, xq, xs, sizes)), ("bf16", GW.grouped_wgrad_bf16, (dy16, x16, sizes)))
            for kind, fn, args in kernels:
                label = f"wgrad_{kind} {name} {tokens} tokens"
                f32 = jax.jit(functools.partial(fn, num_groups=e))
                ref = {}

                def base(f32=f32, args=args, label=label, ref=ref):
                    ref["bits"] = bits16(f32(*args))
                    record(f"{label} out f32", (m, n, k, e), flops, bench(f32, *args))
                    cast = jax.jit(lambda *a: f32(*a).astype(jnp.bfloat16))
                    record(f"{label} out f32 + convert", (m, n, k, e), flops, bench(cast, *args))
                try_run(f"{label} out f32", base)
                for stages in (4, 5):
                    def one(fn=fn, args=args, label=label, ref=ref, stages=stages):
                        f = jax.jit(functools.partial(fn, num_groups=e, out_dtype=jnp.bfloat16,
                                                      config=GW.WgradConfig(stages=stages)))
                        same = bool(jnp.array_equal(bits16(f(*args)), ref["bits"])) if "bits" in ref else None
                        record(f"{label} out bf16 stages {stages}", (m, n, k, e), flops, bench(f, *args),
                               bitwise_vs_f32_cast=same)
                    try_run(f"{label} out bf16 stages {stages}", one)


def wgrad_only_suite(quick=False):
    e, m, sizes, shapes = moe_shapes()
    for name, n, k in shapes:
        wgrad_suite(name, m, n, k, e, sizes, WGRAD_CONFIGS[:2] if quick else WGRAD_CONFIGS)


DENSE_ANCHOR_SHAPES = [(8192, 8192, 8192, "8192^3"), (16384, 5120, 2048, "attn_qkv M16384"), (16384, 2048, 4096, "attn_o M16384")]


def torch_suite(ours=True, timeout=300):
    """torch's block-wise FP8 GEMM (cuBLAS, 1x128 / 128x128) at 8192^3 and the attention projections, torch's grouped
    GEMMs (BF16, FP8 row-wise; forward and k-grouped wgrad) on the MoE shapes: torch_anchors.py in a child process
    (no JAX there; a missing torch or API is recorded, not fatal). With `ours`, our default dense and grouped
    kernels are timed at the same shapes in this process first, so the anchors sit next to same-run numbers."""
    import json
    import os
    import subprocess
    import tempfile

    if ours:
        for m, n, k, label in DENSE_ANCHOR_SHAPES:
            a16, b16 = rand(1, (m, k), jnp.bfloat16), rand(2, (n, k), jnp.bfloat16, 0.05)
            xq, sa = quantize_fp8_per_token_group(a16, 128)
            wq, sb = quantize_fp8_per_block(b16, (128, 128))
            f = jax.jit(functools.partial(gemm_dense.block_scaled_matmul, out_dtype=jnp.bfloat16))
            try_run(f"ours_dense (next to torch) {label}", lambda: record(f"ours_dense_default (next to torch) {label}", (m, n, k),
                    2 * m * n * k, bench(f, xq, sa, wq, sb)))
            del a16, b16, xq, wq
        e, m, sizes, shapes = moe_shapes()
        for name, n, k in shapes:
            x16, w16 = rand(3, (m, k), jnp.bfloat16), rand(4, (e, n, k), jnp.bfloat16, 0.05)
            xq, sa = quantize_fp8_per_token_group(x16, 128)
            wq, sb = quantize_fp8_per_block(w16, (128, 128))
            f = jax.jit(functools.partial(gemm_grouped.grouped_block_scaled_matmul, out_dtype=jnp.bfloat16))
            try_run(f"ours_grouped (next to torch) {name}", lambda: record(f"ours_grouped_default (next to torch) {name}",
                    (m, n, k, e), 2 * m * n * k, bench(f, xq, sa, wq, sb, sizes)))
            del x16, w16, xq, wq
    here = os.path.dirname(os.path.abspath(__file__))
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    dense = ";".join(f"{m},{n},{k}" for m, n, k, _ in DENSE_ANCHOR_SHAPES)
    cmd = [sys.executable, os.path.join(here, "torch_anchors.py"), "--out", path, "--dense", dense,
           "--moe", "128,1024,1536,2048;128,1024,2048,768"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        print(proc.stdout[-6000:], proc.stderr[-2000:] if proc.returncode else "", flush=True)
        with open(path) as fh:
            got = json.load(fh)
        for row in got.get("results", []):
            RESULTS.append(dict(row, source="torch_anchors.py"))
        RESULTS.append(dict(name="torch_anchors meta", **got.get("meta", {}), returncode=proc.returncode))
    except Exception as ex:  # timeout, crash before the JSON, no torch at all
        RESULTS.append(dict(name="torch_anchors", error=f"{type(ex).__name__}: {str(ex)[:400]}"))
        print("torch anchors: FAILED", ex, flush=True)
    finally:
        os.unlink(path)


def linear_fwd_bwd_suite(m, n, k, label):
    flops = 3 * 2 * m * n * k
    x, w = rand(5, (m, k), jnp.bfloat16), rand(6, (n, k), jnp.float32, 0.05)
    c = rand(7, (m, n), jnp.bfloat16)
    for fmt, bw in [("bf16", "high_precision"), ("fp8-block", "fp8"), ("fp8-block", "high_precision")]:
        def one(fmt=fmt, bw=bw):
            # value_and_grad: the forward GEMM must run too (grad alone lets XLA drop it)
            f = jax.jit(jax.value_and_grad(lambda x, w: jnp.sum((ops.linear(x, w, fmt=fmt, backward=bw) * c).astype(jnp.float32)), argnums=(0, 1)))
            record(f"linear fwd+bwd {fmt}/{bw} {label}", (m, n, k), flops, bench(f, x, w))
        try_run(f"linear {fmt}/{bw} {label}", one)


def copy_bandwidth():
    bps = timing.copy_bandwidth(2048)
    RESULTS.append(dict(name="elementwise copy (read+write) 2 GiB", median_ms=2 * 2**31 / bps * 1e3, tb_per_s=bps / 1e12))
    print(f"copy bandwidth: {bps / 1e12:.2f} TB/s", flush=True)


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--quick", action="store_true", help="fewer variants (first device call)")
    p.add_argument("--suites", default="dense,moe,linear,torch",
                   help="comma-separated subset of dense,dense_decode,moe,grouped,decode,linear,wgrad,wgrad_out,torch (wgrad: the MoE weight gradients alone; "
                        "wgrad_out: the MoE wgrad kernels' float32 vs BF16 stores (out_dtype) at 16384 / 4096 tokens; "
                        "dense_decode: the decode step's stacked q / k / v and o products at 64 / 256 rows timed inside one "
                        "program, our FP8 kernel's tilings beside our BF16 kernel; "
                        "grouped: our grouped FP8 forward alone, both promotion chains; "
                        "decode: the expert GEMMs of a decode step at 64 / 256 rows, both splits of the grouped kernel; "
                        "torch: torch_anchors.py next to our default kernels at the same shapes)")
    p.add_argument("--baseline", default=None, help="path of a previous gemm_dense.py to time in the same run")
    args = p.parse_args(argv)
    suites = set(args.suites.split(","))
    global WGRAD_CONFIGS
    from pallas_kernels.gemm_grouped_wgrad import WgradConfig
    # default first; promotion chains of 2 blocks (same bits); the N-first tile walk (won on down, H100)
    WGRAD_CONFIGS = [WgradConfig(), WgradConfig(blocks_per_step=2), WgradConfig(k_fastest=False)]
    baseline = load_module(args.baseline) if args.baseline else None
    C = gemm_dense.GemmConfig
    default = gemm_dense.default_config(8192, 8192)
    # default first; then the other variants measured best in earlier runs (NOTES_gemm.md)
    dense_cfgs = [default, C(64, 128, 2, 16, 0, k_blocks_per_step=2), C(64, 128, 4, 8), C(64, 128, 4, 16, 0)]
    dense_cfgs = list(dict.fromkeys(dense_cfgs))
    if args.quick:
        dense_cfgs = dense_cfgs[:2]
    print(f"device={jax.devices()[0].device_kind} jax={jax.__version__}", flush=True)
    meta = dict(device=jax.devices()[0].device_kind, jax=jax.__version__, python=platform.python_version(), anchors_reference_md=ANCHORS,
                timing="median over 5 repetitions of 20 back-to-back jitted calls (wall clock / 20) after 3 warm-ups", time=time.strftime("%Y-%m-%d %H:%M:%S"))
    # written after every suite, so a run stopped at a time limit keeps what it measured
    save = lambda: write_results(args.out, dict(meta=meta, results=RESULTS))
    try_run("copy", copy_bandwidth)
    copy_tbps = next((r["tb_per_s"] for r in RESULTS if "tb_per_s" in r), None)
    if "decode" in suites:
        moe_decode_suite(copy_tbps)
        save()
    if "dense" in suites:
        dense_suite(8192, 8192, 8192, dense_cfgs, "8192^3", baseline)
        dense_suite(4096, 7168, 16384, dense_cfgs[:3], "4096x7168x16384", baseline)
        hidden, heads, kv, hd = 2048, 32, 4, 128
        for name, n, k in [("qkv", (heads + 2 * kv) * hd, hidden), ("o", hidden, heads * hd)]:
            dense_suite(16384, n, k, dense_cfgs[:2], f"attn_{name} M16384", baseline)
            # decode: N / 128 tiles leave most SMs idle; 64-wide N tiles (column-scale mode) double the grid
            dense_suite(64, n, k, dense_cfgs[:2] + [C(64, 64, 4, 16, 0), C(64, 64, 2, 16, 0)], f"attn_{name} decode M64", baseline)
        save()
    if "dense_decode" in suites:
        dense_decode_suite(copy_tbps)
        save()
    # the grouped default first (promotion chains of 2 K blocks); then one block at a time (same bits)
    grouped_cfgs = [gemm_grouped.DEFAULT_CONFIG, dataclasses.replace(gemm_grouped.DEFAULT_CONFIG, k_blocks_per_step=1)]
    if "moe" in suites:
        moe_suite(grouped_cfgs[:2] if args.quick else grouped_cfgs, args.quick)
        save()
    if "grouped" in suites and "moe" not in suites:
        grouped_only_suite(grouped_cfgs)
        save()
    if "wgrad" in suites and "moe" not in suites:
        wgrad_only_suite(args.quick)
        save()
    if "wgrad_out" in suites:
        wgrad_out_suite()
        save()
    if "torch" in suites:
        torch_suite()
        save()
    if "linear" in suites:
        linear_fwd_bwd_suite(8192, 8192, 8192, "8192^3")
        linear_fwd_bwd_suite(16384, 2048, 4096, "attn_o M16384")
    save()
    print("wrote", args.out)


if __name__ == "__main__":
    sys.exit(main())
