"""Block-scaled FP8 GEMM for Hopper in Mosaic GPU: C[M, N] = A[M, K] . B[N, K]^T.

A is e4m3 with one float32 scale per row and 128-wide K block; B is e4m3 (HF [out, in] layout, so both
operands are K-major as FP8 wgmma requires) with float32 scales per 128x128 block, or per row (wgrad).
Per K block of 128 the kernel runs one wgmma into a fresh float32 accumulator and promotes it into the
main accumulator as  acc += (partial * sa[m]) * sb[n]  (the block math of jaxrl_fp8.ops.xla_gemm).

Structure (ideas from jax's hopper_matmul_mgpu example): a persistent grid of one program per SM walking
output tiles, a warp-specialized TMA pipeline (one memory warpgroup, two compute warpgroups that each own
tile_m rows of a (2 * tile_m) x tile_n CTA tile), and a TMA-store epilogue. The two compute warpgroups
interleave: while one promotes its partial product, the other's wgmma runs.

Row invariance: the tile configuration depends on N and K only, never on M, and the K blocks are
accumulated in order, so a row's result does not depend on how many rows are in the batch.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

BLOCK_K = 128
F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    tile_m: int = 64  # rows per compute warpgroup; the CTA tile is 2 * tile_m rows
    tile_n: int = 128
    max_concurrent_steps: int = 4
    grid_tile_width: int = 8
    grid_minor_dim: int = 1  # 0: walk M fastest inside a band, 1: walk N fastest


def default_config(n: int, k: int) -> GemmConfig:
    """Tiles chosen from N and K only (never M): keeps every row's arithmetic independent of the batch."""
    del k
    tile_n = 128 if n % 128 == 0 else 64
    return GemmConfig(tile_n=tile_n)


def _num_sms(interpret: bool) -> int:
    if interpret:
        from pallas_kernels.interpret import INTERPRET_NUM_SMS

        return INTERPRET_NUM_SMS
    return jax.devices()[0].core_count


def _swizzle_transforms(minor_elems: int, dtype) -> tuple:
    itemsize = jnp.dtype(dtype).itemsize
    swizzle = plgpu.find_swizzle(minor_elems * itemsize * 8)
    return (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))


def scaled_tile_pipeline(cfg: GemmConfig, k_iters: int, out_dtype):
    """Returns the per-output-tile routine shared by the dense and the grouped kernels.

    run(a_rows, b_rows, sa_rows, sb_rows, out_tile, out_smem, allocs): a_rows [2*tile_m, K] e4m3,
    b_rows [tile_n, K] e4m3, sa_rows [KB, 2*tile_m] f32, sb_rows [KB, tile_n] f32, out_tile [2*tile_m, tile_n].
    """
    tm, tn = cfg.tile_m, cfg.tile_n
    in_transforms = _swizzle_transforms(BLOCK_K, jnp.float8_e4m3fn)

    def make(body, compute_context):
        return plgpu.emit_pipeline_warp_specialized(
            body,
            grid=(k_iters,),
            memory_registers=40,
            in_specs=[
                plgpu.BlockSpec((2 * tm, BLOCK_K), lambda k: (0, k), transforms=in_transforms),
                plgpu.BlockSpec((tn, BLOCK_K), lambda k: (0, k), transforms=in_transforms),
                plgpu.BlockSpec((1, 2 * tm), lambda k: (k, 0)),
                plgpu.BlockSpec((1, tn), lambda k: (k, 0)),
            ],
            wg_axis="wg",
            num_compute_wgs=2,
            max_concurrent_steps=cfg.max_concurrent_steps,
            compute_context=compute_context,
        )

    def allocations(a, b, sa, sb):
        ignore = lambda *_, **__: None
        return make(ignore, ignore).get_allocations(a, b, sa, sb)

    def run(a_rows, b_rows, sa_rows, sb_rows, out_tile, out_smem, allocs):
        wg = lax.axis_index("wg")
        rows = pl.ds(wg * tm, tm)

        def body(_, a_smem, b_smem, sa_smem, sb_smem, acc):
            def partial_scope(tmp_ref):
                plgpu.wgmma(tmp_ref, a_smem.at[rows], b_smem.transpose((1, 0)))
                return tmp_ref[...]

            partial = pl.run_scoped(partial_scope, plgpu.ACC((tm, tn), F32))
            sa = plgpu.load(sa_smem.at[0, rows], layout=plgpu.Layout.WGMMA.reduce(1))
            sb = plgpu.load(sb_smem.at[0], layout=plgpu.Layout.WGMMA.reduce(0))
            scaled = partial * lax.broadcast_in_dim(sa, (tm, tn), [0])
            return acc + scaled * lax.broadcast_in_dim(sb, (tm, tn), [1])

        def compute_context(eval_pipeline):
            acc0 = plgpu.layout_cast(jnp.zeros((tm, tn), F32), plgpu.Layout.WGMMA)
            acc = eval_pipeline(acc0)
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous tile's store has read out_smem
            out_smem[wg] = acc.astype(out_dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(out_smem.at[wg], out_tile.at[rows])

        make(body, compute_context)(a_rows, b_rows, sa_rows, sb_rows, allocations=allocs)

    return allocations, run


def _out_smem(cfg: GemmConfig, out_dtype):
    return plgpu.SMEM((2, cfg.tile_m, cfg.tile_n), out_dtype, transforms=_swizzle_transforms(cfg.tile_n, out_dtype))


def _dense_kernel(a_gmem, b_gmem, sa_gmem, sb_gmem, o_gmem, *, cfg: GemmConfig):
    mp, k = a_gmem.shape
    n = b_gmem.shape[0]
    cta_m, tn = 2 * cfg.tile_m, cfg.tile_n
    m_iters, n_iters, k_iters = mp // cta_m, n // tn, k // BLOCK_K
    allocations, run = scaled_tile_pipeline(cfg, k_iters, o_gmem.dtype)

    @functools.partial(
        pl.run_scoped,
        allocs=allocations(a_gmem, b_gmem, sa_gmem, sb_gmem),
        out_smem=_out_smem(cfg, o_gmem.dtype),
        collective_axes="wg",
    )
    def _scope(allocs, out_smem):
        @plgpu.nd_loop((m_iters * n_iters,), collective_axes="sm")
        def _tiles(info):
            mi, ni = plgpu.planar_snake(info.index[0], (m_iters, n_iters), cfg.grid_minor_dim, cfg.grid_tile_width)
            ms, ns = pl.ds(mi * cta_m, cta_m), pl.ds(ni * tn, tn)
            run(a_gmem.at[ms], b_gmem.at[ns], sa_gmem.at[:, ms], sb_gmem.at[:, ns], o_gmem.at[ms, ns], out_smem, allocs)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def check_operands(a_q, a_scale, b_q, b_scale, b_rows_per_scale: int, where: str):
    m, k = a_q.shape
    n, k2 = b_q.shape[-2:]
    if k != k2:
        raise ValueError(f"{where}: A has K={k} but B has K={k2}")
    if n % 128 or k % 128:
        raise ValueError(f"{where}: N and K must be multiples of 128 (pad them); got N={n}, K={k}")
    if a_q.dtype != jnp.float8_e4m3fn or b_q.dtype != jnp.float8_e4m3fn:
        raise ValueError(f"{where}: A and B must be float8_e4m3fn; got {a_q.dtype}, {b_q.dtype}")
    kb = k // BLOCK_K
    if a_scale.shape != (m, kb):
        raise ValueError(f"{where}: a_scale must be [M, K/128] = {(m, kb)}; got {a_scale.shape}")
    want = (*b_q.shape[:-2], n // b_rows_per_scale, kb)
    if b_scale.shape != want:
        raise ValueError(f"{where}: b_scale must be {want} ({b_rows_per_scale} rows per scale); got {b_scale.shape}")


def row_scales_t(b_scale, n: int, b_rows_per_scale: int):
    """[..., N/g, KB] -> [..., KB, N]: one scale per output column and K block (what the kernel loads)."""
    s = jnp.asarray(b_scale, F32)
    if b_rows_per_scale != 1:
        s = jnp.repeat(s, b_rows_per_scale, axis=-2)[..., :n, :]
    return jnp.swapaxes(s, -1, -2)


def block_scaled_matmul(a_q, a_scale, b_q, b_scale, *, b_rows_per_scale: int = 128, out_dtype=F32, interpret: bool = False, config: GemmConfig | None = None):
    """C = A . B^T with block scales (see module doc). Any M; N, K multiples of 128."""
    check_operands(a_q, a_scale, b_q, b_scale, b_rows_per_scale, "gemm_dense.block_scaled_matmul")
    m, k = a_q.shape
    n = b_q.shape[0]
    cfg = config or default_config(n, k)
    cta_m = 2 * cfg.tile_m
    mp = -(-m // cta_m) * cta_m
    a = jnp.pad(a_q, [(0, mp - m), (0, 0)])
    sa_t = jnp.pad(jnp.asarray(a_scale, F32), [(0, mp - m), (0, 0)]).T
    sb_t = row_scales_t(b_scale, n, b_rows_per_scale)
    call = plgpu.kernel(
        functools.partial(_dense_kernel, cfg=cfg),
        out_type=jax.ShapeDtypeStruct((mp, n), out_dtype),
        grid=(_num_sms(interpret),),
        grid_names=("sm",),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )
    from pallas_kernels.interpret import launch

    out = launch(call, a, b_q, sa_t, sb_t, interpret=interpret)
    return out[:m]
