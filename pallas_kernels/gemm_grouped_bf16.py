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
Persistent, with one TMA ring per SM across all its tiles (`_kernel`, as `gemm_grouped`'s FP8 kernel).
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
from pallas_kernels.gemm_grouped import masked_store, staging_smem, walk_tile, work_items
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
    """One program per SM, three warpgroups, one TMA ring across all its tiles (as `gemm_grouped._grouped_kernel`):
    wg 2 streams each real tile's 64-wide K tiles of A rows and B through `max_concurrent_steps` buffers, wg 0 / 1
    accumulate them into the tile's wgmma accumulator in K order (`tile_pipeline`'s arithmetic), all walking the
    (work item, column tile) sequence of `gemm_grouped.walk_tile`; the next tile's loads stream during a tile's store."""
    tm, tn = cfg.tile_m, cfg.tile_n
    cta_m = 2 * tm
    stages = cfg.max_concurrent_steps
    k_tiles = a_gmem.shape[1] // TILE_K
    t_iters, n_iters = items_gmem.shape[1], o_gmem.shape[1] // tn
    transforms = _transforms(a_gmem.dtype)
    b_shape = (tn, TILE_K) if layout == "nk" else (TILE_K, tn)

    def scoped(a_smem, b_smem, out_smem, full, empty):
        wg = lax.axis_index("wg")

        @pl.when(wg == 2)
        def _memory():
            plgpu.set_max_registers(40, action="decrease")

            @plgpu.nd_loop((t_iters * n_iters,), collective_axes="sm", init_carry=jnp.int32(0))
            def issued(info, carry):
                g, blk, ni, _, size = walk_tile(items_gmem, info.index[0], n_iters, cfg)
                rows, ns = pl.ds(blk * cta_m, cta_m), pl.ds(ni * tn, tn)

                def step(kt, it):
                    slot = lax.rem(it, stages)

                    @pl.when(it >= stages)
                    def _():
                        plgpu.barrier_wait(empty.at[slot])  # both compute warpgroups are done with this buffer

                    ks = pl.ds(kt * TILE_K, TILE_K)
                    plgpu.copy_gmem_to_smem(a_gmem.at[rows, ks], a_smem.at[slot], full.at[slot])
                    b_src = b_gmem.at[g, ns, ks] if layout == "nk" else b_gmem.at[g, ks, ns]
                    plgpu.copy_gmem_to_smem(b_src, b_smem.at[slot], full.at[slot])
                    return it + 1

                return lax.fori_loop(0, jnp.where((size > 0) & (g >= 0), k_tiles, 0), step, carry)

            @pl.loop(jnp.maximum(issued - stages, 0), issued)
            def _(it):
                plgpu.barrier_wait(empty.at[lax.rem(it, stages)])

        @pl.when(wg < 2)
        def _compute():
            plgpu.set_max_registers(232, action="increase")
            rows = pl.ds(wg * tm, tm)

            @plgpu.nd_loop((t_iters * n_iters,), collective_axes="sm", init_carry=jnp.int32(0))
            def _tiles(info, carry):
                g, blk, ni, offset, size = walk_tile(items_gmem, info.index[0], n_iters, cfg)
                store = masked_store(o_gmem.at[pl.ds(blk * cta_m, cta_m), pl.ds(ni * tn, tn)], out_smem, tm, offset, size)
                steps = jnp.where((size > 0) & (g >= 0), k_tiles, 0)

                def scope(acc_ref):
                    def step(_, it):
                        slot = lax.rem(it, stages)
                        plgpu.barrier_wait(full.at[slot])
                        b = b_smem.at[slot]
                        plgpu.wgmma(acc_ref, a_smem.at[slot, rows], b.transpose((1, 0)) if layout == "nk" else b)
                        plgpu.wgmma_wait(0)
                        plgpu.barrier_arrive(empty.at[slot])
                        return it + 1

                    it = lax.fori_loop(0, steps, step, carry)
                    return acc_ref[...], it

                acc, carry = pl.run_scoped(scope, plgpu.ACC((tm, tn), F32))

                @pl.when(size > 0)
                def _():
                    store(acc, wg)  # the tail's items store their zeros

                return carry

            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    pl.run_scoped(
        scoped,
        plgpu.SMEM((stages, cta_m, TILE_K), a_gmem.dtype, transforms=transforms),
        plgpu.SMEM((stages, *b_shape), b_gmem.dtype, transforms=transforms),
        staging_smem(cfg, o_gmem.dtype),
        plgpu.Barrier(num_arrivals=2, num_barriers=stages),
        plgpu.Barrier(num_arrivals=2, num_barriers=stages),
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
    cfg = config or Bf16GroupedConfig()
    if not supports(o, c, cfg):
        raise ValueError(f"{where}: needs the output width a multiple of {cfg.tile_n} and C a multiple of {TILE_K}; got O={o}, C={c}")
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
