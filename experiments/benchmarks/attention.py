"""Flash attention (pallas_kernels.attention) against cuDNN and the model's "xla" path, same run, one GPU.

Causal forward and forward+backward TFLOP/s at T = 1k, 4k, 8k, 16k (Qwen3-30B-A3B heads: 32 query / 4 key-value
heads of 128; batch chosen so each point holds 16k tokens), and the paged decode step time at batch 1 / 64 / 256
with cache lengths 1k-16k against the HBM roofline of the KV bytes it must read (the copy bandwidth measured in the
same run). FLOPs count the causal half: fwd 2 * 2 * B * H * T^2 / 2 * D, fwd+bwd 3.5x that (the backward recomputes
the scores). Writes a table and results/attention_<device>.json; a failing point (OOM, unsupported) is recorded.

    python experiments/benchmarks/attention.py --out experiments/benchmarks/results/attention_h200.json
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

import jaxrl_fp8  # noqa: F401  (first: sets the XLA flags of the precision contract before JAX starts)
import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import timing  # noqa: E402
from timing import bench, write_results  # noqa: E402

from pallas_kernels import attention as A  # noqa: E402

H, HKV, D = 32, 4, 128
BF16 = jnp.bfloat16


def _xla_attention(q, k, v):
    from jaxrl_fp8.model.attention import attention, causal_segment_mask  # noqa: PLC0415

    mask = causal_segment_mask(jnp.zeros(q.shape[:2], jnp.int32))
    return attention(q, k, v, mask, scale=D**-0.5, impl="xla")


def _cudnn(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, scale=D**-0.5, implementation="cudnn")


def _ours(q, k, v):
    return A.flash_attention(q, k, v, scale=D**-0.5)


IMPLS = {"flash (ours)": _ours, "cudnn": _cudnn, "xla": _xla_attention}


def _time(fn, *args, iters):
    try:
        med, _ = bench(fn, *args, iters=iters, warmup=2, reps=3)
        return {"median_s": med}
    except Exception as e:  # noqa: BLE001  (a point that fails is recorded, the sweep goes on)
        return {"error": f"{type(e).__name__}: {str(e)[:300]}"}


def training_points(lengths, iters, results, out):
    for t in lengths:
        b = max(1, 16384 // t)
        ks = jax.random.split(jax.random.key(t), 4)
        q = jax.random.normal(ks[0], (b, t, H, D), BF16)
        k = jax.random.normal(ks[1], (b, t, HKV, D), BF16)
        v = jax.random.normal(ks[2], (b, t, HKV, D), BF16)
        g = jax.random.normal(ks[3], (b, t, H, D), BF16)
        flops_fwd = 2 * 2 * b * H * t * t / 2 * D
        for name, fn in IMPLS.items():
            fwd = jax.jit(fn)
            fwd_bwd = jax.jit(lambda q, k, v, fn=fn: jax.vjp(fn, q, k, v)[1](g))
            row = {"kind": "train", "impl": name, "T": t, "batch": b}
            for label, f, flops in (("fwd", fwd, flops_fwd), ("fwd_bwd", fwd_bwd, 3.5 * flops_fwd)):
                r = _time(f, q, k, v, iters=iters)
                row[label] = r
                if "median_s" in r:
                    r["tflops"] = flops / r["median_s"] / 1e12
            results["points"].append(row)
            print(f"train T={t:6d} B={b:3d} {name:14s} fwd {row['fwd'].get('tflops', row['fwd'].get('error')):}"
                  f"  fwd+bwd {row['fwd_bwd'].get('tflops', row['fwd_bwd'].get('error'))}", flush=True)
            write_results(out, results)
        del q, k, v, g


def fp8_decode_point(b, s, q, kp, vp, table, pos, iters, copy_bps, converters=1):
    """The paged decode step over FP8 pages (`kv_cache="fp8"`: e4m3 values, a power-of-two scale per token and
    head, dequantized in the kernel by `converters` converter warpgroups) of the same keys ("fp8 kv", "fp8 kv, 2
    converters"); its output is compared bit for bit with the BF16 kernel over the dequantized pages (the values the
    trainer's forward attends over)."""
    from jaxrl_fp8.precision.kv import quantize_kv

    kq, vq = quantize_kv(kp), quantize_kv(vp)
    ks, vs = (x.scales.transpose(0, 2, 1) for x in (kq, vq))
    args = (q, kq.values, vq.values, table, pos, ks, vs)
    cfg = A.FlashConfig(paged_fp8_converters=converters)
    f8 = jax.jit(lambda q, kp, vp, table, pos, ks, vs: A.paged_attention(
        q, kp, vp, table, pos, scale=D**-0.5, k_scales=ks, v_scales=vs, config=cfg))
    r = _time(f8, *args, iters=iters)
    kv_bytes = 2 * b * s * HKV * (D + 4)
    variant = "fp8 kv" if converters == A.FlashConfig().paged_fp8_converters else f"fp8 kv, {converters} converters"
    row = {"kind": "decode", "batch": b, "cache_len": s, "kv_bytes": kv_bytes, "variant": variant, **r}
    if "median_s" in r:
        row["roofline_s"] = kv_bytes / copy_bps
        row["fraction_of_roofline"] = row["roofline_s"] / r["median_s"]
        deq = jax.jit(lambda q, kp, vp, table, pos: A.paged_attention(q, kp, vp, table, pos, scale=D**-0.5))
        got = np.asarray(f8(*args).astype(jnp.float32))
        want = np.asarray(deq(q, kq.dequantize(BF16), vq.dequantize(BF16), table, pos).astype(jnp.float32))
        row["bitwise_vs_bf16_of_dequantized"] = bool(np.array_equal(got.view(np.uint32), want.view(np.uint32)))
    return row


def decode_points(batches, lengths, iters, copy_bps, results, out, stage_variants=(), fp8_kv=False,
                  fp8_converters=(1,)):
    """The paged decode step per (batch, cache length) under the default config, under each pipeline depth of
    `stage_variants` (FlashConfig.paged_stages: fewer stages leave shared memory for a second program per SM), each
    variant's output compared with the default's bit for bit; with `fp8_kv`, over FP8 pages (`fp8_decode_point`) with
    each count of converter warpgroups in `fp8_converters`."""
    default = A.FlashConfig()
    configs = [("default", default)] + [(f"stages {s}", A.FlashConfig(paged_stages=s)) for s in stage_variants
                                        if s != default.paged_stages]
    for b in batches:
        for s in lengths:
            n_pages = s // A.BLOCK_KV
            pool = b * n_pages
            kv_bytes = 2 * b * s * HKV * D * 2
            if kv_bytes > 40e9:
                continue
            ks = jax.random.split(jax.random.key(b * s), 3)
            kp = jax.random.normal(ks[0], (pool, A.BLOCK_KV, HKV, D), BF16)
            vp = jax.random.normal(ks[1], (pool, A.BLOCK_KV, HKV, D), BF16)
            table = jnp.asarray(np.random.default_rng(0).permutation(pool).reshape(b, n_pages), jnp.int32)
            q = jax.random.normal(ks[2], (b, 1, H, D), BF16)
            pos = jnp.full((b, 1), s - 1, jnp.int32)
            reference = None
            for label, cfg in configs:
                f = jax.jit(lambda q, kp, vp, table, pos, cfg=cfg: A.paged_attention(q, kp, vp, table, pos,
                                                                                     scale=D**-0.5, config=cfg))
                r = _time(f, q, kp, vp, table, pos, iters=iters)
                row = {"kind": "decode", "batch": b, "cache_len": s, "kv_bytes": kv_bytes, **r}
                if label != "default":
                    row["variant"] = label
                    if cfg.paged_stages != default.paged_stages:
                        row["paged_stages"] = cfg.paged_stages
                if "median_s" in r:
                    row["roofline_s"] = kv_bytes / copy_bps
                    row["fraction_of_roofline"] = row["roofline_s"] / r["median_s"]
                    got = np.asarray(f(q, kp, vp, table, pos).astype(jnp.float32))
                    reference = got if reference is None else reference
                    row["bitwise_vs_default"] = bool(np.array_equal(got.view(np.uint32), reference.view(np.uint32)))
                results["points"].append(row)
                print(f"decode B={b:4d} S={s:6d} {label:12s} {r.get('median_s', r.get('error'))} s  "
                      f"roofline fraction {row.get('fraction_of_roofline')}  bitwise {row.get('bitwise_vs_default')}",
                      flush=True)
                write_results(out, results)
            for converters in fp8_converters if fp8_kv else ():
                row = fp8_decode_point(b, s, q, kp, vp, table, pos, iters, copy_bps, converters)
                results["points"].append(row)
                print(f"decode B={b:4d} S={s:6d} {row['variant']:16s} {row.get('median_s', row.get('error'))} s  "
                      f"roofline fraction {row.get('fraction_of_roofline')}  "
                      f"bitwise vs dequantized {row.get('bitwise_vs_bf16_of_dequantized')}", flush=True)
                write_results(out, results)
            del kp, vp


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default="1024,4096,8192,16384", help="training sequence lengths T")
    p.add_argument("--decode-batches", default="1,64,256", help="decode batch sizes")
    p.add_argument("--decode-lengths", default="1024,4096,16384", help="decode cache lengths")
    p.add_argument("--iters", type=int, default=5, help="calls per timing repetition")
    p.add_argument("--skip", default="", help="comma list of parts to skip: train, decode")
    p.add_argument("--bwd-dq-keys", default="64",
                   help="comma list of the backward dq kernel's keys per step (FlashConfig.bwd_dq_keys) to time as "
                        "separate 'flash' rows of the training points beside the default config's "
                        "(FlashConfig().bwd_dq_keys, 128; default: %(default)s)")
    p.add_argument("--paged-stages", default="",
                   help="comma list of pipeline depths of the paged decode kernel (FlashConfig.paged_stages) to time "
                        "beside the default's (3): e.g. 1,2 (one or two stages leave shared memory for a second "
                        "program per SM)")
    p.add_argument("--fp8-kv", action="store_true",
                   help="also time the decode step over FP8 pages (kv_cache='fp8': e4m3 values and a power-of-two "
                        "scale per token and head, half the bytes, dequantized by a converter warpgroup) and compare its "
                        "bits with the BF16 kernel over the dequantized pages")
    p.add_argument("--fp8-converters", default="1",
                   help="with --fp8-kv: comma list of converter warpgroup counts (FlashConfig.paged_fp8_converters, 1 or "
                        "2) to time over FP8 pages (default: %(default)s)")
    p.add_argument("--out", default="experiments/benchmarks/results/attention_h200.json", help="JSON path")
    a = p.parse_args(argv)
    dev = jax.devices()[0]
    results = {"device": dev.device_kind, "jax": jax.__version__, "python": platform.python_version(),
               "heads": [H, HKV], "head_dim": D, "date": time.strftime("%Y-%m-%d"), "points": []}
    skip = set(a.skip.split(","))
    for keys in (int(x) for x in a.bwd_dq_keys.split(",") if x and int(x) != A.FlashConfig().bwd_dq_keys):
        cfg = A.FlashConfig(bwd_dq_keys=keys)
        IMPLS[f"flash (ours, dq {keys}-key steps)"] = lambda q, k, v, cfg=cfg: A.flash_attention(q, k, v, scale=D**-0.5, config=cfg)
    if "train" not in skip:
        training_points([int(x) for x in a.lengths.split(",")], a.iters, results, a.out)
    if "decode" not in skip:
        bps = timing.copy_bandwidth(1024)
        results["copy_bytes_per_s"] = bps
        decode_points([int(x) for x in a.decode_batches.split(",")], [int(x) for x in a.decode_lengths.split(",")],
                      a.iters, bps, results, a.out, [int(x) for x in a.paged_stages.split(",") if x],
                      fp8_kv=a.fp8_kv, fp8_converters=[int(x) for x in a.fp8_converters.split(",") if x])
    write_results(a.out, results)


if __name__ == "__main__":
    main()
