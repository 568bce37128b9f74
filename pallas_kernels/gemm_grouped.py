"""Grouped (MoE) block-scaled FP8 GEMM for Hopper: y[r] = x[r] . w[g(r)]^T for expert-sorted rows.

Ragged tiling in place: rows stay where they are (no gather of x, no scatter of y). The row space is cut
into 2*tile_m-row blocks; a block that straddles a group boundary is computed once for each group that
owns rows in it, and each of those work items stores only its group's rows (a few power-of-two TMA
stores). There are at most ceil(M / tile) + E work items; the rows past sum(group_sizes) are one more
"group" whose work items store zeros without any MMA. The numerics (one wgmma per 128-wide K block,
promoted as acc += p * (sa * sb)) and the row invariance are the dense kernel's tile routine's: a row's
result depends only on that row and its expert, never on where the block boundaries fall. Unlike the dense
kernel, whose tiles are long (K / 128 blocks of a large GEMM), the grouped kernel keeps ONE TMA ring per SM
running across all its tiles (`grouped_ring` on `tma_ring`), so a decode step's many short tiles pay no pipeline fill
and drain each.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.gemm_dense import (
    BLOCK_K,
    F32,
    GemmConfig,
    _swizzle_transforms,
    a_scale_operand,
    b_scale_operand,
    check_operands,
    checked_scale_operand,
    launch_persistent,
    uses_row_scales,
    zero_acc,
)
from pallas_kernels import tma_ring
from pallas_kernels.kernel_cache import traced_once

# Rows of the work-item table (int32 [4, T]).
GROUP, BLOCK, OFFSET, SIZE = range(4)

# Four stages; K blocks in promotion chains of two (the first block promoted under the second one's wgmma) for
# every shape: on the Qwen3-30B-A3B MoE shapes (H100, results/gemm_chains_h100.json, one run) 865 / 777 TFLOP/s
# (gate_up / down) against 836 / 751 for one block at a time, chains of 4 and 8 1.02-2.0x slower. (On the per-tile
# pipeline this kernel had before the TMA ring, two blocks a step lost in two of three H200 runs.) The promotion
# order is the same, so the bits are too.
DEFAULT_CONFIG = GemmConfig(max_concurrent_steps=4, grid_tile_width=16, grid_minor_dim=0, k_blocks_per_step=2)
# Groups of a few rows (MoE decode: 64 rows x top-8 over 128 experts is 4 rows an expert): 64-row blocks, each
# compute warpgroup on its own 128 columns, so a CTA multiplies half the rows of a 128-row block for the same
# weight bytes. Three stages: 40 KB each (A 64 x 128 + B 256 x 128 e4m3) beside the float32 staging tile (64 KB).
# Same bits as DEFAULT_CONFIG (test_gemm_grouped); not yet measured on the H200 (`gemm.py --suites decode`).
NARROW_CONFIG = GemmConfig(max_concurrent_steps=3, grid_tile_width=16, grid_minor_dim=0, split="cols")


def work_items(group_sizes, m: int, tile: int):
    """The kernel's work list: int32 [4, ceil(m / tile) + E] of (group, block, offset, size).

    Item t computes row block `block` (rows block*tile ... +tile) with expert `group` and stores its rows
    [offset, offset + size) of that block; group == -1 stores zeros (rows past sum(group_sizes)); size == 0
    marks an unused item. Groups are consecutive row ranges in order; sizes are clipped to m.
    """
    e = group_sizes.shape[0]
    sizes = jnp.maximum(group_sizes.astype(jnp.int32), 0)
    ends = jnp.minimum(jnp.cumsum(sizes), m)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    starts = jnp.concatenate([starts, ends[-1:]])  # the zero-filled tail is group e
    ends = jnp.concatenate([ends, jnp.full((1,), m, jnp.int32)])
    first_block = starts // tile
    blocks = jnp.where(ends > starts, (ends - 1) // tile + 1 - first_block, 0)
    item_end = jnp.cumsum(blocks)
    item_begin = item_end - blocks
    t = jnp.arange(-(-m // tile) + e, dtype=jnp.int32)
    # every (item, group) comparison at once, one fusion: the default "scan" method is a while loop (log2(E) trips
    # of small kernels), which ran inside every decode step, once a layer (H200 HLO of the decode program)
    g = jnp.minimum(jnp.searchsorted(item_end, t, side="right", method="compare_all").astype(jnp.int32), e)
    used = t < item_end[-1]
    block = first_block[g] + t - item_begin[g]
    lo = jnp.maximum(starts[g], block * tile)
    hi = jnp.minimum(ends[g], block * tile + tile)
    size = jnp.where(used, hi - lo, 0)
    group = jnp.where(g < e, g, -1)
    return jnp.stack([group, jnp.where(used, block, 0), lo - block * tile, size])


def masked_store(out_rows, out_smem, tile_m: int, offset, size, split: str = "rows"):
    """Epilogue storing only rows [offset, offset + size) of a CTA's row block (power-of-two TMA stores).

    split "rows": the block is 2*tile_m rows, warpgroup w holds rows w*tile_m...; "cols": it is tile_m rows and
    warpgroup w holds its columns w*tile_n... (out_rows is then tile_m x 2*tile_n)."""
    tile_n = out_smem.shape[-1]

    def store(acc, wg):
        base = wg * tile_m if split == "rows" else 0
        dst = out_rows if split == "rows" else out_rows.at[:, pl.ds(wg * tile_n, tile_n)]
        lo = jnp.clip(offset - base, 0, tile_m)
        hi = jnp.clip(offset + size - base, 0, tile_m)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        out_smem[wg] = acc.astype(out_smem.dtype)
        plgpu.commit_smem()
        count, start = hi - lo, lo
        rows = tile_m
        while rows >= 1:

            @pl.when((count & rows) != 0)
            def _(rows=rows, start=start):
                plgpu.copy_smem_to_gmem(out_smem.at[wg, pl.ds(start, rows)], dst.at[pl.ds(base + start, rows)])

            start = start + (count & rows)
            rows //= 2

    return store


def staging_smem(cfg, dtype):
    """The epilogue's [2, tile_m, tile_n] staging tile for `masked_store`: unswizzled, so stores start at any row."""
    return plgpu.SMEM((2, cfg.tile_m, cfg.tile_n), dtype)


def walk_tile(items_gmem, index, n_iters: int, cfg):
    """Tile `index` of the grouped kernels' persistent walk over (work item, output column tile), the
    planar-snake order of `cfg` (grid_minor_dim, grid_tile_width): (group, row block, column tile, first row,
    row count). Group -1 is the tail past the groups (its tiles store zeros); count 0 marks an unused item."""
    t_iters = items_gmem.shape[1]
    ti, ni = plgpu.planar_snake(index, (t_iters, n_iters), cfg.grid_minor_dim, cfg.grid_tile_width)
    g, blk, offset, size = (items_gmem[f, ti] for f in (GROUP, BLOCK, OFFSET, SIZE))
    return g, blk, ni, offset, size


def grouped_ring(items_gmem, o_gmem, out_smem, empty, *, cfg, cta_m: int, cta_n: int, split: str, stages: int,
                 steps: int, issue, run_tile) -> None:
    """Both sides of a grouped kernel's `tma_ring` over the (work item, column tile) walk of `walk_tile`.

    Only tiles of a real group use the ring (`steps` ring steps each); the tail's items store zeros and unused
    items nothing. issue(g, blk, ni, step, slot) issues a step's TMA copies into buffer `slot`; run_tile(wg,
    steps, it) -> (acc, it) consumes a tile's steps from ring position `it` and returns warpgroup wg's float32
    [tile_m, tile_n] result, which `masked_store` writes (only the item's rows)."""
    n_iters = o_gmem.shape[1] // cta_n
    num_tiles = items_gmem.shape[1] * n_iters

    def tile_steps(g, size):
        return jnp.where((size > 0) & (g >= 0), steps, 0)

    def memory():
        def tile(index):
            g, blk, ni, _, size = walk_tile(items_gmem, index, n_iters, cfg)
            return tile_steps(g, size), lambda j, slot: issue(g, blk, ni, j, slot)

        tma_ring.produce(num_tiles, tile, stages=stages, empty=empty)

    def compute(wg):
        @plgpu.nd_loop((num_tiles,), collective_axes="sm", init_carry=jnp.int32(0))
        def _tiles(info, carry):
            g, blk, ni, offset, size = walk_tile(items_gmem, info.index[0], n_iters, cfg)
            store = masked_store(o_gmem.at[pl.ds(blk * cta_m, cta_m), pl.ds(ni * cta_n, cta_n)], out_smem, cfg.tile_m,
                                 offset, size, split)
            acc, carry = run_tile(wg, tile_steps(g, size), carry)

            @pl.when(size > 0)
            def _():
                store(acc, wg)  # the tail's items store their zeros

            return carry

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    tma_ring.warp_specialized(memory, compute)


def _grouped_kernel(items_gmem, a_gmem, b_gmem, sa_gmem, sb_gmem, o_gmem, *, cfg: GemmConfig):
    """`grouped_ring` with one ring step per 128-wide K block (A rows, expert B rows, both scales); warpgroups 0 / 1
    multiply and promote in the tile routine's arithmetic: one fresh wgmma per K block, acc = acc + p * (sa * sb),
    blocks in order. With a few rows an expert (MoE decode) a tile is only K / 128 blocks, and a pipeline per tile
    would pay its fill and drain on every one."""
    tm, tn = cfg.tile_m, cfg.tile_n
    cta_m, cta_n = cfg.cta_m, cfg.cta_n
    cols = cfg.split == "cols"
    stages = cfg.max_concurrent_steps
    fp8_transforms = _swizzle_transforms(BLOCK_K, jnp.float8_e4m3fn)
    row_layout = plgpu.Layout.WGMMA.reduce(1)

    def scoped(a_smem, b_smem, sa_smem, sb_smem, out_smem, full, empty):
        def issue(g, blk, ni, kb, slot):
            rows, ks, bar = pl.ds(blk * cta_m, cta_m), pl.ds(kb * BLOCK_K, BLOCK_K), full.at[slot]
            plgpu.copy_gmem_to_smem(a_gmem.at[rows, ks], a_smem.at[slot], bar)
            plgpu.copy_gmem_to_smem(b_gmem.at[g, pl.ds(ni * cta_n, cta_n), ks], b_smem.at[slot], bar)
            plgpu.copy_gmem_to_smem(sa_gmem.at[kb, rows], sa_smem.at[slot], bar)
            plgpu.copy_gmem_to_smem(sb_gmem.at[g, ni, kb], sb_smem.at[slot], bar)

        def run_tile(wg, n, it):
            a_rows = pl.ds(0, tm) if cols else pl.ds(wg * tm, tm)  # the A rows this warpgroup multiplies
            b_cols = pl.ds(wg * tn, tn)  # its B rows (output columns) under split "cols"
            own = pl.ds(wg * tm, tm)  # its entries of the row-mode B scales (b_scale_operand)

            def mma(acc_ref, slot):
                b = b_smem.at[slot, b_cols] if cols else b_smem.at[slot]
                plgpu.wgmma(acc_ref, a_smem.at[slot, a_rows], b.transpose((1, 0)))

            def promote(acc, acc_ref, slot, wait_n):
                """acc + p * (sa * sb) of the block in `slot`, whose wgmma into acc_ref was issued; frees the slot."""
                partial = plgpu.wgmma_accumulator_load(acc_ref, wait_n=wait_n)
                s = plgpu.load(sa_smem.at[slot, a_rows], layout=row_layout) * plgpu.load(
                    sb_smem.at[slot, own], layout=row_layout)
                plgpu.barrier_arrive(empty.at[slot])
                return acc + partial * lax.broadcast_in_dim(s, (tm, tn), [0])

            return tma_ring.promoted_blocks(n, zero_acc(tm, tn), it, full=full, stages=stages,
                                            blocks_per_step=cfg.k_blocks_per_step, acc_shape=(tm, tn), mma=mma,
                                            promote=promote)

        grouped_ring(items_gmem, o_gmem, out_smem, empty, cfg=cfg, cta_m=cta_m, cta_n=cta_n, split=cfg.split,
                     stages=stages, steps=a_gmem.shape[1] // BLOCK_K, issue=issue, run_tile=run_tile)

    pl.run_scoped(
        scoped,
        plgpu.SMEM((stages, cta_m, BLOCK_K), jnp.float8_e4m3fn, transforms=fp8_transforms),
        plgpu.SMEM((stages, cta_n, BLOCK_K), jnp.float8_e4m3fn, transforms=fp8_transforms),
        plgpu.SMEM((stages, cta_m), F32),
        plgpu.SMEM((stages, 2 * tm), F32),
        staging_smem(cfg, o_gmem.dtype),
        *tma_ring.barriers(stages, loads_per_step=4),
        collective_axes="wg",
    )


def weight_scale_operand(b_scale, cfg: GemmConfig | None = None):
    """Expert weights' block scales [E, N/128, K/128] as `grouped_block_scaled_matmul` loads them (under `cfg`,
    default DEFAULT_CONFIG): made once for weights that many calls multiply, passed as `b_scale_op`."""
    n = b_scale.shape[-2] * BLOCK_K
    return b_scale_operand(b_scale, n, BLOCK_K, cfg or DEFAULT_CONFIG)


@traced_once("out_dtype", "interpret", "config")
def grouped_block_scaled_matmul(a_q, a_scale, b_q, b_scale, group_sizes, *, out_dtype=F32, interpret: bool = False,
                                config: GemmConfig | None = None, b_scale_op=None, a_scale_op=None):
    """a_q [M, K] e4m3 (rows sorted by group), a_scale [M, K/128]; b_q [E, N, K], b_scale [E, N/128, K/128];
    b_scale_op: b_scale already in the kernel's layout (`weight_scale_operand`), or None;
    a_scale_op: a_scale already in the kernel's layout (`gemm_dense.a_scale_operand`; a_scale may then be None).

    Rows past sum(group_sizes) come out as zeros.
    """
    check_operands(a_q, a_scale, b_q, b_scale, 128, "gemm_grouped.grouped_block_scaled_matmul")
    m, k = a_q.shape
    e, n, _ = b_q.shape
    if group_sizes.shape != (e,):
        raise ValueError(f"gemm_grouped: group_sizes must be [{e}]; got {group_sizes.shape}")
    cfg = config or DEFAULT_CONFIG
    cfg.check(k, "gemm_grouped.grouped_block_scaled_matmul", ring=True)
    if not uses_row_scales(cfg, 128):
        raise ValueError(f"gemm_grouped: config {cfg} is not one this kernel runs (tile_n must be 128)")
    if n % cfg.cta_n:
        raise ValueError(f"gemm_grouped: N={n} is not a multiple of the CTA tile's {cfg.cta_n} columns (split {cfg.split!r})")
    tile = cfg.cta_m
    items = work_items(group_sizes, m, tile)
    mp = -(-m // tile) * tile
    a = jnp.pad(a_q, [(0, mp - m), (0, 0)]) if mp != m else a_q  # a copy only when M is not whole blocks
    sa_t = a_scale_operand(a_scale, a_scale_op, m, k // BLOCK_K, mp, "gemm_grouped.grouped_block_scaled_matmul")
    sb_t = checked_scale_operand(b_scale, b_scale_op, n, 128, cfg, "gemm_grouped.grouped_block_scaled_matmul")
    kernel = functools.partial(_grouped_kernel, cfg=cfg)
    return launch_persistent(kernel, jax.ShapeDtypeStruct((m, n), out_dtype), items, a, b_q, sa_t, sb_t,
                             name="gemm_grouped_fp8", interpret=interpret)
