"""Where the time of one FP8 linear fwd+bwd goes: every component timed alone, in one run, next to BF16.

For each shape (M, N, K) (x [M, K] bf16, w [N, K] float32 master, upstream gradient g [M, N] bf16, as in
gemm.py's fwd+bwd suite) this times, jitted and each on its own:

  fp8  quantize x (1x128)        quantize w (128x128)       forward GEMM (bf16 out, as ops does; f32 out
                                                            + XLA cast, the unfused alternative)
       quantize g (1x128)        W^T for dgrad (XLA)        dgrad GEMM (bf16 out)
       pad + transpose g, x (XLA, materialised)             quantize g^T, x^T (row kernel on the copies)
       fused transpose+quantize g, x (quantize_transposed)  wgrad GEMM (column-scale mode)
       whole fwd+bwd (jax.value_and_grad of ops.linear as it is), the same with the unfused wgrad operand
       path (pad + transpose + row quantize) patched in, and with that and a float32 forward GEMM output (cast
       by XLA), for an A/B of the fused kernels in the same run (the labels call the patched ops "previous");
       on the Mosaic backend also the three GEMMs under two other tile configs (--no-gemm-configs: skip)
  bf16 forward dot, dgrad dot, wgrad dot, whole fwd+bwd

Timing as in gemm.py: median (and min) over `reps` repetitions of `iters` back-to-back calls, after warm-up.
Isolated components can fuse differently from the whole graph (XLA may fold a transpose into a neighbour),
so the sum of the parts is a guide; the whole fwd+bwd rows are the measurement.

    PYTHONPATH=src:. python experiments/benchmarks/linear_breakdown.py --out results/linear_breakdown_h200.json
    PYTHONPATH=src:. python experiments/benchmarks/linear_breakdown.py --quick --backend interpret --out /tmp/lb.json  # CPU
"""

from __future__ import annotations

import argparse
import contextlib
import platform
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
import timing  # noqa: E402  (this folder is on sys.path when the script runs)
from jax import lax

from jaxrl_fp8 import ops
from jaxrl_fp8.ops import backends, block_scaled
from jaxrl_fp8.ops import operands as O
from jaxrl_fp8.ops.xla_gemm import dot_nt_f32

BF16, F32, E4M3 = jnp.bfloat16, jnp.float32, jnp.float8_e4m3fn
# gemm.py's shapes: the square one and the Qwen3-30B-A3B attention output projection (hidden 2048, 32 heads x 128)
SHAPES = [("8192^3", 8192, 8192, 8192), ("attn_o M16384", 16384, 2048, 4096)]
QUICK_SHAPES = [("quick 256^3", 256, 256, 256), ("quick attn-like", 384, 128, 256)]

RESULTS: list[dict] = []


def bench(fn, *args, iters, reps, warmup=2):
    return timing.bench(fn, *args, iters=iters, reps=reps, warmup=warmup)


def nbytes(*arrays) -> int:
    return int(sum(np.prod(a.shape) * jnp.dtype(a.dtype).itemsize for a in jax.tree.leaves(arrays)))


def _pad_rows(a, multiple=128):
    pad = (-a.shape[0]) % multiple
    return jnp.pad(a, [(0, pad), (0, 0)]) if pad else a


@contextlib.contextmanager
def old_wgrad_operands(f32_forward=False):
    """ops with the unfused wgrad operand path (pad + XLA transpose + the row quantizer), and optionally a
    float32 forward GEMM output (cast to bf16 by XLA after the kernel)."""
    from jaxrl_fp8.ops import dense

    saved, saved_out = O.fp8_act_transposed, dense._GEMM_OUT_DTYPES
    O.fp8_act_transposed = lambda x, backend=None: O.fp8_act(_pad_rows(x).T, backend)
    if f32_forward:
        dense._GEMM_OUT_DTYPES = (jnp.dtype(F32),)
    try:
        yield
    finally:
        O.fp8_act_transposed, dense._GEMM_OUT_DTYPES = saved, saved_out


class Runner:
    def __init__(self, label, shape, iters, reps):
        self.label, self.shape, self.iters, self.reps = label, shape, iters, reps

    def time(self, group, name, fn, *args, flops=None, bytes_fn=None):
        """Times jit(fn)(*args). GB/s counts the inputs once and the outputs once (bytes_fn overrides)."""
        try:
            f = jax.jit(fn)
            out = jax.block_until_ready(f(*args))
            med, best = bench(f, *args, iters=self.iters, reps=self.reps)
            moved = bytes_fn() if bytes_fn else nbytes(args) + nbytes(out)
            row = dict(shape_label=self.label, shape=self.shape, group=group, name=name, median_ms=med * 1e3, min_ms=best * 1e3)
            if flops:
                row["tflops"] = flops / med / 1e12
            else:
                row["bytes"] = moved
                row["gb_per_s"] = moved / med / 1e9
            RESULTS.append(row)
            rate = f"{row['tflops']:8.1f} TFLOP/s" if flops else f"{row['gb_per_s']:8.1f} GB/s   "
            print(f"  {group:5s} {name:46s} {med * 1e3:9.3f} ms  {rate}", flush=True)
            return out
        except Exception as e:  # keep measuring the rest; the failure goes into the JSON
            msg = f"{type(e).__name__}: {str(e)[:400]}"
            print(f"  {group:5s} {name:46s} FAILED {msg}", flush=True)
            RESULTS.append(dict(shape_label=self.label, shape=self.shape, group=group, name=name, error=msg,
                                trace=traceback.format_exc()[-2000:]))
            return None


def rand(key, shape, dtype, scale=1.0):
    return (jax.random.normal(jax.random.key(key), shape, F32) * scale).astype(dtype)


def fused_transposed(be):
    """The fused kernel for the component row (interpret mode on CPU when asked), else the composition."""
    if be in ("mosaic", "interpret"):
        from pallas_kernels import quantize_transposed as KT

        return lambda a: KT.fp8_transposed_per_token_group(a, interpret=be == "interpret")
    return lambda a: O.fp8_act(_pad_rows(a).T, be)


def gemm_config_variants(r, flops, fwd, dgrad, wgrad):
    """The three GEMMs under the tile configs measured best elsewhere (NOTES_gemm.md), next to the default:
    the kernel's config is chosen from (N, K) only, so a better one for these shapes is a free gain."""
    from pallas_kernels import gemm_dense as G

    variants = [G.GemmConfig(64, 128, 2, 16, 0, k_blocks_per_step=2), G.GemmConfig(64, 128, 4, 8)]
    for what, ops_, kw in (("forward", fwd, dict(out_dtype=BF16)), ("dgrad", dgrad, dict(out_dtype=BF16)),
                           ("wgrad", wgrad, dict(b_rows_per_scale=1))):
        a, sa, b, sb = ops_
        default = G.default_config(b.shape[0], a.shape[1])
        for cfg in variants:
            if cfg == default:
                continue
            label = f"{cfg.tile_m * 2}x{cfg.tile_n} s{cfg.max_concurrent_steps} w{cfg.grid_tile_width} minor{cfg.grid_minor_dim} k{cfg.k_blocks_per_step}"
            r.time("fp8", f"{what} GEMM, config {label}",
                   lambda a, sa, b, sb, cfg=cfg, kw=kw: G.block_scaled_matmul(a, sa, b, sb, config=cfg, **kw),
                   a, sa, b, sb, flops=flops)


def breakdown(label, m, n, k, backend, iters, reps, gemm_configs=True):
    print(f"{label}: M={m} N={n} K={k} backend={backend}", flush=True)
    r = Runner(label, (m, n, k), iters, reps)
    gemm = 2 * m * n * k
    x, w, c = rand(5, (m, k), BF16), rand(6, (n, k), F32, 0.05), rand(7, (m, n), BF16)
    g = c  # d(sum(y * c))/dy: the upstream gradient of gemm.py's loss, bf16 like y
    be_f = backends.resolve(backend, "fp8-block", n, k)
    be_d = backends.resolve(backend, "fp8-block", k, n)
    mp = -(-m // 128) * 128
    be_w = backends.resolve(backend, "fp8-block", k, mp)
    mm = lambda be, **kw: (lambda a, sa, b, sb: block_scaled.block_scaled_matmul(a, sa, b, sb, backend=be, **kw))

    # ---- FP8 components, in the order the fwd+bwd runs them
    xq, sa = r.time("fp8", "quantize x (1x128)", lambda a: O.fp8_act(a, be_f), x)
    wq, sb = r.time("fp8", "quantize w (128x128, f32 master)", lambda a: O.fp8_weight(a, be_f), w)
    r.time("fp8", "forward GEMM (f32 out)", mm(be_f), xq, sa, wq, sb, flops=gemm)
    r.time("fp8", "forward GEMM (bf16 out)", mm(be_f, out_dtype=BF16), xq, sa, wq, sb, flops=gemm)
    r.time("fp8", "forward f32 -> bf16 cast (XLA)", lambda y: y.astype(BF16), jnp.zeros((m, n), F32))
    gq, sg = r.time("fp8", "quantize g (1x128)", lambda a: O.fp8_act(a, be_d), g)
    wqt, sbt = r.time("fp8", "W^T, scales^T for dgrad (XLA)", lambda a, s: (a.T, s.T), wq, sb)
    r.time("fp8", "dgrad GEMM (bf16 out)", mm(be_d, out_dtype=BF16), gq, sg, wqt, sbt, flops=gemm)
    gt, xt = r.time("fp8", "pad + transpose g, x (XLA)", lambda a, b: (_pad_rows(a).T, _pad_rows(b).T), g, x)
    r.time("fp8", "quantize g^T, x^T (row kernel, on copies)", lambda a, b: (O.fp8_act(a, be_w), O.fp8_act(b, be_w)), gt, xt)
    r.time("fp8", "old path: pad+transpose+quantize g, x", lambda a, b: (O.fp8_act(_pad_rows(a).T, be_w), O.fp8_act(_pad_rows(b).T, be_w)), g, x)
    ft = fused_transposed(be_w)
    got = r.time("fp8", "fused transpose+quantize g, x", lambda a, b: (ft(a), ft(b)), g, x)
    (gtq, sgt), (xtq, sxt) = got if got is not None else (O.fp8_act(gt, be_w), O.fp8_act(xt, be_w))
    r.time("fp8", "wgrad GEMM (column-scale mode, f32 out)", mm(be_w, b_rows_per_scale=1), gtq, sgt, xtq, sxt, flops=gemm)

    if backend == "mosaic" and gemm_configs:
        gemm_config_variants(r, gemm, (xq, sa, wq, sb), (gq, sg, wqt, sbt), (gtq, sgt, xtq, sxt))

    def loss(fmt, bw):
        be = None if backend == "mosaic" else backend
        return lambda x, w: jnp.sum((ops.linear(x, w, fmt=fmt, backward=bw, backend=be) * c).astype(F32))

    fb = jax.value_and_grad(loss("fp8-block", "fp8"), argnums=(0, 1))
    r.time("fp8", "whole fwd+bwd (fp8 bwd, current ops)", fb, x, w, flops=3 * gemm)
    with old_wgrad_operands():
        r.time("fp8", "whole fwd+bwd (fp8 bwd, old wgrad operands)", jax.value_and_grad(loss("fp8-block", "fp8"), argnums=(0, 1)), x, w, flops=3 * gemm)
    with old_wgrad_operands(f32_forward=True):
        r.time("fp8", "whole fwd+bwd (previous ops: old wgrad, f32 fwd)", jax.value_and_grad(loss("fp8-block", "fp8"), argnums=(0, 1)), x, w, flops=3 * gemm)

    # ---- BF16 counterparts (the weight cast to bf16 is part of ops' bf16 forward, timed with it)
    xb, wb = x, w.astype(BF16)
    r.time("bf16", "forward dot (w f32 -> bf16 cast incl.)", lambda a, b: dot_nt_f32(a, b.astype(BF16)), xb, w, flops=gemm)
    r.time("bf16", "forward dot (bf16 operands)", lambda a, b: dot_nt_f32(a, b), xb, wb, flops=gemm)
    dn = (((1,), (0,)), ((), ()))
    r.time("bf16", "dgrad dot g . W", lambda a, b: lax.dot_general(a, b, dn, preferred_element_type=F32), g, wb, flops=gemm)
    dt = (((0,), (0,)), ((), ()))
    r.time("bf16", "wgrad dot g^T . x", lambda a, b: lax.dot_general(a, b, dt, preferred_element_type=F32), g, xb, flops=gemm)
    r.time("bf16", "whole fwd+bwd", jax.value_and_grad(loss("bf16", "high_precision"), argnums=(0, 1)), x, w, flops=3 * gemm)
    summary(label)


def summary(label):
    rows = {row["name"]: row for row in RESULTS if row.get("shape_label") == label and "median_ms" in row}
    get = lambda name: rows[name]["median_ms"] if name in rows else float("nan")
    bf16, fp8, old = get("whole fwd+bwd"), get("whole fwd+bwd (fp8 bwd, current ops)"), get("whole fwd+bwd (previous ops: old wgrad, f32 fwd)")
    parts = ["quantize x (1x128)", "quantize w (128x128, f32 master)", "forward GEMM (bf16 out)", "quantize g (1x128)",
             "W^T, scales^T for dgrad (XLA)", "dgrad GEMM (bf16 out)", "fused transpose+quantize g, x",
             "wgrad GEMM (column-scale mode, f32 out)"]
    s = sum(get(p) for p in parts)
    line = dict(shape_label=label, name="summary", bf16_ms=bf16, fp8_ms=fp8, fp8_previous_ops_ms=old,
                speedup=bf16 / fp8, speedup_old=bf16 / old, sum_of_fp8_parts_ms=s)
    RESULTS.append(line)
    print(f"  => BF16 {bf16:.3f} ms, FP8 {fp8:.3f} ms ({bf16 / fp8:.2f}x), FP8 previous ops {old:.3f} ms "
          f"({bf16 / old:.2f}x); sum of the FP8 parts {s:.3f} ms", flush=True)


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--quick", action="store_true", help="small shapes (CPU check)")
    p.add_argument("--backend", default=None, choices=["mosaic", "xla", "interpret"],
                   help="fp8-block GEMM/quantize backend (default: mosaic on a Hopper GPU, else xla)")
    p.add_argument("--no-gemm-configs", action="store_true", help="skip the GEMM tile-config variants (mosaic only)")
    p.add_argument("--iters", type=int, default=None)
    p.add_argument("--reps", type=int, default=None)
    args = p.parse_args(argv)
    backend = args.backend or ("mosaic" if backends.default_device_is_hopper() else "xla")
    shapes = QUICK_SHAPES if args.quick else SHAPES
    iters = args.iters or (2 if args.quick else 10)
    reps = args.reps or (2 if args.quick else 5)
    print(f"device={jax.devices()[0].device_kind} jax={jax.__version__} backend={backend}", flush=True)
    t0 = time.perf_counter()
    for label, m, n, k in shapes:
        breakdown(label, m, n, k, backend, iters, reps, gemm_configs=not args.no_gemm_configs)
    meta = dict(device=jax.devices()[0].device_kind, platform=jax.devices()[0].platform, jax=jax.__version__,
                python=platform.python_version(), backend=backend, shapes=[list(s) for s in shapes],
                timing=f"median (and min) over {reps} repetitions of {iters} back-to-back jitted calls after 2 warm-ups",
                bytes="inputs once + outputs once (GB/s rows)", time=time.strftime("%Y-%m-%d %H:%M:%S"),
                wall_s=time.perf_counter() - t0)
    timing.write_results(args.out, dict(meta=meta, results=RESULTS))
    print(f"wrote {args.out} ({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    sys.exit(main())
