"""What the GPU really runs: SASS instruction counts of our Pallas kernels (GEMMs and quantizers) on Hopper.

Mosaic GPU dumps each kernel's PTX (MOSAIC_GPU_DUMP_PTX, MOSAIC_GPU_DUMP_TO) but in this image not its SASS.
This script compiles every variant in a child process with the PTX dump on, assembles each dumped PTX for sm_90a
with `ptxas` and disassembles the cubin with `cuobjdump -sass` (or `nvdisasm`), taken from the CUDA toolkit,
the pip `nvidia-cuda-nvcc` wheel or Triton's bundled binaries, whichever is found first. It then counts
opcodes, so a claim like "the FP8 GEMM runs on QGMMA" or "the NVFP4 kernel spends N instructions per value" is
read off the machine code, not inferred from PTX.

    PYTHONPATH=src:. python3 experiments/benchmarks/sass.py --out experiments/benchmarks/results/sass_h200.json \
        [--variants dense_k2,nvfp4] [--keep DIR]

Counts are static (instructions in the kernel's code, not executed instructions): a loop body counts once.
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

VARIANTS = {
    # name -> what the child process compiles
    "dense_k1": "block-scaled FP8 dense GEMM, one K block per step, zeroed accumulators",
    "dense_k2": "block-scaled FP8 dense GEMM, two K blocks per step (8192^3 default), zeroed accumulators",
    "dense_k2_col": "as dense_k2 with per-column B scales (the wgrad GEMM's column mode)",
    "grouped": "block-scaled FP8 grouped (MoE) GEMM, default config for K=2048",
    "fp8_token_group": "FP8 per-token-group (1x128) activation quantizer, bf16 in",
    "mxfp8": "MXFP8 quantizer (v2), bf16 in",
    "nvfp4": "NVFP4 quantizer (v14, the default: 128-byte tile rows), bf16 in, given global amax",
    "nvfp4_f32": "NVFP4 quantizer (v14), float32 in, given global amax",
    "nvfp4_v12": "NVFP4 quantizer (v12, the fallback: one block per tile row), bf16 in, given global amax",
    "nvfp4_v12_f32": "NVFP4 quantizer (v12), float32 in, given global amax",
}

SASS_LINE = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Za-z0-9_]+)*)")


def _child(variant: str) -> None:
    """Compile and run one variant (the parent has set the dump environment)."""
    import jax
    import jax.numpy as jnp

    from jaxrl_fp8.precision.fp8 import quantize_fp8_per_block, quantize_fp8_per_token_group
    from pallas_kernels import gemm_dense, gemm_grouped, quantize

    C = gemm_dense.GemmConfig
    key = jax.random.key(0)
    if variant.startswith("dense"):
        kps = 2 if "k2" in variant else 1
        cfg = C(max_concurrent_steps=2 if kps == 2 else 4, k_blocks_per_step=kps)
        x = jax.random.normal(key, (1024, 1024), jnp.float32)
        xq, sa = quantize_fp8_per_token_group(x, 128)
        rows = 1 if variant.endswith("_col") else 128
        wq, sb = quantize_fp8_per_token_group(x, 128) if rows == 1 else quantize_fp8_per_block(x, (128, 128))
        y = gemm_dense.block_scaled_matmul(xq, sa, wq, sb, b_rows_per_scale=rows, config=cfg, out_dtype=jnp.bfloat16)
    elif variant == "grouped":
        x = jax.random.normal(key, (1024, 2048), jnp.float32)
        w = jax.random.normal(key, (4, 1536, 2048), jnp.float32)
        xq, sa = quantize_fp8_per_token_group(x, 128)
        wq, sb = quantize_fp8_per_block(w, (128, 128))
        y = gemm_grouped.grouped_block_scaled_matmul(xq, sa, wq, sb, jnp.asarray([300, 0, 500, 224], jnp.int32))
    else:
        dtype = jnp.float32 if variant.endswith("f32") else jnp.bfloat16
        impl = "v12" if "_v12" in variant else "v14"
        x = jax.random.normal(key, (4096, 4096), jnp.float32).astype(dtype)
        if variant == "fp8_token_group":
            y = quantize.fp8_per_token_group(x, 128)
        elif variant == "mxfp8":
            y = quantize.mxfp8(x)
        else:
            y = quantize.nvfp4(x, global_amax=4.0, impl=impl)
    jax.block_until_ready(y)
    print(f"child {variant}: ok", flush=True)


def find_tools() -> dict[str, str | None]:
    """ptxas / cuobjdump / nvdisasm: PATH, CUDA_HOME, the nvidia-cuda-nvcc wheel, Triton's bundle."""
    dirs = [os.environ.get("CUDA_HOME", "/usr/local/cuda") + "/bin"]
    for mod, sub in [("nvidia.cuda_nvcc", "bin"), ("triton", "backends/nvidia/bin")]:
        try:
            spec = importlib.util.find_spec(mod)
        except ImportError:  # its parent package is not installed here
            spec = None
        if spec is not None and spec.submodule_search_locations:
            dirs.append(str(Path(next(iter(spec.submodule_search_locations)), sub)))
    found = {}
    for tool in ("ptxas", "cuobjdump", "nvdisasm"):
        path = shutil.which(tool)
        for d in dirs:
            if path is None and Path(d, tool).exists():
                path = str(Path(d, tool))
        found[tool] = path
    return found


def count_opcodes(sass: str) -> dict:
    ops = collections.Counter()
    for line in sass.splitlines():
        m = SASS_LINE.search(line)
        if m:
            ops[m.group(1)] += 1
    base = collections.Counter()
    for op, c in ops.items():
        base[op.split(".")[0]] += c
    mma = {op: c for op, c in ops.items() if "GMMA" in op or op.startswith(("HMMA", "QMMA", "IMMA"))}
    return dict(total=sum(ops.values()), by_base=dict(base.most_common()), mma=mma)


def disassemble(ptx: Path, tools: dict, work: Path) -> tuple[str, str]:
    cubin = work / (ptx.stem + ".cubin")
    arch = "sm_90a"
    txt = ptx.read_text(errors="replace")
    m = re.search(r"^\.target\s+(\w+)", txt, flags=re.M)
    if m:
        arch = m.group(1)
    res = subprocess.run([tools["ptxas"], f"-arch={arch}", "-O3", "-v", str(ptx), "-o", str(cubin)], capture_output=True, text=True, timeout=300)
    info = (res.stdout + res.stderr).strip()
    if res.returncode:
        raise RuntimeError(f"ptxas failed on {ptx.name}: {info[-1500:]}")
    if tools.get("cuobjdump"):
        sass = subprocess.run([tools["cuobjdump"], "-sass", str(cubin)], capture_output=True, text=True, timeout=300).stdout
    else:
        sass = subprocess.run([tools["nvdisasm"], str(cubin)], capture_output=True, text=True, timeout=300).stdout
    return sass, info


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("experiments/benchmarks/results/sass_h200.json"), help="JSON summary")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of: {', '.join(VARIANTS)}")
    ap.add_argument("--keep", type=Path, default=None, help="also write each kernel's PTX and SASS text under this folder")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        _child(args.child)
        return 0
    variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        ap.error(f"--variants: unknown {unknown}; choose from {list(VARIANTS)}")
    tools = find_tools()
    print("tools:", tools, flush=True)
    if not tools["ptxas"] or not (tools["cuobjdump"] or tools["nvdisasm"]):
        print("no ptxas / cuobjdump / nvdisasm found: cannot produce SASS", file=sys.stderr)
    import jax

    results = dict(meta=dict(device=jax.devices()[0].device_kind, jax=jax.__version__, tools=tools, time=time.strftime("%Y-%m-%d %H:%M:%S"),
                             counts="static SASS instruction counts per kernel (loop bodies count once)"), kernels=[])
    for variant in variants:
        with tempfile.TemporaryDirectory() as tmp:
            dump = Path(tmp) / "dump"
            dump.mkdir()
            env = dict(os.environ, MOSAIC_GPU_DUMP_PTX="1", MOSAIC_GPU_DUMP_PTXAS="1", MOSAIC_GPU_DUMP_TO=str(dump))
            t0 = time.time()
            proc = subprocess.run([sys.executable, __file__, "--child", variant], env=env, capture_output=True, text=True, timeout=600)
            entry = dict(variant=variant, description=VARIANTS[variant], child_rc=proc.returncode, child_s=round(time.time() - t0, 1))
            if proc.returncode:
                entry["error"] = (proc.stdout + proc.stderr)[-2000:]
            entry["mosaic_ptxas_lines"] = [ln for ln in (proc.stdout + proc.stderr).splitlines() if "registers" in ln or "spill" in ln][:8]
            kernels = []
            for ptx in sorted(dump.rglob("*.ptx")):
                k = dict(file=ptx.name)
                if tools["ptxas"] and (tools["cuobjdump"] or tools["nvdisasm"]):
                    try:
                        sass, info = disassemble(ptx, tools, Path(tmp))
                        k.update(count_opcodes(sass))
                        k["ptxas"] = [ln for ln in info.splitlines() if "registers" in ln or "spill" in ln or "stack" in ln][:6]
                        if args.keep:
                            args.keep.mkdir(parents=True, exist_ok=True)
                            (args.keep / f"{variant}_{ptx.stem}.sass").write_text(sass)
                            shutil.copy(ptx, args.keep / f"{variant}_{ptx.name}")
                    except Exception as e:  # record and go on with the other kernels
                        k["error"] = f"{type(e).__name__}: {str(e)[:1500]}"
                kernels.append(k)
            entry["kernels"] = kernels
            entry["dumped_files"] = sorted(p.name for p in dump.rglob("*") if p.is_file())[:40]
            results["kernels"].append(entry)
            for k in kernels:
                top = ", ".join(f"{op} {c}" for op, c in list(k.get("by_base", {}).items())[:12])
                print(f"{variant:16s} {k['file'][:40]:40s} total {k.get('total', '-')}  mma {k.get('mma', {})}  {k.get('ptxas', '')}\n    {top}", flush=True)
            if not kernels:
                print(f"{variant}: no PTX dumped (rc {proc.returncode}); files: {entry['dumped_files'][:10]}", flush=True)
                if proc.returncode:
                    print(entry["error"][-800:], flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp_out = args.out.with_suffix(".tmp")
    tmp_out.write_text(json.dumps(results, indent=1))
    tmp_out.replace(args.out)
    print("wrote", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
