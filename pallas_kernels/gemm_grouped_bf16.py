"""Grouped (MoE) BF16 GEMM for Hopper: y[r] = x[r] . B[g(r)] for expert-sorted rows, float32 accumulation.

The BF16 counterpart of `gemm_grouped` (same in-place ragged tiling, work list and masked stores; no block
scales). It exists because XLA:GPU has no fast grouped GEMM: `lax.ragged_dot` runs at ~49 TFLOP/s on the H200
and the XLA grouped path of `jaxrl_fp8.ops` is a scan of ceil(M/128)+E small dots (thousands of launches per
decode step). Every BF16 MoE GEMM on Hopper — BF16 recipes, the emulated MXFP8/NVFP4 formats (dequantized to
BF16) and the BF16 backward — goes through this kernel, so the rollout engine and the trainer still share one
arithmetic.

Two weight layouts, both read in place (no transposed copy of the weights):
  "nk": w [E, O, C] (HF [out, in]): y = x . w[g]^T  — the forward projection (B tiles are K-major).
  "kn": w [E, C, O]:                 y = x . w[g]    — the data gradient through the same weights.
x is [M, C]. C must be a multiple of 64 (one 128-byte swizzled K tile), O a multiple of tile_n.

Row invariance: a row's accumulator sums the same K tiles in the same order whatever block it lands in
(wgmma computes rows independently), so its result depends only on the row and its expert.
Persistent, with one TMA ring per SM across all its tiles (`gemm_grouped.grouped_ring`, as the FP8 kernel).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.gemm_dense import F32, launch_persistent
from pallas_kernels import tma_ring
from pallas_kernels.gemm_grouped import grouped_ring, staging_smem, work_items
from pallas_kernels.kernel_cache import traced_once

TILE_K = 64  # 64 bf16 = 128 bytes: the widest swizzle
LAYOUTS = ("nk", "kn")


@dataclasses.dataclass(frozen=True)
class Bf16GroupedConfig:
    tile_m: int = 64  # rows per compute warpgroup; the CTA block is 2 * tile_m rows
    tile_n: int = 128
    max_concurrent_steps: int = 4
    grid_tile_width: int = 16
    grid_minor_dim: int = 0


def default_config(groups: int, rows: int) -> Bf16GroupedConfig:
    """The tiling `grouped_matmul` uses unless given one. Grouped (MoE) products keep `Bf16GroupedConfig()`. A dense
    product (one group) of at most 1024 rows - the decode step's lm_head and router, a prefill's - is latency-bound
    on its weight stream: it takes five stages, and a walk by row count, measured on the lm_head ([rows, 2048] x
    [151936, 2048]^T, H100, results/vocab_side_h100.json, against four stages in the band of 16):
      <= 128 rows (one CTA row block): the column tiles in order, 0.25 ms at 64 rows (0.31);
      <= 256 rows: bands of 2 column tiles, a weight tile's two row blocks together, 0.31 ms (0.42; cuBLAS 0.29);
      <= 1024 rows: the same bands, walked along the columns, 0.55 / 1.10 ms at 512 / 1024 (0.60 / 1.27).
    At 2048 rows the default band stays faster (2.10 ms against 2.20). A tiling never changes a row's K order, so
    every one gives the same bits (tested; on the GPU in the benchmark)."""
    cfg = Bf16GroupedConfig()
    if groups != 1 or rows > 1024:
        return cfg
    if rows <= 2 * cfg.tile_m:
        return dataclasses.replace(cfg, max_concurrent_steps=5, grid_minor_dim=1)
    return dataclasses.replace(cfg, max_concurrent_steps=5, grid_tile_width=2, grid_minor_dim=0 if rows <= 256 else 1)


def supports(out_width: int, contraction: int, cfg: Bf16GroupedConfig | None = None) -> bool:
    cfg = cfg or Bf16GroupedConfig()
    return out_width % cfg.tile_n == 0 and contraction % TILE_K == 0


def _transforms(dtype):
    itemsize = jnp.dtype(dtype).itemsize
    swizzle = plgpu.find_swizzle(TILE_K * itemsize * 8)
    return (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))


def tile_pipeline(cfg: Bf16GroupedConfig, k_iters, layout: str, dtype):
    """The per-output-tile routine of the BF16 kernels: (allocations(a, b), run(a_rows, b_rows, store, allocs)).

    a_rows [2*tile_m, C], b_rows [tile_n, C] ("nk") or [C, tile_n] ("kn"); store(acc, wg) writes one compute
    warpgroup's float32 [tile_m, tile_n] result. `k_iters` (64-wide K tiles) may be a traced value.
    """
    tm, tn = cfg.tile_m, cfg.tile_n
    transforms = _transforms(dtype)
    if layout == "nk":
        b_spec = plgpu.BlockSpec((tn, TILE_K), lambda s: (0, s), transforms=transforms)
    else:
        b_spec = plgpu.BlockSpec((TILE_K, tn), lambda s: (s, 0), transforms=transforms)

    def make(body, compute_context):
        return plgpu.emit_pipeline_warp_specialized(
            body,
            grid=(k_iters,),
            memory_registers=40,
            in_specs=[plgpu.BlockSpec((2 * tm, TILE_K), lambda s: (0, s), transforms=transforms), b_spec],
            wg_axis="wg",
            num_compute_wgs=2,
            max_concurrent_steps=cfg.max_concurrent_steps,
            compute_context=compute_context,
        )

    def allocations(a, b):
        ignore = lambda *_, **__: None
        return make(ignore, ignore).get_allocations(a, b)

    def run(a_rows, b_rows, store, allocs):
        wg = lax.axis_index("wg")
        rows = pl.ds(wg * tm, tm)

        def body(_, a_smem, b_smem, acc_ref):
            plgpu.wgmma(acc_ref, a_smem.at[rows], b_smem.transpose((1, 0)) if layout == "nk" else b_smem)
            plgpu.wgmma_wait(0)
            return acc_ref

        def compute_context(eval_pipeline):
            @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((tm, tn), F32))
            def _(acc_ref):
                eval_pipeline(acc_ref)
                store(acc_ref[...], wg)

        make(body, compute_context)(a_rows, b_rows, allocations=allocs)

    return allocations, run


def _kernel(items_gmem, a_gmem, b_gmem, o_gmem, *, cfg: Bf16GroupedConfig, layout: str):
    """`gemm_grouped.grouped_ring` with one ring step per 64-wide K tile (A rows, B); warpgroups 0 / 1 accumulate
    them into the tile's wgmma accumulator in K order (`tile_pipeline`'s arithmetic)."""
    tm, tn = cfg.tile_m, cfg.tile_n
    cta_m = 2 * tm
    stages = cfg.max_concurrent_steps
    transforms = _transforms(a_gmem.dtype)
    b_shape = (tn, TILE_K) if layout == "nk" else (TILE_K, tn)

    def scoped(a_smem, b_smem, out_smem, full, empty):
        def issue(g, blk, ni, kt, slot):
            rows, ns, ks = pl.ds(blk * cta_m, cta_m), pl.ds(ni * tn, tn), pl.ds(kt * TILE_K, TILE_K)
            plgpu.copy_gmem_to_smem(a_gmem.at[rows, ks], a_smem.at[slot], full.at[slot])
            b_src = b_gmem.at[g, ns, ks] if layout == "nk" else b_gmem.at[g, ks, ns]
            plgpu.copy_gmem_to_smem(b_src, b_smem.at[slot], full.at[slot])

        def run_tile(wg, n, it):
            rows = pl.ds(wg * tm, tm)

            def mma(acc_ref, slot):
                b = b_smem.at[slot]
                plgpu.wgmma(acc_ref, a_smem.at[slot, rows], b.transpose((1, 0)) if layout == "nk" else b)

            def scope(acc_ref):
                it_end = tma_ring.chained_steps(acc_ref, n, it, full=full, empty=empty, stages=stages, mma=mma)
                return acc_ref[...], it_end

            return pl.run_scoped(scope, plgpu.ACC((tm, tn), F32))

        grouped_ring(items_gmem, o_gmem, out_smem, empty, cfg=cfg, cta_m=cta_m, cta_n=tn, split="rows", stages=stages,
                     steps=a_gmem.shape[1] // TILE_K, issue=issue, run_tile=run_tile)

    pl.run_scoped(
        scoped,
        plgpu.SMEM((stages, cta_m, TILE_K), a_gmem.dtype, transforms=transforms),
        plgpu.SMEM((stages, *b_shape), b_gmem.dtype, transforms=transforms),
        staging_smem(cfg, o_gmem.dtype),
        *tma_ring.barriers(stages, loads_per_step=2),
        collective_axes="wg",
    )


@traced_once("layout", "out_dtype", "interpret", "config")
def grouped_matmul(x, w, group_sizes, *, layout: str = "nk", out_dtype=F32, interpret: bool = False, config: Bf16GroupedConfig | None = None):
    """x [M, C] bf16 rows sorted by group; w [E, O, C] ("nk") or [E, C, O] ("kn") bf16; -> [M, O].

    Rows past sum(group_sizes) come out as zeros; empty groups are allowed.
    """
    where = "gemm_grouped_bf16.grouped_matmul"
    if layout not in LAYOUTS:
        raise ValueError(f"{where}: layout must be one of {LAYOUTS}; got {layout!r}")
    if x.ndim != 2 or w.ndim != 3:
        raise ValueError(f"{where}: x must be [M, C] and w [E, ., .]; got {x.shape}, {w.shape}")
    if x.dtype != jnp.bfloat16 or w.dtype != jnp.bfloat16:
        raise ValueError(f"{where}: x and w must be bfloat16; got {x.dtype}, {w.dtype}")
    m, c = x.shape
    e = w.shape[0]
    o, wc = (w.shape[1], w.shape[2]) if layout == "nk" else (w.shape[2], w.shape[1])
    if wc != c:
        raise ValueError(f"{where}: x has C={c} but w {w.shape} (layout {layout!r}) contracts over {wc}")
    cfg = config or default_config(e, m)
    if not supports(o, c, cfg):
        raise ValueError(f"{where}: needs the output width a multiple of {cfg.tile_n} and C a multiple of {TILE_K}; got O={o}, C={c}")
    if cfg.max_concurrent_steps < 2:  # the ring keeps one step's buffer while the next step's wgmma is issued
        raise ValueError(f"{where}: max_concurrent_steps must be at least 2; got {cfg.max_concurrent_steps}")
    if group_sizes.shape != (e,):
        raise ValueError(f"{where}: group_sizes must be [{e}]; got {group_sizes.shape}")
    tile = 2 * cfg.tile_m
    items = work_items(group_sizes, m, tile)
    mp = -(-m // tile) * tile
    a = jnp.pad(x, [(0, mp - m), (0, 0)]) if mp != m else x
    kernel = functools.partial(_kernel, cfg=cfg, layout=layout)
    # one group: a dense product (ops.high_precision's split-BF16 form: router, lm_head, BF16 projections)
    name = f"gemm_{'dense' if e == 1 else 'grouped'}_bf16_{layout}"
    return launch_persistent(kernel, jax.ShapeDtypeStruct((m, o), out_dtype), items, a, w, name=name, interpret=interpret)
