"""Grouped (MoE) weight gradients for Hopper: dw[g] = dy[rows of g]^T . x[rows of g], FP8 block-scaled or BF16.

Operands as `jaxrl_fp8.ops.grouping.grouped_wgrad_fp8` takes them: dyt_q [N, M] and xt_q [K, M] e4m3, quantized
1x128 along M (the contraction) with scales [N, M/128] and [K, M/128]. A 128-row quantization group may
straddle two experts; each expert must then see only its own rows of it.

`grouped_wgrad_fp8`: a persistent k-grouped kernel. One warp-specialized pipeline per SM for the whole
call walks (expert, N tile, K tile) output tiles and, per tile, the expert's 128-row blocks, read by TMA in place
from dyt_q / xt_q; the TMA ring runs on across tiles, so the next tile's loads stream during a tile's epilogue.
Each expert's first and last block, when shared with another expert, come from a small pre-masked copy
(`edge_blocks`). Per block: one wgmma into a fresh accumulator, promoted as acc += p * (sa[n] * sb[k]), blocks in
order: the block math of the XLA path. docs/decisions/0002-gemm-tiling.md has the reasoning and the arithmetic.

`grouped_wgrad_fp8_gather` (kept as the tests' bitwise oracle and the benchmark's comparison): one XLA gather re-cuts M into
item-major operands (other experts' rows zeroed), then each output tile runs the dense kernel's tile routine with
a dynamic-length pipeline. Same bits as the persistent kernel.

`grouped_wgrad_bf16(dy, x, ...)` (the BF16 recipes' and the high-precision backward's wgrad) is the same persistent
kernel on BF16 operands read in place from dy [M, N] / x [M, K] (16-bit wgmma takes MN-major operands, so no
transposed copy), each 128-row block in two 64-row ring steps chained into one accumulator, the same edge copies.
`grouped_wgrad_bf16_gather` is its gather-scheme oracle (item-major copies of both operands, the BF16 grouped kernel's
tile routine): same bits.

Both persistent kernels store float32 or, with `out_dtype=bfloat16`, round each float32 tile to nearest even as they
store it: the bits of the float32 result cast by XLA, without the float32 [E, N, K] written and read back. The
trainer asks for its compute dtype (the master's cotangent is cast to it anyway): at Qwen3-30B-A3B's experts the
float32 gradient of one layer is 2.4 GB a micro-batch, so the store is a large part of the kernel at a few thousand
tokens a step. The BF16 staging tile also frees 32 KB of shared memory: a fifth ring stage fits.
"""

from __future__ import annotations

import dataclasses
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
    _out_smem,
    launch_persistent,
    _swizzle_transforms,
    scaled_tile_pipeline,
    tile_store,
    zero_acc,
    zero_fill,
)
from pallas_kernels import gemm_grouped_bf16, tma_ring
from pallas_kernels.gemm_grouped import BLOCK, DEFAULT_CONFIG, GROUP, OFFSET, SIZE, work_items
from pallas_kernels.kernel_cache import traced_once


def _own_rows(items):
    """bool [T, 128]: which rows of item t's 128-row block belong to item t's expert."""
    lane = jnp.arange(BLOCK_K, dtype=jnp.int32)
    return (lane >= items[OFFSET][:, None]) & (lane < (items[OFFSET] + items[SIZE])[:, None]) & (items[GROUP] >= 0)[:, None]


def _item_major(a, items, mask: bool):
    """a [C, M] (M the contraction) -> [C, T*128]: item t holds columns block_t*128 ... +128 of a, zeroed
    outside item t's expert if `mask` (then each expert's contraction is one run of whole items)."""
    c, m = a.shape
    mb = -(-m // BLOCK_K)
    fp8 = a.dtype == jnp.float8_e4m3fn
    u = lax.bitcast_convert_type(a, jnp.uint8) if fp8 else a  # select on the bits: 0x00 is +0.0 in e4m3
    u = jnp.take(jnp.pad(u, [(0, 0), (0, mb * BLOCK_K - m)]).reshape(c, mb, BLOCK_K), items[BLOCK], axis=1)
    if mask:
        u = jnp.where(_own_rows(items)[None], u, jnp.zeros((), u.dtype))
    u = u.reshape(c, -1)
    return lax.bitcast_convert_type(u, a.dtype) if fp8 else u


def _ranges(items, num_groups: int):
    """Per expert: first item and item count (items are ordered by expert)."""
    used = (items[SIZE] > 0) & (items[GROUP] >= 0)
    counts = jnp.zeros((num_groups,), jnp.int32).at[jnp.where(used, items[GROUP], num_groups)].add(1, mode="drop")
    return jnp.stack([jnp.cumsum(counts) - counts, counts])


def _expert_tiles(ranges_gmem, o_gmem, out_smem, cfg, run_tile):
    """Walk the [E, N, K] output tiles (persistent grid): run_tile(first item, item count, N rows, K cols,
    store) for experts that own rows, zeros for the others."""
    e, n, k = o_gmem.shape
    cta_m, tn = 2 * cfg.tile_m, cfg.tile_n
    m_iters, n_iters = n // cta_m, k // tn

    @plgpu.nd_loop((e * m_iters * n_iters,), collective_axes="sm")
    def _tiles(info):
        g = info.index[0] // (m_iters * n_iters)
        mi, ni = plgpu.planar_snake(info.index[0] % (m_iters * n_iters), (m_iters, n_iters), cfg.grid_minor_dim,
                                    cfg.grid_tile_width)
        first, count = ranges_gmem[0, g], ranges_gmem[1, g]
        ms, ns = pl.ds(mi * cta_m, cta_m), pl.ds(ni * tn, tn)
        store = tile_store(o_gmem.at[g, ms, ns], out_smem, cfg.tile_m)

        @pl.when(count > 0)
        def _():
            # The expert's items are one contiguous run; operand slices starting there reach past the array
            # end only in steps the dynamic-length pipeline never fetches.
            run_tile(first, count, ms, ns, store)

        @pl.when(count == 0)
        def _():
            zero_fill(store, cfg.tile_m, tn)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _kernel(ranges_gmem, a_gmem, b_gmem, sa_gmem, sb_gmem, o_gmem, *, cfg: GemmConfig, num_items: int):
    static_allocations, _ = scaled_tile_pipeline(cfg, num_items, row_scales=False)

    @functools.partial(
        pl.run_scoped,
        allocs=static_allocations(a_gmem, b_gmem, sa_gmem, sb_gmem.at[:, pl.ds(0, cfg.tile_n)]),
        out_smem=_out_smem(cfg, o_gmem.dtype),
        collective_axes="wg",
    )
    def _scope(allocs, out_smem):
        def run_tile(first, count, ms, ns, store):
            ks, kb = pl.ds(first * BLOCK_K, num_items * BLOCK_K), pl.ds(first, num_items)
            _, run = scaled_tile_pipeline(cfg, count, row_scales=False)
            run(a_gmem.at[ms, ks], b_gmem.at[ns, ks], sa_gmem.at[kb, ms], sb_gmem.at[kb, ns], store, allocs)

        _expert_tiles(ranges_gmem, o_gmem, out_smem, cfg, run_tile)


def _check_fp8(dyt_q, dyt_scale, xt_q, xt_scale, group_sizes, num_groups: int, where: str):
    """The FP8 wgrad operands' contract (shapes, dtypes); returns (N, M, K, M/128 blocks)."""
    n, m = dyt_q.shape
    k = xt_q.shape[0]
    if xt_q.shape[1] != m:
        raise ValueError(f"{where}: dyt_q {dyt_q.shape} and xt_q {xt_q.shape} must share the M axis")
    if n % 128 or k % 128:
        raise ValueError(f"{where}: N and K must be multiples of 128; got N={n}, K={k}")
    if dyt_q.dtype != jnp.float8_e4m3fn or xt_q.dtype != jnp.float8_e4m3fn:
        raise ValueError(f"{where}: operands must be float8_e4m3fn; got {dyt_q.dtype}, {xt_q.dtype}")
    mb = -(-m // BLOCK_K)
    if dyt_scale.shape != (n, mb) or xt_scale.shape != (k, mb):
        raise ValueError(f"{where}: scales must be [N, M/128] and [K, M/128] = {(n, mb)}, {(k, mb)}; got "
                         f"{dyt_scale.shape}, {xt_scale.shape}")
    if group_sizes.shape != (num_groups,):
        raise ValueError(f"{where}: group_sizes must be [{num_groups}]; got {group_sizes.shape}")
    return n, m, k, mb


# ---------------------------------------------------------------------------------------------------------------
# The persistent k-grouped kernel.

TILE = 128  # output tile: 128 rows of N (64 per compute warpgroup) x 128 columns of K

# Rows of the per-expert table (int32 [4, E]).
FIRST_BLOCK, COUNT, FIRST_EDGE, LAST_EDGE = range(4)


@dataclasses.dataclass(frozen=True)
class WgradConfig:
    """Tiling of the persistent k-grouped wgrad kernel (`grouped_wgrad_fp8`).

    stages: ring of TMA buffers (FP8: 33 KB each, two 128x128 e4m3 tiles + 2 x 128 scales; BF16: 32 KB). With the
      64 KB float32 epilogue tile 4 is the most that fits in 227 KB, with the 32 KB BF16 one (`out_dtype`) 5.
    mask: which operand's boundary blocks come from the pre-masked edge array: "a" (dy^T), "b" (x^T), or "auto"
      (the one with fewer rows, so the edge array is smallest). Either gives the same bits (a foreign row
      contributes an exact zero product either way).
    k_fastest: walk an expert's output tiles along K (columns) first; else along N.
    blocks_per_step: the FP8 kernel's promotion chain (`tma_ring.promoted_blocks`: 1, or 2 with the first block
      promoted under the second one's wgmma; same bits). The BF16 kernel always chains its steps into one accumulator.
    """

    stages: int = 4
    mask: str = "auto"
    k_fastest: bool = True
    blocks_per_step: int = 1

    def check(self, where: str, out_dtype=F32) -> None:
        most = max_stages(out_dtype)
        if not 2 <= self.stages <= most:
            raise ValueError(f"{where}: stages must be 2 to {most} with a {jnp.dtype(out_dtype).name} output (shared "
                             f"memory); got {self.stages}")
        if self.mask not in ("a", "b", "auto"):
            raise ValueError(f"{where}: mask must be 'a', 'b' or 'auto'; got {self.mask!r}")
        if self.blocks_per_step not in tma_ring.CHAIN_LENGTHS:
            raise ValueError(f"{where}: blocks_per_step must be one of {tma_ring.CHAIN_LENGTHS}; got {self.blocks_per_step}")


DEFAULT_WGRAD_CONFIG = WgradConfig()
OUT_DTYPES = (jnp.dtype(F32), jnp.dtype(jnp.bfloat16))


def max_stages(out_dtype) -> int:
    """The deepest ring that fits beside the epilogue's staging tile of `out_dtype` (2 x 64 x 128 elements)."""
    return 4 if jnp.dtype(out_dtype).itemsize == 4 else 5


def _out_dtype(out_dtype, where: str):
    dtype = jnp.dtype(out_dtype)
    if dtype not in OUT_DTYPES:
        raise ValueError(f"{where}: out_dtype must be float32 or bfloat16; got {dtype.name}")
    return dtype


def _out_staging(out_dtype):
    """The epilogue's staging tile: one 64 x 128 half per compute warpgroup, swizzled for the TMA store."""
    return plgpu.SMEM((2, TILE // 2, TILE), out_dtype, transforms=_swizzle_transforms(TILE, out_dtype))


def expert_table(group_sizes, m: int, num_groups: int):
    """Per expert: (first 128-row block, block count, first block partial, last block partial) as int32 [4, E],
    and the work items (`gemm_grouped.work_items`, 128-row blocks) of expert e's first and last block, int32 [2E].

    An expert's contraction is the run of blocks first ... first + count - 1 of the M axis; a block is partial when
    the expert owns only some of its rows (it shares the block with another expert or with rows past the groups).
    """
    items = work_items(group_sizes, m, BLOCK_K)
    first, count = _ranges(items, num_groups)
    last_t = items.shape[1] - 1
    fi = jnp.clip(first, 0, last_t)
    li = jnp.clip(first + count - 1, 0, last_t)
    live = count > 0
    partial = lambda t: live & ((items[OFFSET][t] != 0) | (items[SIZE][t] != BLOCK_K))
    table = jnp.stack([jnp.where(live, items[BLOCK][fi], 0), count, partial(fi), partial(li)]).astype(jnp.int32)
    return table, items, jnp.stack([fi, li], axis=1).reshape(-1)


def edge_blocks(a, items, edge_items, *, m_axis: int = 1):
    """a [C, Mp] (m_axis 1) or [Mp, C] (m_axis 0), Mp whole 128-blocks, e4m3 or bf16 -> [C, 2E*128] (or [2E*128, C]):
    M positions 256e ... +128 hold expert e's first block of a, 256e + 128 ... +128 its last block, each with the rows
    of other experts zeroed (on the bits: an all-zero word is +0.0 in both formats).
    The only copy of operand data the kernel needs: C x 2E x 128 values (vs. all of both operands to gather)."""
    word = {1: jnp.uint8, 2: jnp.uint16}[jnp.dtype(a.dtype).itemsize]
    lane = jnp.arange(BLOCK_K, dtype=jnp.int32)
    lo = items[OFFSET][edge_items][:, None]
    keep = (lane >= lo) & (lane < lo + items[SIZE][edge_items][:, None]) & (items[GROUP][edge_items] >= 0)[:, None]
    blocks = items[BLOCK][edge_items]
    u = lax.bitcast_convert_type(a, word)
    if m_axis == 0:  # blocks gathered as whole [128, C] row runs: no transposed copy of a
        mp, c = a.shape
        u = jnp.take(u.reshape(mp // BLOCK_K, BLOCK_K, c), blocks, axis=0)
        u = jnp.where(keep[:, :, None], u, jnp.zeros((), word)).reshape(-1, c)
    else:
        c, mp = a.shape
        u = jnp.take(u.reshape(c, mp // BLOCK_K, BLOCK_K), blocks, axis=1)
        u = jnp.where(keep[None], u, jnp.zeros((), word)).reshape(c, -1)
    return lax.bitcast_convert_type(u, a.dtype)


def _tile_coords(t, *, per_expert: int, n_tiles: int, k_tiles: int, k_fastest: bool):
    """(expert, N tile, K tile) of output tile t: tiles expert-major, within an expert along K or N first."""
    g, local = lax.div(t, per_expert), lax.rem(t, per_expert)
    if k_fastest:
        return g, lax.div(local, k_tiles), lax.rem(local, k_tiles)
    return g, lax.rem(local, n_tiles), lax.div(local, n_tiles)


def _load_block(edge_gmem, masked, plain, *, g, j, count, first, first_edge, last_edge, bar, sub=0, width=BLOCK_K):
    """TMA copies of M positions [sub * width, + width) of expert g's j-th 128-row block into this step's buffers: the
    masked operand from the edge copy where the block is shared with another expert (first_edge / last_edge), in place
    otherwise; the plain operand in place. masked / plain: (gmem, copies), each copy (view, smem buffer) with
    view(array, M slice) the window of the array that fills the buffer. Returns the block's index along M (its
    scales' row)."""
    (masked_gmem, masked_copies), (plain_gmem, plain_copies) = masked, plain
    blk = first + j
    ms = pl.ds(blk * BLOCK_K + sub * width, width)
    at_first, at_last = j == 0, j == count - 1
    is_edge = (at_first & first_edge) | (at_last & last_edge)
    edge_ms = pl.ds((2 * g + jnp.where(at_first, 0, 1)) * BLOCK_K + sub * width, width)

    for view, smem in masked_copies:
        @pl.when(is_edge)
        def _():
            plgpu.copy_gmem_to_smem(view(edge_gmem, edge_ms), smem, bar)

        @pl.when(jnp.logical_not(is_edge))
        def _():
            plgpu.copy_gmem_to_smem(view(masked_gmem, ms), smem, bar)

    for view, smem in plain_copies:
        plgpu.copy_gmem_to_smem(view(plain_gmem, ms), smem, bar)
    return blk


def _expert_run(table_gmem, g):
    """Expert g's (first block, block count, first block shared, last block shared) from `expert_table`."""
    return (table_gmem[FIRST_BLOCK, g], table_gmem[COUNT, g], table_gmem[FIRST_EDGE, g] != 0,
            table_gmem[LAST_EDGE, g] != 0)


def _tile_walk(o_gmem, cfg: WgradConfig):
    """(tiles per expert, t -> (expert, N tile, K tile)) of the persistent kernels' output [E, N, K]."""
    _, n, k = o_gmem.shape
    n_tiles, k_tiles = n // TILE, k // TILE
    per_expert = n_tiles * k_tiles
    return per_expert, functools.partial(_tile_coords, per_expert=per_expert, n_tiles=n_tiles, k_tiles=k_tiles,
                                         k_fastest=cfg.k_fastest)


def _tile_blocks(table_gmem, edge_gmem, a_gmem, b_gmem, a_smem, b_smem, full, coords, index, mask_a: bool,
                 mn_major: bool = False):
    """Output tile `index`'s expert block run and its loader: (block count, (j, slot, sub, width) -> block index),
    which issues M positions [sub * width, + width) of the tile's j-th block of both operands into ring buffer `slot`
    (`_load_block`, the masked operand chosen by mask_a). Also returns the tile's (N rows, K rows) slices.
    Operands dy^T [N, M] / x^T [K, M] (K-major buffers [128, width]), or with mn_major dy [M, N] / x [M, K] read in
    place: B into a [width, 128] buffer, A as two [width, 64] halves (a_smem [stages, 2, width, 64]), one per compute
    warpgroup."""
    g, ni, ki = coords(index)
    first, count, first_edge, last_edge = _expert_run(table_gmem, g)
    ns, ks = pl.ds(ni * TILE, TILE), pl.ds(ki * TILE, TILE)

    def load(j, slot, sub=0, width=BLOCK_K):
        if mn_major:
            half = lambda h: pl.ds(ni * TILE + h * (TILE // 2), TILE // 2)  # noqa: E731
            a_copies = [(lambda arr, m, h=h: arr.at[m, half(h)], a_smem.at[slot, h]) for h in range(2)]
            b_copies = [(lambda arr, m: arr.at[m, ks], b_smem.at[slot])]
        else:
            a_copies = [(lambda arr, m: arr.at[ns, m], a_smem.at[slot])]
            b_copies = [(lambda arr, m: arr.at[ks, m], b_smem.at[slot])]
        a, b = (a_gmem, a_copies), (b_gmem, b_copies)
        return _load_block(edge_gmem, *((a, b) if mask_a else (b, a)), g=g, j=j, count=count, first=first,
                           first_edge=first_edge, last_edge=last_edge, bar=full.at[slot], sub=sub, width=width)

    return count, load, (ns, ks)


def _rows_mma(a_smem, b_smem, rows):
    """mma(acc_ref, slot): warpgroup's `rows` of the tile, A rows times B rows transposed (both K-major)."""
    def mma(acc_ref, slot):
        plgpu.wgmma(acc_ref, a_smem.at[slot, rows], b_smem.at[slot].transpose((1, 0)))
    return mma


def _consume_tiles(table_gmem, o_gmem, out_smem, coords, per_expert: int, run_tile, wg):
    """Warpgroup wg's walk over the output tiles, in the memory warpgroup's order: acc, it = run_tile(block count,
    ring position) per tile, stored (an expert without rows stores the zeros run_tile returns). Each tile's block
    count is loaded a whole tile ahead, its latency off the tensor core's path."""
    num_tiles = o_gmem.shape[0] * per_expert
    tm = TILE // 2
    count_of = lambda t: table_gmem[COUNT, lax.div(jnp.minimum(t, num_tiles - 1), per_expert)]  # noqa: E731

    @plgpu.nd_loop((num_tiles,), collective_axes="sm", init_carry=(jnp.int32(0), count_of(lax.axis_index("sm"))))
    def _tiles(info, carry):
        it, count = carry
        count_next = count_of(info.index[0] + lax.axis_size("sm"))
        g, ni, ki = coords(info.index[0])
        acc, it = run_tile(count, it)
        tile_store(o_gmem.at[g, pl.ds(ni * TILE, TILE), pl.ds(ki * TILE, TILE)], out_smem, tm)(acc, wg)
        return it, count_next

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _persistent_kernel(table_gmem, a_gmem, b_gmem, sa_gmem, sb_gmem, edge_gmem, o_gmem, *, cfg: WgradConfig,
                       mask_a: bool):
    """A `tma_ring` kernel: warpgroup 2 streams each tile's 128-row blocks (the expert's masked operand from the edge
    copy where shared, the plain one, both scales), warpgroups 0 / 1 each compute 64 rows of the 128 x 128 output
    tile; tiles expert-major over the SMs."""
    e = o_gmem.shape[0]
    per_expert, coords = _tile_walk(o_gmem, cfg)
    stages = cfg.stages
    tm = TILE // 2
    fp8_transforms = _swizzle_transforms(BLOCK_K, jnp.float8_e4m3fn)
    row_layout, col_layout = plgpu.Layout.WGMMA.reduce(1), plgpu.Layout.WGMMA.reduce(0)

    def scoped(a_smem, b_smem, sa_smem, sb_smem, out_smem, full, empty):
        def tile(index):
            count, load_block, (ns, ks) = _tile_blocks(table_gmem, edge_gmem, a_gmem, b_gmem, a_smem, b_smem, full,
                                                       coords, index, mask_a)

            def load(j, slot):
                blk = load_block(j, slot)
                plgpu.copy_gmem_to_smem(sa_gmem.at[blk, ns], sa_smem.at[slot], full.at[slot])
                plgpu.copy_gmem_to_smem(sb_gmem.at[blk, ks], sb_smem.at[slot], full.at[slot])

            return count, load

        def compute(wg):
            rows = pl.ds(wg * tm, tm)
            mma = _rows_mma(a_smem, b_smem, rows)

            def promote(acc, acc_ref, slot, wait_n):
                """acc + p * (sa[n] * sb[k]) of the block in `slot` (the block math), whose wgmma was issued; frees
                the slot."""
                partial = plgpu.wgmma_accumulator_load(acc_ref, wait_n=wait_n)
                sa = plgpu.load(sa_smem.at[slot, rows], layout=row_layout)
                sb = plgpu.load(sb_smem.at[slot], layout=col_layout)
                s = lax.broadcast_in_dim(sa, (tm, TILE), [0]) * lax.broadcast_in_dim(sb, (tm, TILE), [1])
                plgpu.barrier_arrive(empty.at[slot])
                return acc + partial * s

            def run_tile(count, it):
                return tma_ring.promoted_blocks(count, zero_acc(tm, TILE), it, full=full, stages=stages,
                                                blocks_per_step=cfg.blocks_per_step, acc_shape=(tm, TILE), mma=mma,
                                                promote=promote)

            _consume_tiles(table_gmem, o_gmem, out_smem, coords, per_expert, run_tile, wg)

        tma_ring.warp_specialized(
            lambda: tma_ring.produce(e * per_expert, tile, stages=stages, empty=empty), compute)

    pl.run_scoped(
        scoped,
        plgpu.SMEM((stages, TILE, BLOCK_K), jnp.float8_e4m3fn, transforms=fp8_transforms),
        plgpu.SMEM((stages, TILE, BLOCK_K), jnp.float8_e4m3fn, transforms=fp8_transforms),
        plgpu.SMEM((stages, TILE), F32),
        plgpu.SMEM((stages, TILE), F32),
        _out_staging(o_gmem.dtype),
        *tma_ring.barriers(stages, loads_per_step=4),
        collective_axes="wg",
    )


@traced_once("num_groups", "interpret", "config", "out_dtype")
def grouped_wgrad_fp8(dyt_q, dyt_scale, xt_q, xt_scale, group_sizes, num_groups: int, *, interpret: bool = False,
                      config: WgradConfig | None = None, out_dtype=F32):
    """[E, N, K] in out_dtype (float32, or bfloat16: the float32 result rounded to nearest even as it is stored); same
    contract as `jaxrl_fp8.ops.grouping.grouped_wgrad_fp8`. N, K multiples of 128.

    The persistent k-grouped kernel: TMA reads each expert's 128-row blocks in place from dyt_q / xt_q (no
    item-major copy); only each expert's first and last block, when shared, come from a small pre-masked copy
    (`edge_blocks`). Bits equal `grouped_wgrad_fp8_gather` and the XLA path (same blocks, order and block math).
    """
    where = "gemm_grouped_wgrad.grouped_wgrad_fp8"
    n, m, k, mb = _check_fp8(dyt_q, dyt_scale, xt_q, xt_scale, group_sizes, num_groups, where)
    out_dtype = _out_dtype(out_dtype, where)
    cfg = config or DEFAULT_WGRAD_CONFIG
    cfg.check(where, out_dtype)
    mp = mb * BLOCK_K
    if mp != m:  # whole blocks for TMA; the padding columns belong to no expert (work_items clips to m)
        dyt_q, xt_q = (jnp.pad(a, [(0, 0), (0, mp - m)]) for a in (dyt_q, xt_q))
    table, items, edge_items = expert_table(group_sizes, m, num_groups)
    mask_a = cfg.mask == "a" or (cfg.mask == "auto" and n <= k)
    edge = edge_blocks(dyt_q if mask_a else xt_q, items, edge_items)
    sa_t = jnp.asarray(dyt_scale, F32).T  # [M/128, N]: a block's scales of one tile are 512 contiguous bytes
    sb_t = jnp.asarray(xt_scale, F32).T
    kernel = functools.partial(_persistent_kernel, cfg=cfg, mask_a=mask_a)
    out = jax.ShapeDtypeStruct((num_groups, n, k), out_dtype)
    return launch_persistent(kernel, out, table, dyt_q, xt_q, sa_t, sb_t, edge, name="gemm_wgrad_fp8", interpret=interpret)


@traced_once("num_groups", "interpret", "config")
def grouped_wgrad_fp8_gather(dyt_q, dyt_scale, xt_q, xt_scale, group_sizes, num_groups: int, *, interpret: bool = False,
                      config: GemmConfig | None = None):
    """The gather scheme: XLA gather into item-major operands + a dynamic-length pipeline per output
    tile. Same contract and bits as `grouped_wgrad_fp8`; kept to time and bit-compare the persistent kernel against."""
    n, m, k, _ = _check_fp8(dyt_q, dyt_scale, xt_q, xt_scale, group_sizes, num_groups,
                            "gemm_grouped_wgrad.grouped_wgrad_fp8_gather")
    cfg = config or DEFAULT_CONFIG  # the grouped forward's tiling
    if cfg.k_blocks_per_step != 1:
        cfg = dataclasses.replace(cfg, k_blocks_per_step=1)  # an expert's block count may be odd
    items = work_items(group_sizes, m, BLOCK_K)
    a, b = _item_major(dyt_q, items, mask=True), _item_major(xt_q, items, mask=False)
    sa = jnp.take(jnp.asarray(dyt_scale, F32), items[BLOCK], axis=1).T  # [T, N]
    sb = jnp.take(jnp.asarray(xt_scale, F32), items[BLOCK], axis=1).T  # [T, K]
    kernel = functools.partial(_kernel, cfg=cfg, num_items=items.shape[1])
    out = jax.ShapeDtypeStruct((num_groups, n, k), F32)
    return launch_persistent(kernel, out, _ranges(items, num_groups), a, b, sa, sb, name="gemm_wgrad_fp8_gather",
                             interpret=interpret)


BF16_STEP = gemm_grouped_bf16.TILE_K  # tokens per ring step of the BF16 kernel: 64 bf16 = 128 B rows, the widest swizzle


def _persistent_bf16_kernel(table_gmem, a_gmem, b_gmem, edge_gmem, o_gmem, *, cfg: WgradConfig, mask_a: bool):
    """The persistent kernel's BF16 form on dy [M, N] / x [M, K] read in place (16-bit wgmma takes either operand
    MN-major, so no transposed copy): the same tiles, expert block runs and edge copies, each 128-row block in two
    ring steps of 64 rows; warpgroup w multiplies its 64-column half of dy's rows (transposed in shared memory) by
    x's rows, chaining every step's wgmma into the tile's accumulator in M order (no scales: no promotion), as the
    gather scheme's tile pipeline does."""
    e = o_gmem.shape[0]
    per_expert, coords = _tile_walk(o_gmem, cfg)
    stages, tm = cfg.stages, TILE // 2
    steps_per_block = BLOCK_K // BF16_STEP
    transforms = _swizzle_transforms(BF16_STEP, jnp.bfloat16)  # 64-wide rows: 128-byte swizzle, 8 x 64 tiles

    def scoped(a_smem, b_smem, out_smem, full, empty):
        def tile(index):
            count, load_block, _ = _tile_blocks(table_gmem, edge_gmem, a_gmem, b_gmem, a_smem, b_smem, full, coords,
                                                index, mask_a, mn_major=True)

            def load(step, slot):
                load_block(lax.div(step, steps_per_block), slot, sub=lax.rem(step, steps_per_block), width=BF16_STEP)

            return count * steps_per_block, load

        def compute(wg):
            def mma(acc_ref, slot):
                plgpu.wgmma(acc_ref, a_smem.at[slot, wg].transpose((1, 0)), b_smem.at[slot])

            def run_tile(count, it):
                def scope(acc_ref):  # an expert without rows (count 0) gets the accumulator's zeros
                    it_end = tma_ring.chained_steps(acc_ref, count * steps_per_block, it, full=full, empty=empty,
                                                    stages=stages, mma=mma)
                    return acc_ref[...], it_end

                return pl.run_scoped(scope, plgpu.ACC((tm, TILE), F32))

            _consume_tiles(table_gmem, o_gmem, out_smem, coords, per_expert, run_tile, wg)

        tma_ring.warp_specialized(
            lambda: tma_ring.produce(e * per_expert, tile, stages=stages, empty=empty), compute)

    pl.run_scoped(
        scoped,
        plgpu.SMEM((stages, 2, BF16_STEP, tm), jnp.bfloat16, transforms=transforms),
        plgpu.SMEM((stages, BF16_STEP, TILE), jnp.bfloat16, transforms=transforms),
        _out_staging(o_gmem.dtype),
        *tma_ring.barriers(stages, loads_per_step=3),
        collective_axes="wg",
    )


def _check_bf16(dy, x, group_sizes, num_groups: int, where: str):
    """The BF16 wgrad operands' contract; returns (M, N, K)."""
    m, n = dy.shape
    if x.ndim != 2 or x.shape[0] != m:
        raise ValueError(f"{where}: dy {dy.shape} and x {x.shape} must be [M, N] and [M, K]")
    k = x.shape[1]
    if n % 128 or k % 128:
        raise ValueError(f"{where}: N and K must be multiples of 128; got N={n}, K={k}")
    if group_sizes.shape != (num_groups,):
        raise ValueError(f"{where}: group_sizes must be [{num_groups}]; got {group_sizes.shape}")
    return m, n, k


@traced_once("num_groups", "interpret", "config", "out_dtype")
def grouped_wgrad_bf16(dy, x, group_sizes, num_groups: int, *, interpret: bool = False,
                       config: WgradConfig | None = None, out_dtype=F32):
    """[E, N, K] = per expert dy[rows]^T . x[rows] with BF16 operands, float32 sums stored in out_dtype (float32, or
    bfloat16 rounded to nearest even); dy [M, N], x [M, K] sorted by expert, rows past sum(group_sizes) ignored. N
    and K multiples of 128 (`ops.grouping.grouped_wgrad`'s contract).

    The persistent kernel on dy / x as they are (their 128-row blocks read in place by TMA, no transposed copy), only
    the shared end blocks of each expert copied pre-masked. Bits equal `grouped_wgrad_bf16_gather` (same steps, same
    order)."""
    where = "gemm_grouped_wgrad.grouped_wgrad_bf16"
    m, n, k = _check_bf16(dy, x, group_sizes, num_groups, where)
    out_dtype = _out_dtype(out_dtype, where)
    cfg = config or DEFAULT_WGRAD_CONFIG
    cfg.check(where, out_dtype)
    mp = -(-m // BLOCK_K) * BLOCK_K  # whole blocks for TMA (a copy only when M is not a multiple of 128)
    dy, x = (a.astype(jnp.bfloat16) for a in (dy, x))
    if mp != m:
        dy, x = (jnp.pad(a, [(0, mp - m), (0, 0)]) for a in (dy, x))
    table, items, edge_items = expert_table(group_sizes, m, num_groups)
    mask_a = cfg.mask == "a" or (cfg.mask == "auto" and n <= k)
    edge = edge_blocks(dy if mask_a else x, items, edge_items, m_axis=0)
    kernel = functools.partial(_persistent_bf16_kernel, cfg=cfg, mask_a=mask_a)
    out = jax.ShapeDtypeStruct((num_groups, n, k), out_dtype)
    return launch_persistent(kernel, out, table, dy, x, edge, name="gemm_wgrad_bf16", interpret=interpret)


def _bf16_gather_kernel(ranges_gmem, a_gmem, b_gmem, o_gmem, *, cfg, num_items: int):
    per_item = BLOCK_K // gemm_grouped_bf16.TILE_K
    allocations, _ = gemm_grouped_bf16.tile_pipeline(cfg, num_items * per_item, "nk", a_gmem.dtype)

    @functools.partial(
        pl.run_scoped,
        allocs=allocations(a_gmem.at[pl.ds(0, 2 * cfg.tile_m)], b_gmem.at[pl.ds(0, cfg.tile_n)]),
        out_smem=_out_smem(cfg, o_gmem.dtype),
        collective_axes="wg",
    )
    def _scope(allocs, out_smem):
        def run_tile(first, count, ms, ns, store):
            ks = pl.ds(first * BLOCK_K, num_items * BLOCK_K)
            _, run = gemm_grouped_bf16.tile_pipeline(cfg, count * per_item, "nk", a_gmem.dtype)
            run(a_gmem.at[ms, ks], b_gmem.at[ns, ks], store, allocs)

        _expert_tiles(ranges_gmem, o_gmem, out_smem, cfg, run_tile)


@traced_once("num_groups", "interpret", "config")
def grouped_wgrad_bf16_gather(dy, x, group_sizes, num_groups: int, *, interpret: bool = False,
                              config: gemm_grouped_bf16.Bf16GroupedConfig | None = None):
    """The gather scheme for BF16 operands (kept as the tests' bitwise oracle and the benchmark's comparison): XLA
    re-cuts both transposed operands into item-major copies (dy's rows of other experts zeroed), then each output tile
    runs the BF16 grouped kernel's tile routine over its expert's items. Same contract and bits as
    `grouped_wgrad_bf16`."""
    m, n, k = _check_bf16(dy, x, group_sizes, num_groups, "gemm_grouped_wgrad.grouped_wgrad_bf16_gather")
    cfg = config or gemm_grouped_bf16.Bf16GroupedConfig()
    items = work_items(group_sizes, m, BLOCK_K)
    a = _item_major(dy.astype(jnp.bfloat16).T, items, mask=True)
    b = _item_major(x.astype(jnp.bfloat16).T, items, mask=False)
    kernel = functools.partial(_bf16_gather_kernel, cfg=cfg, num_items=items.shape[1])
    out = jax.ShapeDtypeStruct((num_groups, n, k), F32)
    return launch_persistent(kernel, out, _ranges(items, num_groups), a, b, name="gemm_wgrad_bf16_gather",
                             interpret=interpret)
