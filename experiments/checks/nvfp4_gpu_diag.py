"""Where does NVFP4 (and small-tensor FP8) quantized by XLA on the default device first differ from XLA:CPU?

    PYTHONPATH=src:. python experiments/checks/nvfp4_gpu_diag.py --out DIR [--quick]

Writes DIR/nvfp4_gpu_diag.json (and prints a summary). On a CPU-only machine the "device" is the CPU, so every
count must be 0 (that is the CPU test of this script).

What it runs, in one fresh child process per XLA_FLAGS setting (flags must be set before JAX starts):
  flag sets   "import_default" (what `import jaxrl_fp8` sets: div.rn + --xla_allow_excess_precision=false),
              "excess_precision_true" (div.rn, excess precision allowed: the state in which 541 575 bytes differed),
              "div_full" (-nvptx-prec-divf32=1: XLA's approximate division, no excess precision),
              "no_triton_fusions" (import flags + XLA's Triton softmax-style fusions off: the open hypothesis).
  stages      the NVFP4 chain of docs/decisions/0001, every intermediate returned by ONE jit (so the graph
              is fused as a whole): global amax, g, block amax, amax/6, /g, min(.,448), the e4m3 cast (bits),
              its float32 decode, d = bs*g, x/d, clamp, E2M1 codes, packed bytes.
  variants    how the block scale is decoded back to float32 (the suspect): "astype" (a convert:
              bs.astype(f32), a chain XLA:GPU's SimplifyFPConversions may delete), "bits"
              (precision.arith.fp8_to_f32, the contract's decode), "barrier" (optimization_barrier before the
              cast); and "plain_div" (bits decode but `/` instead of ieee_div: does XLA rewrite x / d?).
  finals      precision.quantize_nvfp4 itself jitted alone (global amax: tensor / given 4.0 / per row;
              four_over_six too), quantize_dequantize_activation (fp8/mxfp8/nvfp4), and FP8 per-block /
              per-token-group on small shapes like the converter test's tiny checkpoints.
  compiled    per flag set, a summary of the optimized HLO and PTX of the NVFP4 and small FP8 functions
              (fusion kinds, converts from/to f8, div/rcp/fma/cvt instruction counts) from --xla_dump_to.
For every compared array: number of differing elements (bitwise; NaN vs NaN with other bits counted
separately) and up to 4 examples as hex bits with the upstream stage values at that position.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
IEEE_DIV = "--xla_backend_extra_options=-nvptx-prec-divf32=2"
FLAG_SETS = {
    "import_default": "",  # jaxrl_fp8's import adds IEEE_DIV and --xla_allow_excess_precision=false
    "excess_precision_true": f"{IEEE_DIV} --xla_allow_excess_precision=true",
    "div_full": "--xla_backend_extra_options=-nvptx-prec-divf32=1 --xla_allow_excess_precision=false",
    # Hypothesis (decision record 0001): the remaining differences come from the
    # Triton-emitted reduction fusions (XLA's "softmax" matcher catches amax -> broadcast -> divide), which
    # lower float32 division themselves. This set keeps those patterns in XLA's own emitters.
    "no_triton_fusions": f"{IEEE_DIV} --xla_allow_excess_precision=false --xla_gpu_enable_triton_softmax_fusion=false "
                         "--xla_gpu_experimental_enable_triton_softmax_priority_fusion=false",
}


# ------------------------------------------------------------------------------------------------ child side


def _inputs(quick: bool):
    import numpy as np

    rng = np.random.default_rng(0)
    out = {}
    # 1. the input of experiments/checks/gpu_division.py (same generator state: it first draws 2 x 2^22 values)
    rng.random(1 << 22), rng.random(1 << 22)
    rows = 1024 if quick else 4096
    out["gpu_division_4096x1024"] = (rng.standard_normal((rows, 1024)) * np.exp2(rng.integers(-10, 10, (rows, 1)))).astype(np.float32)
    # 2. normals at many scales, one scale per row, 1e-6 .. 1e4
    out["normal_multiscale"] = (rng.standard_normal((512, 256)) * np.exp(rng.uniform(np.log(1e-6), np.log(1e4), (512, 1)))).astype(np.float32)
    # 3. subnormal-heavy: float32 subnormals, tiny normals, some rows mixed with 1.0
    sub = rng.integers(1, 1 << 23, (256, 128)).astype(np.uint32).view(np.float32) * rng.choice([-1, 1], (256, 128)).astype(np.float32)
    sub[:64] *= np.float32(2.0**20)  # tiny normals
    sub[64:128, ::16] = 1.0  # big value next to subnormals in each block
    out["subnormal_heavy"] = sub.astype(np.float32)
    # 4. exact E2M1 midpoints: with global amax 2688, g = 1 and d = bs exactly; block amax 6*bs
    mids = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], np.float32)
    bss = np.array([2.0**-9, 3 * 2.0**-9, 2.0**-6, 0.5, 1.0, 1.5, 2.0, 3.25, 64.0, 448.0], np.float32)
    blocks = []
    for bs in bss:
        for sign in (1, -1):
            blk = np.concatenate([mids, -mids, [6.0, 0.0]]).astype(np.float32) * sign
            blocks.append(blk * bs)
    out["e2m1_ties"] = np.stack(blocks).reshape(len(blocks), 16).astype(np.float32)
    # 5. zeros and nonfinite blocks
    z = rng.standard_normal((64, 64)).astype(np.float32)
    z[::2] = 0.0
    z[1, :16] = -0.0
    out["zeros"] = z
    nf = rng.standard_normal((64, 64)).astype(np.float32)
    nf[0, 3], nf[1, 17], nf[2, 40], nf[3, :16] = np.inf, -np.inf, np.nan, np.nan
    nf[4, 5], nf[4, 6] = np.inf, -np.inf
    out["nonfinite"] = nf
    # 6. the benchmark's float32 case pattern (rows scaled 2^-8 .. 2^7), smaller
    out["bench_f32_pattern"] = (rng.standard_normal((1024, 1024)) * np.exp2(rng.integers(-8, 8, (1024, 1)))).astype(np.float32)
    # 7. tests/converters/test_gpu_bitwise.py's stress tensor (its own generator): rows 1e-6 .. 1e3, a zero row, partial
    # blocks. On the H200 its jitted FP8 block quantization differs from the CPU in 213 of 549,120 codes (the 8
    # printed at or next to e4m3 ties), while the division and the cast alone, each jitted on the GPU, agree.
    srng = np.random.default_rng(0)
    stress = srng.standard_normal((520, 1056)).astype(np.float32) * np.exp(srng.uniform(np.log(1e-6), np.log(1e3), (520, 1))).astype(np.float32)
    stress[7] = 0
    out["converter_stress"] = stress
    return out


def _stages(variant: str, global_amax_mode: str):
    """The NVFP4 chain returning every intermediate (one jit)."""
    import jax.numpy as jnp
    from jax import lax

    from jaxrl_fp8.precision import nvfp4 as NV
    from jaxrl_fp8.precision.arith import F32, block_amax, fp8_to_f32, ieee_div

    def fn(x):
        x = x.astype(F32)
        if global_amax_mode == "tensor":
            amax = NV.nvfp4_global_amax(x)
        elif global_amax_mode == "given4":
            amax = jnp.asarray(4.0, F32)
        elif global_amax_mode == "given2688":
            amax = jnp.asarray(2688.0, F32)
        else:  # per_row
            amax = NV.nvfp4_global_amax(x, per_row=True)
        g = ieee_div(jnp.maximum(amax, F32(1e-10)), 6.0 * 448.0)
        xb = x.reshape(*x.shape[:-1], -1, 16)
        bamax = block_amax(xb, -1, 0.0)
        gb = jnp.broadcast_to(jnp.reshape(g, g.shape + (1,) * (bamax.ndim - g.ndim)), bamax.shape)
        div = (lambda a, b: a / b) if variant == "plain_div" else ieee_div
        t6 = div(bamax, 6.0)
        tg = div(t6, gb)
        tcl = jnp.minimum(tg, F32(448.0))
        bs = tcl.astype(jnp.float8_e4m3fn)
        if variant == "astype":
            bsf = bs.astype(F32)
        elif variant == "barrier":
            bsf = lax.optimization_barrier(bs).astype(F32)
        else:
            bsf = fp8_to_f32(bs)
        d = bsf * gb
        ok = d > 0
        y = div(xb, jnp.where(ok, d, 1.0)[..., None])
        yc = jnp.where(ok[..., None], jnp.clip(y, -6.0, 6.0), 0.0)
        codes = NV.e2m1_codes(yc)
        packed = NV.pack_nibbles(codes.reshape(*x.shape[:-1], -1))
        return {"global_amax": amax, "g": g, "block_amax": bamax, "amax_div6": t6, "div_g": tg, "clamped": tcl,
                "bs_e4m3": bs, "bs_f32": bsf, "d": d, "x_div_d": y, "clipped": yc, "codes": codes, "packed": packed}

    return fn


STAGE_ORDER = ["global_amax", "g", "block_amax", "amax_div6", "div_g", "clamped", "bs_e4m3", "bs_f32", "d", "x_div_d",
               "clipped", "codes", "packed"]


def _bits(a):
    import numpy as np

    a = np.asarray(a)
    if a.dtype.itemsize == 1:
        return a.view(np.uint8)
    return a.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])


def _hex(a, idx):
    import numpy as np

    b = _bits(a).reshape(-1)
    if idx >= b.size:
        return None
    v = np.asarray(a).reshape(-1)[idx]
    return f"0x{int(b[idx]):0{2 * np.asarray(a).dtype.itemsize}x} ({float(np.asarray(v, np.float64)) if np.asarray(a).dtype.kind == 'f' or 'float8' in str(np.asarray(a).dtype) else int(v)})"


def _compare(dev, cpu, context=None, max_examples=4):
    """Bitwise comparison of two host arrays (any shape); NaN-vs-NaN with other bits reported apart."""
    import numpy as np

    dev, cpu = np.asarray(dev), np.asarray(cpu)
    if dev.shape != cpu.shape or dev.dtype != cpu.dtype:
        return {"differ": -1, "note": f"shape/dtype {dev.shape} {dev.dtype} vs {cpu.shape} {cpu.dtype}"}
    bd, bc = _bits(dev).reshape(-1), _bits(cpu).reshape(-1)
    bad = np.flatnonzero(bd != bc)
    nan_only = 0
    if dev.dtype.kind == "f" or "float8" in str(dev.dtype):
        fd, fc = dev.astype(np.float32).reshape(-1), cpu.astype(np.float32).reshape(-1)
        nan_only = int((np.isnan(fd[bad]) & np.isnan(fc[bad])).sum())
    out = {"n": int(bd.size), "differ": int(bad.size), "differ_nan_vs_nan": nan_only}
    ex = []
    for i in bad[:max_examples]:
        e = {"flat_index": int(i), "device": _hex(dev, int(i)), "cpu": _hex(cpu, int(i))}
        if context is not None:
            e.update(context(int(i)))
        ex.append(e)
    if ex:
        out["examples"] = ex
    return out


def _block_context(cpu_stages, dev_stages, x, shape_kind):
    """For a differing element of a per-value / per-block / per-byte stage: the block's upstream values."""
    import numpy as np

    k = x.shape[-1]
    nb = -(-k // 16)

    def ctx(i, kind):
        row, col = divmod(i, {"value": k, "block": nb, "byte": k // 2}[kind])
        blk = {"value": col // 16, "block": col, "byte": (2 * col) // 16}[kind]
        out = {"row": int(row), "block": int(blk)}
        for s in ("block_amax", "div_g", "bs_e4m3", "bs_f32", "d"):
            out[s] = {"device": _hex(dev_stages[s][row], blk), "cpu": _hex(cpu_stages[s][row], blk)}
        xs = np.asarray(x[row, blk * 16:(blk + 1) * 16], np.float32)
        out["x_block_hex"] = [f"0x{int(v):08x}" for v in xs.view(np.uint32)]
        return out

    return lambda kind: (lambda i: ctx(i, kind))


def _run_stages(inputs, dev, cpu, quick, sink):
    import jax
    import numpy as np

    kinds = {"block_amax": "block", "amax_div6": "block", "div_g": "block", "clamped": "block", "bs_e4m3": "block",
             "bs_f32": "block", "d": "block", "x_div_d": "value", "clipped": "value", "codes": "value", "packed": "byte"}
    results = {}
    jitted = {}
    for name, x in inputs.items():
        modes = ["given2688"] if name == "e2m1_ties" else ["tensor"]
        if name in ("gpu_division_4096x1024", "bench_f32_pattern") and not quick:
            modes += ["given4", "per_row"]
        for mode in modes:
            for variant in ("astype", "bits", "barrier", "plain_div"):
                fn = jitted.setdefault((variant, mode), jax.jit(_stages(variant, mode)))
                c = jax.device_get(fn(jax.device_put(x, cpu)))
                d = jax.device_get(fn(jax.device_put(x, dev)))
                ctxs = _block_context(c, d, x, None)
                stage_res, first = {}, None
                for s in STAGE_ORDER:
                    dd, cc = np.asarray(d[s]), np.asarray(c[s])
                    if dd.ndim >= 2:
                        dd, cc = dd.reshape(x.shape[0], -1), cc.reshape(x.shape[0], -1)
                    r = _compare(dd, cc, ctxs(kinds[s]) if s in kinds else None)
                    stage_res[s] = r
                    if first is None and r.get("differ", 0) != 0:
                        first = s
                results[f"{name}|{mode}|{variant}"] = {"first_diverging_stage": first, "stages": stage_res}
        sink("stages", results)
    return results


def _final_fns():
    from jaxrl_fp8 import precision as P

    return {
        "quantize_nvfp4": lambda x: P.quantize_nvfp4(x),
        "quantize_nvfp4_given4": lambda x: P.quantize_nvfp4(x, global_amax=4.0),
        "quantize_nvfp4_per_row": lambda x: P.quantize_nvfp4(x, global_amax=P.nvfp4_global_amax(x, per_row=True)),
        "quantize_nvfp4_four_over_six": lambda x: P.quantize_nvfp4(x, four_over_six=True),
        "qdq_nvfp4": lambda x: P.quantize_dequantize_activation(x, "nvfp4"),
        "qdq_fp8": lambda x: P.quantize_dequantize_activation(x, "fp8-block"),
        "qdq_mxfp8": lambda x: P.quantize_dequantize_activation(x, "mxfp8"),
        "fp8_per_block": lambda x: P.quantize_fp8_per_block(x),
        "fp8_per_token_group": lambda x: P.quantize_fp8_per_token_group(x),
        "mxfp8": lambda x: P.quantize_mxfp8(x),
    }


def _run_finals(inputs, dev, cpu, quick, sink):
    import jax
    import jax.numpy as jnp
    import numpy as np

    fns = {k: jax.jit(v) for k, v in _final_fns().items()}

    def both(fn, x):
        c = jax.device_get(fn(jax.device_put(x, cpu)))
        d = jax.device_get(fn(jax.device_put(x, dev)))
        c, d = (c if isinstance(c, tuple) else (c,)), (d if isinstance(d, tuple) else (d,))
        return [_compare(a, b) for a, b in zip(d, c)]

    res = {}
    picks = [("gpu_division_4096x1024", "float32"), ("gpu_division_4096x1024", "bfloat16"), ("nonfinite", "float32"),
             ("subnormal_heavy", "float32"), ("zeros", "bfloat16"), ("normal_multiscale", "bfloat16"),
             ("converter_stress", "bfloat16")]
    for name, dt in picks:
        xx = np.asarray(jnp.asarray(inputs[name]).astype(dt))
        for fname, fn in fns.items():
            res[f"{name}|{dt}|{fname}"] = both(fn, xx)
        sink("finals", res)
    # small tensors like the converter test's tiny checkpoints (22/95 tensors' FP8 block scales differed on the GPU)
    rng = np.random.default_rng(1)
    for shape in [(160, 160), (96, 160), (8, 96, 160), (16, 64), (3, 7)]:
        for scale in (0.02, 300.0):
            w = np.asarray(jnp.asarray(rng.standard_normal(shape) * scale, jnp.float32).astype(jnp.bfloat16))
            for fname in ("fp8_per_block", "fp8_per_token_group", "mxfp8", "quantize_nvfp4"):
                res[f"small{shape}x{scale}|bfloat16|{fname}"] = both(fns[fname], w)
        sink("finals", res)
    return res


def _compile_named(dev):
    """Compile a few named functions on the device so the dump holds their optimized HLO and PTX."""
    import jax
    import jax.numpy as jnp

    fns = _final_fns()

    def diag_nvfp4_contract(x):
        return fns["quantize_nvfp4"](x)

    def diag_nvfp4_old_astype(x):
        return _stages("astype", "tensor")(x)["packed"]

    def diag_fp8_block_small(x):
        return fns["fp8_per_block"](x)

    def diag_qdq_fp8(x):
        return fns["qdq_fp8"](x)

    for f, shape in ((diag_nvfp4_contract, (256, 256)), (diag_nvfp4_old_astype, (256, 256)),
                     (diag_fp8_block_small, (160, 160)), (diag_qdq_fp8, (64, 256))):
        jax.block_until_ready(jax.jit(f)(jax.device_put(jnp.ones(shape, jnp.bfloat16), dev)))


def _compiled_summary(dump_dir: Path) -> dict:
    """Counts of the interesting ops in XLA's dumped optimized HLO and PTX of the diag_* functions."""
    out = {}
    pats_ptx = {k: re.compile(v) for k, v in {
        "div.rn.f32": r"\bdiv\.rn\.f32\b", "div.full.f32": r"\bdiv\.full\.f32\b", "div.approx": r"\bdiv\.approx[\w.]*\b",
        "rcp": r"\brcp\.[\w.]+", "fma.rn.f32": r"\bfma\.rn[\w.]*\.f32\b", "cvt_e4m3x2_f32": r"\bcvt\.rn\.satfinite\.e4m3x2\.f32\b",
        "cvt_f16x2_e4m3x2": r"\bcvt\.rn\.f16x2\.e4m3x2\b", "ex2/lg2": r"\b(?:ex2|lg2)\.", "max.NaN": r"\bmax\.NaN\b",
        "ftz": r"\.ftz\b"}.items()}
    pats_hlo = {k: re.compile(v) for k, v in {
        "convert_to_f8": r"f8e4m3fn\[[^\]]*\][^=]*convert\(", "convert_f8_to_f32": r"= f32\[[^\]]*\][^ ]* convert\(f8e4m3fn",
        "triton_or_custom_fusions": r"__triton|kind=kCustom", "divide": r" divide\(", "opt_barrier": r"opt-barrier",
        "fusions": r" fusion\("}.items()}
    for f in sorted(dump_dir.glob("*diag_*")):
        name = f.name
        if not (name.endswith(".ptx") or name.endswith("after_optimizations.txt")):
            continue
        text = f.read_text(errors="replace")
        pats = pats_ptx if name.endswith(".ptx") else pats_hlo
        out[name[:120]] = {k: len(p.findall(text)) for k, p in pats.items()}
    return out or {"note": f"no diag_* *.ptx / *after_optimizations.txt in the dump ({len(list(dump_dir.glob('*')))} files)"}


def child(mode_name: str, quick: bool, dump_dir: str | None, partial: Path) -> dict:
    import jax

    import jaxrl_fp8  # noqa: F401  (sets XLA_FLAGS as every entry point does, when not already set)

    dev = jax.devices()[0]
    cpu = jax.devices("cpu")[0]
    t0 = time.time()
    info = {"flag_set": mode_name, "XLA_FLAGS": os.environ.get("XLA_FLAGS", ""), "device": dev.device_kind,
            "platform": dev.platform, "jax": jax.__version__}

    def sink(key, value):  # partial results survive a timeout
        info[key] = value
        info["seconds"] = time.time() - t0
        partial.write_text(json.dumps(info))

    inputs = _inputs(quick)
    _run_stages(inputs, dev, cpu, quick, sink)
    _run_finals(inputs, dev, cpu, quick, sink)
    if dump_dir:
        _compile_named(dev)
        sink("compiled", _compiled_summary(Path(dump_dir)))
    sink("done", True)
    return info


# ----------------------------------------------------------------------------------------------- parent side


def _summary(res: dict) -> dict:
    """Per flag set: which variants make every stage equal, where each first differs, which finals differ."""
    out = {}
    for flag, r in res.items():
        s = {"error": r["error"][-600:]} if "error" in r else {}
        by_variant = {}
        for key, v in r.get("stages", {}).items():
            name, mode, variant = key.split("|")
            by_variant.setdefault(variant, {})[f"{name}|{mode}"] = v["first_diverging_stage"]
        s["variants_all_stages_equal"] = {k: all(f is None for f in v.values()) for k, v in by_variant.items()}
        s["first_diverging_stage"] = {k: {i: f for i, f in v.items() if f} for k, v in by_variant.items()}
        s["finals_differing"] = {k: [c.get("differ") for c in v] for k, v in r.get("finals", {}).items()
                                 if any(c.get("differ", 0) != 0 for c in v)}
        s["finals_compared"] = len(r.get("finals", {}))
        s["seconds"] = r.get("seconds")
        out[flag] = s
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="directory for nvfp4_gpu_diag.json")
    ap.add_argument("--quick", action="store_true", help="smaller inputs, tensor global amax only")
    ap.add_argument("--flag-sets", default=",".join(FLAG_SETS), help=f"comma list of {', '.join(FLAG_SETS)}")
    ap.add_argument("--timeout", type=float, default=150.0, help="seconds per child (children run in parallel)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--dump", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.child:
        child(args.child, args.quick, args.dump, args.out / f"child_{args.child}.json")
        return
    procs = {}
    t0 = time.time()
    for name in args.flag_sets.split(","):
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), str(ROOT), env.get("PYTHONPATH", "")) if p)
        env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"  # the children share one GPU
        dump = tempfile.mkdtemp(prefix=f"xla_dump_{name}_")
        extra = f"--xla_dump_to={dump} --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*diag_.*"
        env["XLA_FLAGS"] = " ".join(f for f in (env.get("XLA_FLAGS", ""), FLAG_SETS[name], extra) if f).strip()
        partial = args.out / f"child_{name}.json"
        partial.unlink(missing_ok=True)
        cmd = [sys.executable, __file__, "--child", name, "--dump", dump, "--out", str(args.out)] + (["--quick"] if args.quick else [])
        log = open(args.out / f"child_{name}.log", "w")
        procs[name] = (subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), partial, log)
    results = {}
    for name, (p, partial, log) in procs.items():
        try:
            p.wait(timeout=max(1.0, args.timeout - (time.time() - t0)))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        log.close()
        r = json.loads(partial.read_text()) if partial.exists() else {}
        if p.returncode != 0 or not r.get("done"):
            tail = (args.out / f"child_{name}.log").read_text(errors="replace")[-3000:]
            r["error"] = f"rc={p.returncode} (partial results kept): {tail}"
        results[name] = r
        print(f"{name}: rc={p.returncode} done={r.get('done', False)} {r.get('seconds', 0):.0f}s", flush=True)
    out = {"summary": _summary(results), "results": results}
    (args.out / "nvfp4_gpu_diag.json").write_text(json.dumps(out, indent=1))
    print(json.dumps(out["summary"], indent=1))


if __name__ == "__main__":
    main()
