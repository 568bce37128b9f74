"""How fast could the NVFP4 kernel be with its tiling? The pipeline alone against the real kernel, GPU time (CUPTI).

    PYTHONPATH=src:. python experiments/benchmarks/nvfp4_floor.py --out results/nvfp4_floor_h200.json

For each tiling (TileConfig) on the 256 MiB bfloat16 input of the benchmark (and one float32 one):
  - `kernel`: quantize_nvfp4 (impl v12 unless named) - its GPU time, and its output compared bit for bit with the
    default config's output (which `quantize.py` checks against the contract);
  - `pipeline`: the same persistent kernel (same tiles, TMA loads and stores, schedule, SMEM) whose body only moves
    each row's bytes (the row's registers XORed into its 8 packed bytes and its scale byte): no quantization math.
    It always loads [rows, 16] tiles (v12's 32-byte rows for bfloat16), also on the rows of a v14 config;
  - `elementwise`: XLA's x * 2 moving the same bytes per call (the device-time anchor of quantize.py).
If `pipeline` is far below `elementwise`, the tiling (not the math) is what a faster kernel must change; if
`kernel` is far below `pipeline`, the per-value instructions are. GPU time only: wall clock is quantize.py's job.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import statistics
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, memref, vector

sys.path.insert(0, str(Path(__file__).parent))
import quantize as QB  # noqa: E402  (the benchmark's input, device_time and bit helpers)
import timing  # noqa: E402

from pallas_kernels import quantize as Q  # noqa: E402
from pallas_kernels.scalar_ops import MlirOps  # noqa: E402
from pallas_kernels.tile_schedules import persistent_kernel  # noqa: E402
from pallas_kernels.tiling import row_layout, swizzle_transforms, tile_rows, TileConfig  # noqa: E402
from pallas_kernels import quantize_nvfp4 as N  # noqa: E402

BLOCK = 16


def _pipeline_body(t, x_ref, *out_refs, in_dtype, outputs):
    """Per thread and row: load the row (the kernel's layout), XOR its 16-byte vectors, store 8 bytes + 1 byte (only
    the `outputs` the probe streams; with none the body is empty: the TMA loads alone)."""
    del t
    if not outputs:
        return
    layout = row_layout(BLOCK, in_dtype)
    refs = dict(zip(outputs, out_refs))

    @plgpu.inline_mgpu(arg_types=(layout,) + (plgpu.RefType(),) * len(outputs), return_type=None)
    def body(ctx, x, *out):
        del ctx
        o = MlirOps()
        index = ir.IndexType.get()
        regs = x.registers
        named = dict(zip(outputs, out))
        n_rows, n_vec = regs.shape[0], regs.shape[-2]
        rows = [idx[0] for idx, _ in zip(x.layout.thread_idxs(x.shape), range(regs.size))]
        for j in range(n_rows):
            words = None
            for k in range(n_vec):
                w4 = vector.bitcast(ir.VectorType.get((4,), o.i32), regs[(j, 0, 0, 0, 0, k, 0)])
                ws = [vector.extract(w4, dynamic_position=[], static_position=ir.DenseI64ArrayAttr.get([i]))
                      for i in range(4)]
                ws = [arith.xori(ws[0], ws[2]), arith.xori(ws[1], ws[3])]
                words = ws if words is None else [arith.xori(a, b) for a, b in zip(words, ws)]
            row = rows[j * n_vec]
            if "packed" in named:
                vec8 = vector.bitcast(ir.VectorType.get((8,), o.i8),
                                      vector.from_elements(ir.VectorType.get((2,), o.i32), words))
                vector.store(vec8, named["packed"], [arith.muli(row, arith.constant(index, BLOCK // 2))])
            if "bs" in named:
                memref.store(arith.trunci(o.i8, words[0]), named["bs"], [row])

    body(plgpu.load(x_ref, layout=layout), *(refs[k] for k in outputs))


def pipeline_only(x, cfg: TileConfig, outputs=("packed", "bs")):
    """The NVFP4 kernel's persistent pipeline with a data-moving body (not a quantizer: its bytes mean nothing).
    outputs: which of the kernel's two streamed outputs the probe keeps (fewer: what the others cost)."""
    r = math.prod(x.shape) // BLOCK
    tr = tile_rows(cfg, BLOCK)
    half = BLOCK // 2
    shapes = {"packed": (r * half, tr * half), "bs": (r, tr)}
    call = persistent_kernel(
        functools.partial(_pipeline_body, in_dtype=jnp.dtype(x.dtype), outputs=tuple(outputs)),
        name="nvfp4_pipeline_only",
        out_shapes=[jax.ShapeDtypeStruct((shapes[k][0],), jnp.uint8) for k in outputs],
        in_tiles=[((tr, BLOCK), x.dtype, swizzle_transforms(BLOCK, x.dtype), lambda gm, t: gm.at[pl_ds(t * tr, tr)])],
        out_tiles=[((shapes[k][1],), jnp.uint8, (), lambda gm, t, n=shapes[k][1]: gm.at[pl_ds(t * n, n)])
                   for k in outputs],
        ntiles=-(-r // tr), cfg=cfg, interpret=False,
        extra_out=[] if outputs else [jax.ShapeDtypeStruct((16,), jnp.float32)])
    return call(x.reshape(r, BLOCK))


def _bits(a):
    """Integer view of an output (float8 NaN != NaN under array_equal; bits are what the contract fixes)."""
    return jax.lax.bitcast_convert_type(a, {1: jnp.uint8, 4: jnp.uint32}[a.dtype.itemsize])


def pl_ds(start, size):
    from jax.experimental import pallas as pl  # noqa: PLC0415

    return pl.ds(start, size)


def configs(dtype):
    T, dyn = TileConfig, (lambda **k: TileConfig(schedule="dynamic", **k))
    base = [(N.default_tiles(dtype), "v12")]
    if dtype == jnp.float32:
        return base + [(T(rows=768, ctas_per_sm=3), "v14"), (dyn(rows=1024, stages=3, ctas_per_sm=1), "v14")]
    return base + [
        (dyn(rows=1024), "v14"), (T(rows=1024), "v14"),
        (dyn(rows=1024, stages=3, ctas_per_sm=1), "v14"), (dyn(rows=512, ctas_per_sm=3), "v14"),
        (dyn(rows=512, ctas_per_sm=4), "v14"), (dyn(rows=1024, stages=3, ctas_per_sm=1), "v12"),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("experiments/benchmarks/results/nvfp4_floor_h200.json"))
    ap.add_argument("--iterations", type=int, default=30, help="CUPTI-timed calls per measurement (median)")
    args = ap.parse_args()
    if jax.devices()[0].platform != "gpu":
        raise SystemExit("nvfp4_floor.py needs a GPU (Mosaic GPU kernels with inline code; no interpret mode)")
    rows = []
    for shape, dtype in (((32768, 4096), jnp.bfloat16), ((8192, 8192), jnp.float32)):
        x = QB.random_input(shape, dtype)
        ref = None
        for cfg, impl in configs(dtype):
            row = {"shape": list(shape), "in_dtype": jnp.dtype(dtype).name, "config": QB.config_dict((cfg, impl))}
            fn = jax.jit(lambda a, cfg=cfg, impl=impl: Q.nvfp4(a, global_amax=4.0, config=cfg, impl=impl))
            moved = QB.nbytes(x) + x.size // 2 + x.size // BLOCK  # x read, packed codes and scale bytes written
            try:
                out = jax.block_until_ready(fn(x))
                if ref is None:
                    ref = out
                row["same_bits_as_default"] = all(bool(jnp.array_equal(_bits(a), _bits(b))) for a, b in zip(out, ref))
                del out
                row["kernel"] = QB.device_time(fn, x, iterations=args.iterations)
            except Exception as e:  # noqa: BLE001
                row["kernel"] = {"error": repr(e)[:400]}
            try:
                pfn = jax.jit(lambda a, cfg=cfg: pipeline_only(a, cfg))
                jax.block_until_ready(pfn(x))
                row["pipeline"] = QB.device_time(pfn, x, iterations=args.iterations)
            except Exception as e:  # noqa: BLE001
                row["pipeline"] = {"error": repr(e)[:400]}
            eq = jnp.ones((moved // 8,), jnp.float32)
            row["elementwise"] = QB.device_time(QB.xla_elementwise_x2, eq, iterations=args.iterations)
            del eq
            row["bytes_moved"] = moved
            for k in ("kernel", "pipeline", "elementwise"):
                if "main_ms" in row[k]:
                    row[f"{k}_GBps"] = moved / row[k]["main_ms"] / 1e6
            if "elementwise_GBps" in row:
                for k in ("kernel", "pipeline"):
                    if f"{k}_GBps" in row:
                        row[f"{k}_pct_of_elementwise"] = 100 * row[f"{k}_GBps"] / row["elementwise_GBps"]
            rows.append(row)
            print(f"{str(shape):14s} {row['in_dtype']:8s} {QB.config_tag(row):32s} kernel "
                  f"{row['kernel'].get('main_ms', float('nan')):.4f} ms {row.get('kernel_pct_of_elementwise', float('nan')):5.1f}%"
                  f"  pipeline {row['pipeline'].get('main_ms', float('nan')):.4f} ms "
                  f"{row.get('pipeline_pct_of_elementwise', float('nan')):5.1f}%  elementwise "
                  f"{row['elementwise'].get('main_ms', float('nan')):.4f} ms  same bits {row.get('same_bits_as_default')}"
                  + (f"  ERR {row['kernel'].get('error', '')[:200]} {row['pipeline'].get('error', '')[:200]}"
                     if "error" in row["kernel"] or "error" in row["pipeline"] else ""), flush=True)
            timing.write_results(str(args.out), {"device": jax.devices()[0].device_kind, "jax_version": jax.__version__,
                                                 "what": __doc__.strip().splitlines()[0], "rows": rows})
        if dtype == jnp.bfloat16:  # what each part of the pipeline costs: fewer outputs, none; float32 tiles of equal bytes
            cfg = N.default_tiles(dtype)
            probes = [("packed", ("packed",), x), ("none", (), x)]
            xf = jax.lax.bitcast_convert_type(x.reshape(-1, 2), jnp.float32).reshape(-1, BLOCK)  # same bytes, half the rows
            probes.append(("f32_view_r512", ("packed", "bs"), xf))
            for tag, outs, arg in probes:
                c = cfg if tag != "f32_view_r512" else dataclasses.replace(cfg, rows=512)
                try:
                    pfn = jax.jit(lambda a, c=c, outs=outs: pipeline_only(a, c, outs))
                    jax.block_until_ready(pfn(arg))
                    d = QB.device_time(pfn, arg, iterations=args.iterations)
                except Exception as e:  # noqa: BLE001
                    d = {"error": repr(e)[:400]}
                moved = QB.nbytes(arg) + (arg.size // 2 if "packed" in outs else 0) + (arg.size // BLOCK if "bs" in outs else 0)
                eq = jnp.ones((moved // 8,), jnp.float32)
                e = QB.device_time(QB.xla_elementwise_x2, eq, iterations=args.iterations)
                del eq
                probe = {"probe": tag, "outputs": list(outs), "config": QB.config_dict(c), "bytes_moved": moved,
                         "pipeline": d, "elementwise": e}
                if "main_ms" in d and "main_ms" in e:
                    probe["pipeline_pct_of_elementwise"] = 100 * e["main_ms"] / d["main_ms"]
                rows.append(probe)
                print(f"probe {tag:14s} outputs {outs}  pipeline {d.get('main_ms', float('nan')):.4f} ms  "
                      f"elementwise {e.get('main_ms', float('nan')):.4f} ms  "
                      f"{probe.get('pipeline_pct_of_elementwise', float('nan')):5.1f}%  {d.get('error', '')[:300]}", flush=True)
            timing.write_results(str(args.out), {"device": jax.devices()[0].device_kind, "jax_version": jax.__version__,
                                                 "what": __doc__.strip().splitlines()[0], "rows": rows})
        del x, ref


if __name__ == "__main__":
    main()
