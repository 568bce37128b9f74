"""PyTorch anchors for gemm.py, run as a separate process (no JAX imported; a torch failure can't stop the JAX run).

    python3 experiments/benchmarks/torch_anchors.py --out anchors.json [--dense M,N,K;...] [--moe E,ROWS,N,K;...]

Dense: cuBLAS block-wise FP8 (1x128 activation scales, 128x128 weight scales) through torch 2.11's
`torch.nn.functional.scaled_mm(a, b, scale_a, ScalingType.BlockWise1x128, scale_b, ScalingType.BlockWise128x128)`
(the older `torch._scaled_mm(a, b, scale_a, scale_b)` with the same scale tensors as a fallback), next to cuBLAS BF16.
Scales: scale_a [M, K/128] outer-dim-major (stride (1, M)), scale_b [K/128, N/128] (the transpose of the weight's
[N/128, K/128]); b is the [N, K] weight seen as its [K, N] transpose.

MoE (routed rows sorted by expert, multinomial sizes with seed 0 as gemm.py's): `torch._grouped_mm` BF16 forward
(2d x 3d) and k-grouped weight gradient (2d x 2d, offsets along the contraction, out [E, N, K]); FP8
`torch._scaled_grouped_mm` forward with row-wise scales (fast accumulation) and, where
this torch has it, block-wise scaled grouped forms. Group offsets that torch rejects are retried rounded up to 16
rows (the result says so: `aligned16`). Every attempt that fails is recorded with its error, not raised.

Timing: CUDA events around `iters` back-to-back calls after `warmup` calls, median and min over `reps`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import traceback

RESULTS: list[dict] = []


def _err(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e)[:400]}"


def bench(torch, fn, iters=20, warmup=3, reps=5):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / iters)
    return statistics.median(times), min(times)


OUT: dict = {}  # main() fills: path, meta


def save():
    """The JSON so far (temp file renamed into place): written after every point, so the points measured before a
    crash that takes the CUDA context with it (a device-side assert) reach the parent."""
    if OUT:
        tmp = OUT["path"] + ".tmp"
        with open(tmp, "w") as fh:
            json.dump(dict(meta=OUT["meta"], results=RESULTS), fh, indent=1)
        os.replace(tmp, OUT["path"])


def record(name, shape, flops, t, **extra):
    med, best = t
    row = dict(name=name, shape=list(shape), median_ms=med * 1e3, min_ms=best * 1e3, tflops=flops / med / 1e12, **extra)
    RESULTS.append(row)
    save()
    print(f"{name:56s} {str(shape):28s} {med*1e3:9.3f} ms {row['tflops']:8.1f} TFLOP/s", flush=True)


def attempt(label, fn):
    try:
        fn()
        return True
    except Exception as e:  # noqa: BLE001 - recorded, the next anchor still runs
        print(f"{label}: FAILED {_err(e)}", flush=True)
        RESULTS.append(dict(name=label, error=_err(e), trace=traceback.format_exc()[-1500:]))
        save()
        return False


def quant_rows(torch, x, group=128):
    """x [R, C] -> e4m3 [R, C] and scales [R, C/128] (1x128 groups along C; amax/448)."""
    r, c = x.shape
    xg = x.float().reshape(r, c // group, group)
    s = (xg.abs().amax(-1).clamp(min=1e-10) / 448.0)
    q = (xg / s[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn).reshape(r, c)
    return q, s


def quant_blocks(torch, w, block=128):
    """w [N, K] -> e4m3 and 128x128 block scales [N/128, K/128]."""
    n, k = w.shape
    wb = w.float().reshape(n // block, block, k // block, block)
    s = wb.abs().amax(dim=(1, 3)).clamp(min=1e-10) / 448.0
    q = (wb / s[:, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn).reshape(n, k)
    return q, s


def dense(torch, m, n, k):
    label = f"{m}x{n}x{k}"
    flops = 2 * m * n * k
    dev = "cuda"
    a16 = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    w16 = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.05
    attempt(f"torch_cublas_bf16 {label}", lambda: record(f"torch_cublas_bf16 {label}", (m, n, k), flops,
                                                       bench(torch, lambda: a16 @ w16.t())))
    aq, sa = quant_rows(torch, a16)
    wq, sb = quant_blocks(torch, w16)
    sa_outer = sa.t().contiguous().t()  # [M, K/128], stride (1, M)
    sb_t = sb.t()  # [K/128, N/128]
    ref = (aq.float().reshape(m, k // 128, 128) * sa[..., None]).reshape(m, k)[:256] @ \
          (wq.float().reshape(n // 128, 128, k // 128, 128) * sb[:, None, :, None]).reshape(n, k).t()

    def check(y):
        return float(((y[:256].float() - ref).norm() / ref.norm()).item())

    F = torch.nn.functional
    forms = []
    if hasattr(F, "scaled_mm") and hasattr(F, "ScalingType"):
        ST = F.ScalingType
        forms.append(("F.scaled_mm BlockWise1x128/BlockWise128x128", lambda: F.scaled_mm(
            aq, wq.t(), sa_outer, ST.BlockWise1x128, sb_t, ST.BlockWise128x128, output_dtype=torch.bfloat16)))
    forms.append(("torch._scaled_mm blockwise scales", lambda: torch._scaled_mm(
        aq, wq.t(), sa_outer, sb_t, out_dtype=torch.bfloat16)))
    for form, fn in forms:
        def one(form=form, fn=fn):
            err = check(fn())
            record(f"torch_cublas_fp8_blockwise {label}", (m, n, k), flops, bench(torch, fn), api=form, err=f"relerr={err:.2e}")
        if attempt(f"torch_cublas_fp8_blockwise {label} [{form}]", one):
            break


def moe(torch, e, rows, n, k):
    import numpy as np

    label = f"E{e} rows{rows} N{n} K{k}"
    m = e * rows
    dev = "cuda"
    sizes = np.random.default_rng(0).multinomial(m, np.ones(e) / e)  # gemm.py's routing
    flops = 2 * m * n * k
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    w = torch.randn(e, n, k, device=dev, dtype=torch.bfloat16) * 0.05
    dy = torch.randn(m, n, device=dev, dtype=torch.bfloat16)

    def offsets(align):
        s = sizes if align == 1 else -(-sizes // align) * align
        return torch.tensor(np.cumsum(s), device=dev, dtype=torch.int32), int(s.sum())

    def with_offsets(label_, make, contraction=False):
        """make(offs, rows_total) -> call; tried with the routing's offsets, then rounded up to 16 rows. Offsets
        along the contraction (the k-grouped wgrad) must be 16-byte multiples, checked by a device-side assert that
        kills the CUDA context (no retry after it), so ragged sizes go straight to the rounded offsets there."""
        ragged = bool(np.any(sizes % 16))
        for align in ((16,) if contraction and ragged else (1, 16)):
            offs, total = offsets(align)
            tag = "" if align == 1 else " aligned16"
            ok = attempt(f"{label_}{tag}", lambda: record(f"{label_}{tag}", (m, n, k, e), flops,
                                                          bench(torch, make(offs, total)), rows_timed=total))
            if ok:
                return

    def pad_rows(t, total):
        return t if t.shape[0] >= total else torch.cat([t, t.new_zeros(total - t.shape[0], *t.shape[1:])])

    # BF16 forward: y = x . w[g]^T (b as [E, K, N] column-major views of [E, N, K])
    def bf16_fwd(offs, tot):
        xa = pad_rows(x, tot)
        return lambda: torch._grouped_mm(xa, w.transpose(-2, -1), offs=offs, out_dtype=torch.bfloat16)

    with_offsets(f"torch_grouped_mm_bf16 fwd {label}", bf16_fwd)
    # BF16 k-grouped weight gradient: dw[g] = dy[rows g]^T . x[rows g] -> [E, N, K]
    dyt = dy.t().contiguous()  # [N, M] row-major
    xt = x.t().contiguous()    # [K, M]; its transpose [M, K] is column-major

    def wgrad_call(offs, tot):
        a = dyt if tot == m else torch.cat([dyt, dyt.new_zeros(n, tot - m)], 1)
        b = xt if tot == m else torch.cat([xt, xt.new_zeros(k, tot - m)], 1)
        return lambda: torch._grouped_mm(a, b.t(), offs=offs, out_dtype=torch.bfloat16)  # bf16 out (ours: float32)

    with_offsets(f"torch_grouped_mm_bf16 wgrad {label}", wgrad_call, contraction=True)

    # FP8 forward, row-wise scales (one per row of x, one per output column of each expert), fast accumulation
    if not hasattr(torch, "_scaled_grouped_mm"):
        RESULTS.append(dict(name=f"torch_scaled_grouped_mm_fp8 {label}", error="torch has no _scaled_grouped_mm"))
        return
    xq = x.float()
    sx = xq.abs().amax(1).clamp(min=1e-10) / 448.0
    xq = (xq / sx[:, None]).to(torch.float8_e4m3fn)
    wf = w.float()
    sw = wf.abs().amax(2).clamp(min=1e-10) / 448.0  # [E, N]
    wq = (wf / sw[..., None]).to(torch.float8_e4m3fn)

    def fp8_fwd(offs, tot):
        xa, sa = pad_rows(xq, tot), pad_rows(sx, tot)
        return lambda: torch._scaled_grouped_mm(xa, wq.transpose(-2, -1), sa, sw, offs=offs, out_dtype=torch.bfloat16,
                                                use_fast_accum=True)

    with_offsets(f"torch_scaled_grouped_mm_fp8_rowwise fwd {label}", fp8_fwd)

    # FP8 k-grouped weight gradient (2d x 2d), row-wise scales per (expert, output row / column)
    dq = dyt.float()
    sdy = dq.abs().amax(1).clamp(min=1e-10) / 448.0
    dq = (dq / sdy[:, None]).to(torch.float8_e4m3fn)
    xq2 = xt.float()
    sxt = xq2.abs().amax(1).clamp(min=1e-10) / 448.0
    xq2 = (xq2 / sxt[:, None]).to(torch.float8_e4m3fn)

    def fp8_wgrad(offs, tot):
        a = dq if tot == m else torch.cat([dq, dq.new_zeros(n, tot - m)], 1)
        b = xq2 if tot == m else torch.cat([xq2, xq2.new_zeros(k, tot - m)], 1)
        sa, sb = sdy.repeat(e), sxt.repeat(e)  # one scale per (group, row): [E*N], [E*K]
        return lambda: torch._scaled_grouped_mm(a, b.t(), sa, sb, offs=offs, out_dtype=torch.bfloat16, use_fast_accum=True)

    with_offsets(f"torch_scaled_grouped_mm_fp8_rowwise wgrad {label}", fp8_wgrad, contraction=True)


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--dense", default="8192,8192,8192;16384,5120,2048;16384,2048,4096")
    p.add_argument("--moe", default="128,1024,1536,2048;128,1024,2048,768")
    args = p.parse_args(argv)
    meta = {}
    OUT.update(path=args.out, meta=meta)
    try:
        import torch
        meta.update(torch=torch.__version__, cuda=torch.version.cuda, available=torch.cuda.is_available())
        if not torch.cuda.is_available():
            raise RuntimeError("torch sees no CUDA device")
        meta["device"] = torch.cuda.get_device_name(0)
        print(f"torch {torch.__version__} on {meta['device']}", flush=True)
        meta["timing"] = "CUDA events around 20 back-to-back calls after 3 warm-ups; median and min over 5 repetitions"
        meta["complete"] = False  # True once every anchor ran (a crash leaves the points before it)
    except Exception as e:  # noqa: BLE001
        meta["error"] = _err(e)
        print("torch anchors skipped:", meta["error"], flush=True)
        save()
        return 0
    for case in filter(None, args.dense.split(";")):
        m, n, k = map(int, case.split(","))
        attempt(f"torch dense {case}", lambda: dense(torch, m, n, k))
        torch.cuda.empty_cache()
    for case in filter(None, args.moe.split(";")):
        e, rows, n, k = map(int, case.split(","))
        attempt(f"torch moe {case}", lambda: moe(torch, e, rows, n, k))
        torch.cuda.empty_cache()
    meta["complete"] = True
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
