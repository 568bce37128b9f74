"""Grouped (MoE) block-scaled FP8 GEMM for Hopper: y[r] = x[r] . w[g(r)]^T for expert-sorted rows.

Ragged tiling: each group's rows are placed at a 128-row aligned offset of a padded row space (a gather,
done by XLA), so every CTA row tile belongs to exactly one expert. The kernel is the dense kernel's tile
routine with B, its scales and the tile's expert looked up per tile; tiles past the last group are skipped.
Same numerics as the dense kernel (one wgmma per 128-wide K block, promoted as acc += (p * sa) * sb), and a
row's result depends only on that row and its expert (row invariance).

Cost of the alignment: at most 127 padded rows per non-empty expert plus one gather of x and of y.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.gemm_dense import (
    BLOCK_K,
    F32,
    GemmConfig,
    _num_sms,
    _out_smem,
    check_operands,
    default_config,
    row_scales_t,
    scaled_tile_pipeline,
)


def _grouped_kernel(tile_group_gmem, a_gmem, b_gmem, sa_gmem, sb_gmem, o_gmem, *, cfg: GemmConfig):
    mp, k = a_gmem.shape
    n = b_gmem.shape[1]
    cta_m, tn = 2 * cfg.tile_m, cfg.tile_n
    m_iters, n_iters, k_iters = mp // cta_m, n // tn, k // BLOCK_K
    allocations, run = scaled_tile_pipeline(cfg, k_iters, o_gmem.dtype)

    @functools.partial(
        pl.run_scoped,
        allocs=allocations(a_gmem, b_gmem.at[0], sa_gmem, sb_gmem.at[0]),
        out_smem=_out_smem(cfg, o_gmem.dtype),
        collective_axes="wg",
    )
    def _scope(allocs, out_smem):
        @plgpu.nd_loop((m_iters * n_iters,), collective_axes="sm")
        def _tiles(info):
            mi, ni = plgpu.planar_snake(info.index[0], (m_iters, n_iters), cfg.grid_minor_dim, cfg.grid_tile_width)
            g = tile_group_gmem[mi]

            @pl.when(g >= 0)
            def _():
                ms, ns = pl.ds(mi * cta_m, cta_m), pl.ds(ni * tn, tn)
                run(a_gmem.at[ms], b_gmem.at[g, ns], sa_gmem.at[:, ms], sb_gmem.at[g, :, ns], o_gmem.at[ms, ns], out_smem, allocs)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def aligned_layout(group_sizes, m: int, tile: int):
    """Maps rows to a padded space where each group starts at a multiple of `tile`.

    Returns (src [Mpad] source row or -1, dst [M] padded row of each row or -1, tile_group [Mpad/tile]).
    """
    e = group_sizes.shape[0]
    sizes = jnp.maximum(group_sizes.astype(jnp.int32), 0)
    ends = jnp.minimum(jnp.cumsum(sizes), m)
    starts = ends - jnp.minimum(sizes, ends)
    sizes = ends - starts
    padded = (sizes + tile - 1) // tile * tile
    pends = jnp.cumsum(padded)
    pstarts = pends - padded
    mpad = (-(-m // tile) + e) * tile
    p = jnp.arange(mpad, dtype=jnp.int32)
    gp = jnp.minimum(jnp.searchsorted(pends, p, side="right").astype(jnp.int32), e - 1)
    local = p - pstarts[gp]
    src = jnp.where((p < pends[-1]) & (local < sizes[gp]), starts[gp] + local, -1)
    r = jnp.arange(m, dtype=jnp.int32)
    gr = jnp.minimum(jnp.searchsorted(ends, r, side="right").astype(jnp.int32), e - 1)
    dst = jnp.where(r < ends[-1], pstarts[gr] + r - starts[gr], -1)
    t = jnp.arange(mpad // tile, dtype=jnp.int32) * tile
    tile_group = jnp.where(t < pends[-1], gp[t], -1)
    return src, dst, tile_group


def _take_rows(x, idx):
    return jnp.where((idx >= 0)[:, None], jnp.take(x, jnp.maximum(idx, 0), axis=0), jnp.zeros((), x.dtype))


def grouped_block_scaled_matmul(a_q, a_scale, b_q, b_scale, group_sizes, *, out_dtype=F32, interpret: bool = False, config: GemmConfig | None = None):
    """a_q [M, K] e4m3 (rows sorted by group), a_scale [M, K/128]; b_q [E, N, K], b_scale [E, N/128, K/128]."""
    check_operands(a_q, a_scale, b_q, b_scale, 128, "gemm_grouped.grouped_block_scaled_matmul")
    m, k = a_q.shape
    e, n, _ = b_q.shape
    if group_sizes.shape != (e,):
        raise ValueError(f"gemm_grouped: group_sizes must be [{e}]; got {group_sizes.shape}")
    cfg = config or default_config(n, k)
    tile = 2 * cfg.tile_m
    src, dst, tile_group = aligned_layout(group_sizes, m, tile)
    a = _take_rows(a_q, src)
    sa_t = _take_rows(jnp.asarray(a_scale, F32), src).T
    sb_t = row_scales_t(b_scale, n, 128)
    call = plgpu.kernel(
        functools.partial(_grouped_kernel, cfg=cfg),
        out_type=jax.ShapeDtypeStruct((a.shape[0], n), out_dtype),
        grid=(_num_sms(interpret),),
        grid_names=("sm",),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )
    from pallas_kernels.interpret import launch

    out = launch(call, tile_group, a, b_q, sa_t, sb_t, interpret=interpret)
    return _take_rows(out, dst)
