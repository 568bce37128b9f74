"""Grouped (MoE) weight gradients for Hopper: dw[g] = dy[rows of g]^T . x[rows of g], FP8 block-scaled or BF16.

Operands as `jaxrl_fp8.ops.grouping.grouped_wgrad_fp8` takes them: dyt_q [N, M] and xt_q [K, M] e4m3, quantized
1x128 along M (the contraction) with scales [N, M/128] and [K, M/128]. A 128-row quantization group may
straddle two experts; each expert must then see only its own rows of it.

Layout: the M axis is re-cut into work items (one per (expert, 128-row block) pair that shares a row, at most
M/128 + E, `gemm_grouped.work_items`). One XLA gather builds the item-major operands, dyt with the other
expert's rows zeroed in each item, so every expert's contraction is one contiguous run of whole 128-wide
blocks. The kernel then runs the dense kernel's tile routine in column-scale mode (acc += p * (sa[n] * sb[k])
per block, in item order) with a pipeline whose length is that expert's item count (a dynamic grid). Empty
experts get zeros. The gather moves ~(N + K) * (M + 128 E) bytes of FP8 once, instead of the XLA path's
scan of M/128 + E small block-scaled GEMMs.

`grouped_wgrad_bf16(dy, x, ...)` is the same scheme for BF16 operands (the BF16 recipes' and the
high-precision backward's wgrad), with the BF16 grouped kernel's tile routine and no scales.
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
    scaled_tile_pipeline,
    tile_store,
    zero_fill,
)
from pallas_kernels import gemm_grouped_bf16
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


@traced_once("num_groups", "interpret", "config")
def grouped_wgrad_fp8(dyt_q, dyt_scale, xt_q, xt_scale, group_sizes, num_groups: int, *, interpret: bool = False,
                      config: GemmConfig | None = None):
    """float32 [E, N, K]; same contract as `jaxrl_fp8.ops.grouping.grouped_wgrad_fp8`. N, K multiples of 128."""
    where = "gemm_grouped_wgrad.grouped_wgrad_fp8"
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
    cfg = config or DEFAULT_CONFIG  # the grouped forward's tiling
    if cfg.k_blocks_per_step != 1:
        cfg = dataclasses.replace(cfg, k_blocks_per_step=1)  # an expert's block count may be odd
    items = work_items(group_sizes, m, BLOCK_K)
    a, b = _item_major(dyt_q, items, mask=True), _item_major(xt_q, items, mask=False)
    sa = jnp.take(jnp.asarray(dyt_scale, F32), items[BLOCK], axis=1).T  # [T, N]
    sb = jnp.take(jnp.asarray(xt_scale, F32), items[BLOCK], axis=1).T  # [T, K]
    kernel = functools.partial(_kernel, cfg=cfg, num_items=items.shape[1])
    out = jax.ShapeDtypeStruct((num_groups, n, k), F32)
    return launch_persistent(kernel, out, _ranges(items, num_groups), a, b, sa, sb, interpret=interpret)


def _bf16_kernel(ranges_gmem, a_gmem, b_gmem, o_gmem, *, cfg, num_items: int):
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
def grouped_wgrad_bf16(dy, x, group_sizes, num_groups: int, *, interpret: bool = False,
                       config: gemm_grouped_bf16.Bf16GroupedConfig | None = None):
    """float32 [E, N, K] = per expert dy[rows]^T . x[rows] with BF16 operands; dy [M, N], x [M, K] sorted by
    expert, rows past sum(group_sizes) ignored. N and K multiples of 128 (`ops.grouping.grouped_wgrad`'s contract)."""
    where = "gemm_grouped_wgrad.grouped_wgrad_bf16"
    m, n = dy.shape
    if x.ndim != 2 or x.shape[0] != m:
        raise ValueError(f"{where}: dy {dy.shape} and x {x.shape} must be [M, N] and [M, K]")
    k = x.shape[1]
    if n % 128 or k % 128:
        raise ValueError(f"{where}: N and K must be multiples of 128; got N={n}, K={k}")
    if group_sizes.shape != (num_groups,):
        raise ValueError(f"{where}: group_sizes must be [{num_groups}]; got {group_sizes.shape}")
    cfg = config or gemm_grouped_bf16.Bf16GroupedConfig()
    items = work_items(group_sizes, m, BLOCK_K)
    a = _item_major(dy.astype(jnp.bfloat16).T, items, mask=True)
    b = _item_major(x.astype(jnp.bfloat16).T, items, mask=False)
    kernel = functools.partial(_bf16_kernel, cfg=cfg, num_items=items.shape[1])
    out = jax.ShapeDtypeStruct((num_groups, n, k), F32)
    return launch_persistent(kernel, out, _ranges(items, num_groups), a, b, interpret=interpret)
