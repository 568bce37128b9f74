"""Block-scaled FP8 GEMM for Hopper in Mosaic GPU: C[M, N] = A[M, K] . B[N, K]^T.

A is e4m3 with one float32 scale per row and 128-wide K block; B is e4m3 (HF [out, in] layout, so both
operands are K-major as FP8 wgmma requires) with float32 scales per 128x128 block, or per row (wgrad).
Per K block of 128 the kernel runs one wgmma into a fresh float32 accumulator and promotes it into the
main accumulator as  acc += partial * (sa[m] * sb[n])  (the block math of jaxrl_fp8.ops.xla_gemm). With
128x128 weight blocks and 128-wide tiles, sa[m] * sb is one value per row: one multiply-add per element.

Structure (ideas from jax's hopper_matmul_mgpu example): a persistent grid of one program per SM walking
output tiles, a warp-specialized TMA pipeline (one memory warpgroup, two compute warpgroups that each own
tile_m rows of a (2 * tile_m) x tile_n CTA tile), and a TMA-store epilogue. Promotion hides under the
tensor core's work: with two K blocks per step a warpgroup issues the second block's wgmma before promoting
the first, and the two compute warpgroups interleave.

Row invariance: every tiling runs the same 64-row wgmma per K block and accumulates the K blocks in order, so a
row's result does not depend on how many rows are in the batch, although a decode batch (M <= 256) gets narrower
column tiles than a training batch (`default_config`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import interpret as interpret_mode
from pallas_kernels.kernel_cache import traced_once

BLOCK_K = 128
F32 = jnp.float32
A_ROW_BLOCK = 128  # the largest CTA row block of the FP8 GEMM kernels: A's scales padded to it fit every one


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    """Tiling of one kernel launch (see docs/decisions/0002-gemm-tiling.md).

    k_blocks_per_step: 128-wide K blocks per pipeline step (1 or 2). With 2, each compute warpgroup issues the
      second block's wgmma before it promotes the first, so that promotion runs under the tensor core's work. The
      grouped kernels (one TMA buffer per block, `tma_ring.promoted_blocks`) take 1 or 2 for any K.
    """

    tile_m: int = 64  # rows per compute warpgroup; the CTA tile is 2 * tile_m rows
    tile_n: int = 128
    max_concurrent_steps: int = 4
    grid_tile_width: int = 8
    grid_minor_dim: int = 1  # 0: walk M fastest inside a band, 1: walk N fastest
    k_blocks_per_step: int = 1
    # "rows": the two compute warpgroups own tile_m rows each of a (2 * tile_m) x tile_n CTA tile; "cols": both
    # multiply the same tile_m rows, each by its own tile_n columns of a tile_m x (2 * tile_n) tile. A row's
    # arithmetic is the same wgmma shape either way (tile_m x tile_n per K block, promoted in K order), so the
    # choice changes no bits; "cols" halves the rows a CTA multiplies, which is what a narrow row block wastes
    # (MoE decode: a few rows per expert, the rest of a 128-row block belongs to other experts)
    split: str = "rows"

    @property
    def cta_m(self) -> int:
        return 2 * self.tile_m if self.split == "rows" else self.tile_m

    @property
    def cta_n(self) -> int:
        return self.tile_n if self.split == "rows" else 2 * self.tile_n

    def check(self, k: int, where: str, *, ring: bool = False) -> None:
        """ring: the grouped kernels' TMA ring, where k_blocks_per_step is a promotion chain (`tma_ring.CHAIN_LENGTHS`)
        and K need not be a multiple of it."""
        if self.split not in ("rows", "cols"):
            raise ValueError(f"{where}: split must be 'rows' or 'cols'; got {self.split!r}")
        if ring:
            from pallas_kernels.tma_ring import CHAIN_LENGTHS

            if self.k_blocks_per_step not in CHAIN_LENGTHS:
                raise ValueError(f"{where}: k_blocks_per_step (promotion chain) must be one of {CHAIN_LENGTHS}; "
                                 f"got {self.k_blocks_per_step}")
            return
        if self.k_blocks_per_step not in (1, 2):
            raise ValueError(f"{where}: k_blocks_per_step must be 1 or 2; got {self.k_blocks_per_step}")
        if k % (BLOCK_K * self.k_blocks_per_step):
            raise ValueError(f"{where}: K={k} is not a multiple of {BLOCK_K * self.k_blocks_per_step} (k_blocks_per_step)")


DECODE_ROWS = 256  # the largest M that `default_config` tiles by its rows (the decode batches it was measured at)
DECODE_TILES = ((32, 8), (64, 4), (128, 4))  # (tile_n, stages), narrowest first


def default_config(n: int, k: int, m: int | None = None) -> GemmConfig:
    """The tiling for a weight [N, K] (and, for a decode batch, its M rows); measured, NOTES_gemm.md and
    `results/gemm_dense_decode_<card>.json`.

    Shape only (m None or above DECODE_ROWS): shallow K (fewer than 16 blocks, e.g. the MoE down projection,
    K = 768) keeps one K block per step and four stages; deeper K takes two blocks per step (two stages: three
    would need 235 KB of shared memory with the BF16 epilogue, the limit is 227 KB).
    Decode (m <= DECODE_ROWS): a 128-column tile leaves most SMs idle (256 rows x 2048 columns is 32 tiles), so
    the narrowest column tile whose output fits one wave of CTAs (one per SM of the GPU, `interpret.num_sms`: the
    GPU's choice in interpret mode too), with the deepest ring that fits (1.2-1.4x on the
    decode step's q/k/v and o products). None of these choices changes any row's arithmetic: every tile runs the
    same 64-row wgmma per K block and promotes the blocks in the same order (bitwise equal on the GPU,
    `bitwise_vs_first_config`), so a row's bits do not depend on how many rows share its batch.
    """
    if m is not None and m <= DECODE_ROWS:
        row_tiles, sms = -(-m // 128), interpret_mode.num_sms(False)
        for tile_n, stages in DECODE_TILES:
            if n % tile_n == 0 and row_tiles * (n // tile_n) <= sms:
                return GemmConfig(tile_n=tile_n, max_concurrent_steps=stages, grid_tile_width=16, grid_minor_dim=0)
    if k // BLOCK_K < 16 or k % (2 * BLOCK_K):
        return GemmConfig(max_concurrent_steps=4, grid_tile_width=16, grid_minor_dim=0)
    return GemmConfig(max_concurrent_steps=2, k_blocks_per_step=2)


def _swizzle_transforms(minor_elems: int, dtype) -> tuple:
    itemsize = jnp.dtype(dtype).itemsize
    swizzle = plgpu.find_swizzle(minor_elems * itemsize * 8)
    return (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))


def uses_row_scales(cfg: GemmConfig, b_rows_per_scale: int) -> bool:
    """True when one B scale covers the whole tile width, so promotion scales rows only (one FMA each)."""
    return b_rows_per_scale == BLOCK_K and cfg.tile_n == BLOCK_K


def b_scale_operand(b_scale, n: int, b_rows_per_scale: int, cfg: GemmConfig):
    """The B scales as the kernel loads them.

    Row mode ([..., N/128, K/128] -> [..., N/cta_n, KB, 2*tile_m]): warpgroup w's weight block scale repeated
    over entries [w*tile_m, (w+1)*tile_m), so it loads in the same register layout as A's row scales and folds
    into them (split "rows": both warpgroups share the tile's block; "cols": each has the block of its columns).
    Column mode ([..., N/g, KB] -> [..., KB, N]): one scale per output column (wgrad's 1x128 scales, or
    tiles spanning several 128-row weight blocks).
    """
    s = jnp.asarray(b_scale, F32)
    if uses_row_scales(cfg, b_rows_per_scale):
        if cfg.split == "cols":  # CTA column tile c = weight blocks 2c (warpgroup 0) and 2c + 1 (warpgroup 1)
            pairs = jnp.swapaxes(s.reshape(*s.shape[:-2], s.shape[-2] // 2, 2, s.shape[-1]), -1, -2)
            return jnp.broadcast_to(pairs[..., None], (*pairs.shape, cfg.tile_m)).reshape(*pairs.shape[:-1], 2 * cfg.tile_m)
        return jnp.broadcast_to(s[..., None], (*s.shape, 2 * cfg.tile_m))
    if b_rows_per_scale != 1:
        s = jnp.repeat(s, b_rows_per_scale, axis=-2)[..., :n, :]
    return jnp.swapaxes(s, -1, -2)


def weight_scale_operand(b_scale, n: int, k: int, cfg: GemmConfig | None = None, *, rows: int | None = None):
    """A weight's 128x128-block scales [..., N/128, K/128] as `block_scaled_matmul` loads them under the config it
    picks for (n, k) and `rows` (`b_scale_operand`; rows None: a batch of unknown or training size). Made once for a
    weight that many calls multiply (decode steps, micro-batches) and passed as `b_scale_op`: XLA does not hoist the
    broadcast out of a loop."""
    return b_scale_operand(b_scale, n, BLOCK_K, cfg or default_config(n, k, rows))


def checked_scale_operand(b_scale, b_scale_op, n: int, b_rows_per_scale: int, cfg: GemmConfig, where: str):
    """`b_scale_op` (made by `weight_scale_operand`) if given, checked against the layout `cfg` loads; else the
    layout made from `b_scale` now."""
    if b_scale_op is None:
        return b_scale_operand(b_scale, n, b_rows_per_scale, cfg)
    want = jax.eval_shape(lambda s: b_scale_operand(s, n, b_rows_per_scale, cfg), b_scale)
    if b_scale_op.shape != want.shape or b_scale_op.dtype != want.dtype:
        raise ValueError(f"{where}: b_scale_op {b_scale_op.shape} {b_scale_op.dtype} is not the layout this call loads "
                         f"({want.shape} {want.dtype}: split {cfg.split!r}, tile_m {cfg.tile_m}); make it with weight_scale_operand")
    return b_scale_op


def scaled_tile_pipeline(cfg: GemmConfig, k_iters: int, row_scales: bool):
    """Returns the per-output-tile routine shared by the dense and the grouped kernels.

    run(a_rows, b_rows, sa_rows, sb_rows, store, allocs): a_rows [cta_m, K] e4m3, b_rows [cta_n, K]
    e4m3, sa_rows [KB, cta_m] f32, sb_rows [KB, 2*tile_m] (row mode) or [KB, cta_n] (column mode) f32;
    store(acc, wg) writes one compute warpgroup's float32 [tile_m, tile_n] result (split "rows": rows
    wg*tile_m...; "cols": columns wg*tile_n...).

    Promotion of each K block's partial product p into the float32 accumulator:
        acc = acc + p * (sa[m] * sb[n])
    in row mode sa[m] * sb is one value per row (the tile lies inside one 128-row weight block).
    """
    tm, tn = cfg.tile_m, cfg.tile_n
    cols = cfg.split == "cols"
    kps = cfg.k_blocks_per_step
    steps = k_iters // kps
    in_transforms = _swizzle_transforms(BLOCK_K, jnp.float8_e4m3fn)
    sb_width = 2 * tm if row_scales else cfg.cta_n
    row_layout, col_layout = plgpu.Layout.WGMMA.reduce(1), plgpu.Layout.WGMMA.reduce(0)

    def make(body, compute_context):
        def fp8_spec(rows, j):
            return plgpu.BlockSpec((rows, BLOCK_K), lambda s, j=j: (0, s * kps + j), transforms=in_transforms)

        return plgpu.emit_pipeline_warp_specialized(
            body,
            grid=(steps,),
            memory_registers=40,
            in_specs=[
                *[fp8_spec(cfg.cta_m, j) for j in range(kps)],
                *[fp8_spec(cfg.cta_n, j) for j in range(kps)],
                plgpu.BlockSpec((kps, cfg.cta_m), lambda s: (s, 0)),
                plgpu.BlockSpec((kps, sb_width), lambda s: (s, 0)),
            ],
            wg_axis="wg",
            num_compute_wgs=2,
            max_concurrent_steps=cfg.max_concurrent_steps,
            compute_context=compute_context,
        )

    def allocations(a, b, sa, sb):
        ignore = lambda *_, **__: None
        return make(ignore, ignore).get_allocations(*([a] * kps), *([b] * kps), sa, sb)

    def run(a_rows, b_rows, sa_rows, sb_rows, store, allocs):
        wg = lax.axis_index("wg")
        rows = pl.ds(0, tm) if cols else pl.ds(wg * tm, tm)  # the A rows this warpgroup multiplies
        b_cols = pl.ds(wg * tn, tn)  # its B rows (output columns) under split "cols"
        own = pl.ds(wg * tm, tm)  # its entries of the row-mode B scales (b_scale_operand)

        def scale(sa_smem, sb_smem, j):
            """The block's combined scale: [tm] (row mode, broadcast later) or [tm, tn] (column mode)."""
            sa = plgpu.load(sa_smem.at[j, rows], layout=row_layout)
            if row_scales:
                return sa * plgpu.load(sb_smem.at[j, own], layout=row_layout)
            sb = plgpu.load(sb_smem.at[j, b_cols] if cols else sb_smem.at[j], layout=col_layout)
            return lax.broadcast_in_dim(sa, (tm, tn), [0]) * lax.broadcast_in_dim(sb, (tm, tn), [1])

        def promote(acc, partial, s):
            if row_scales:
                s = lax.broadcast_in_dim(s, (tm, tn), [0])
            return acc + partial * s

        def mma(acc_ref, a_smem, b_smem):
            plgpu.wgmma(acc_ref, a_smem.at[rows], (b_smem.at[b_cols] if cols else b_smem).transpose((1, 0)))

        def body(_, *refs):
            """k_blocks_per_step blocks per step, all wgmmas issued before the first promotion."""
            a_s, b_s, (sa_smem, sb_smem, acc) = refs[:kps], refs[kps : 2 * kps], refs[2 * kps :]

            def scope(*acc_refs):
                for j in range(kps):
                    mma(acc_refs[j], a_s[j], b_s[j])
                out = acc
                for j in range(kps):
                    partial = plgpu.wgmma_accumulator_load(acc_refs[j], wait_n=kps - 1 - j)
                    out = promote(out, partial, scale(sa_smem, sb_smem, j))
                return out

            return pl.run_scoped(scope, *[plgpu.ACC((tm, tn), F32) for _ in range(kps)])

        def compute_context(eval_pipeline):
            store(eval_pipeline(zero_acc(tm, tn)), wg)

        make(body, compute_context)(*([a_rows] * kps), *([b_rows] * kps), sa_rows, sb_rows, allocations=allocs)

    return allocations, run


def zero_acc(tm: int, tn: int):
    return plgpu.layout_cast(jnp.zeros((tm, tn), F32), plgpu.Layout.WGMMA)


def zero_fill(store, tm: int, tn: int):
    """Both compute warpgroups store a zero tile through `store` (outputs no MMA contributes to)."""
    wg = lax.axis_index("wg")

    @pl.when(wg < 2)
    def _():
        store(zero_acc(tm, tn), wg)


def _out_smem(cfg: GemmConfig, out_dtype):
    return plgpu.SMEM((2, cfg.tile_m, cfg.tile_n), out_dtype, transforms=_swizzle_transforms(cfg.tile_n, out_dtype))


def tile_store(out_tile, out_smem, tile_m: int):
    """Epilogue of a full output tile: registers -> swizzled smem -> one TMA store per warpgroup."""

    def store(acc, wg):
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous tile's store has read out_smem
        out_smem[wg] = acc.astype(out_smem.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem.at[wg], out_tile.at[pl.ds(wg * tile_m, tile_m)])

    return store


def tile_scales(sb_gmem, ni, cta_n: int, row_scales: bool):
    """The B scales of output column tile ni (cta_n wide): its weight blocks' (row mode) or its columns' (column mode)."""
    return sb_gmem.at[ni] if row_scales else sb_gmem.at[:, pl.ds(ni * cta_n, cta_n)]


def _dense_kernel(a_gmem, b_gmem, sa_gmem, sb_gmem, o_gmem, *, cfg: GemmConfig, row_scales: bool):
    mp, k = a_gmem.shape
    n = b_gmem.shape[0]
    cta_m, tn = 2 * cfg.tile_m, cfg.tile_n
    m_iters, n_iters, k_iters = mp // cta_m, n // tn, k // BLOCK_K
    allocations, run = scaled_tile_pipeline(cfg, k_iters, row_scales)

    @functools.partial(
        pl.run_scoped,
        allocs=allocations(a_gmem, b_gmem, sa_gmem, tile_scales(sb_gmem, 0, tn, row_scales)),
        out_smem=_out_smem(cfg, o_gmem.dtype),
        collective_axes="wg",
    )
    def _scope(allocs, out_smem):
        @plgpu.nd_loop((m_iters * n_iters,), collective_axes="sm")
        def _tiles(info):
            mi, ni = plgpu.planar_snake(info.index[0], (m_iters, n_iters), cfg.grid_minor_dim, cfg.grid_tile_width)
            ms, ns = pl.ds(mi * cta_m, cta_m), pl.ds(ni * tn, tn)
            sb = tile_scales(sb_gmem, ni, tn, row_scales)
            run(a_gmem.at[ms], b_gmem.at[ns], sa_gmem.at[:, ms], sb, tile_store(o_gmem.at[ms, ns], out_smem, cfg.tile_m), allocs)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def launch_persistent(kernel, out_type, *args, name: str, interpret: bool):
    """Run `kernel` on one program per SM with 3 warpgroups (1 memory + 2 compute), Warpgroup semantics.

    `name` names the CUDA kernel (`<name>_mosaic_gpu_kernel` in a profile, nsys or ncu; a functools.partial body
    would otherwise be "anonymous"); the kernel's hash covers it, so call sites of one kernel share one name."""
    from pallas_kernels.interpret import launch

    call = plgpu.kernel(
        kernel,
        out_type=out_type,
        grid=(interpret_mode.num_sms(interpret),),
        grid_names=("sm",),
        num_threads=3,
        thread_name="wg",
        kernel_name=name,
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )
    return launch(call, *args, interpret=interpret)


def a_scale_operand(a_scale, a_scale_op, m: int, kb: int, mp: int, where: str):
    """A's 1x128 scales as the kernels load them, float32 [K/128, >= Mp] (Mp: M rounded up to the kernel's row block;
    columns past M: any finite value, only padding rows use them): `a_scale_op` when the quantizer wrote that layout
    (`quantize.fp8_gemm_operand`, rows padded to A_ROW_BLOCK), else a_scale [M, K/128] padded and transposed here (an
    XLA transpose kernel per product)."""
    if a_scale_op is None:
        return jnp.pad(jnp.asarray(a_scale, F32), [(0, mp - m), (0, 0)]).T
    if a_scale_op.ndim != 2 or a_scale_op.shape[0] != kb or a_scale_op.shape[1] < mp or a_scale_op.dtype != F32:
        raise ValueError(f"{where}: a_scale_op must be float32 [K/128, >= Mp] = [{kb}, >= {mp}] (Mp: M rounded up to the "
                         f"row block); got {a_scale_op.dtype} {list(a_scale_op.shape)}; make it with quantize.fp8_gemm_operand")
    return a_scale_op


def check_operands(a_q, a_scale, b_q, b_scale, b_rows_per_scale: int, where: str):
    """a_scale None: A's scales come as a_scale_op (checked by `a_scale_operand`)."""
    m, k = a_q.shape
    n, k2 = b_q.shape[-2:]
    if k != k2:
        raise ValueError(f"{where}: A has K={k} but B has K={k2}")
    if n % 128 or k % 128:
        raise ValueError(f"{where}: N and K must be multiples of 128 (pad them); got N={n}, K={k}")
    if a_q.dtype != jnp.float8_e4m3fn or b_q.dtype != jnp.float8_e4m3fn:
        raise ValueError(f"{where}: A and B must be float8_e4m3fn; got {a_q.dtype}, {b_q.dtype}")
    kb = k // BLOCK_K
    if a_scale is not None and a_scale.shape != (m, kb):
        raise ValueError(f"{where}: a_scale must be [M, K/128] = {(m, kb)}; got {a_scale.shape}")
    want = (*b_q.shape[:-2], n // b_rows_per_scale, kb)
    if b_scale.shape != want:
        raise ValueError(f"{where}: b_scale must be {want} ({b_rows_per_scale} rows per scale); got {b_scale.shape}")


def _config_for(b_scale, b_scale_op, n: int, k: int, m: int, b_rows_per_scale: int) -> GemmConfig:
    """`default_config` for these rows, unless `b_scale_op` holds another layout: then it was made for a batch of any
    size (`weight_scale_operand` with rows=None, e.g. a trainer's weight in a small batch), and the shape-only config
    it was made for (same bits) beats a relayout in every call; `checked_scale_operand` names any other layout."""
    cfg = default_config(n, k, m)
    if b_scale_op is not None and b_scale_op.shape != jax.eval_shape(
            lambda s: b_scale_operand(s, n, b_rows_per_scale, cfg), b_scale).shape:
        return default_config(n, k)
    return cfg


@traced_once("b_rows_per_scale", "out_dtype", "interpret", "config")
def block_scaled_matmul(a_q, a_scale, b_q, b_scale, *, b_rows_per_scale: int = 128, out_dtype=F32, interpret: bool = False,
                        config: GemmConfig | None = None, b_scale_op=None, a_scale_op=None):
    """C = A . B^T with block scales (see module doc). Any M; N, K multiples of 128.
    b_scale_op: b_scale already in the kernel's layout (`weight_scale_operand`), or None.
    a_scale_op: A's scales already in the kernel's layout (`a_scale_operand`; a_scale may then be None), or None."""
    check_operands(a_q, a_scale, b_q, b_scale, b_rows_per_scale, "gemm_dense.block_scaled_matmul")
    m, k = a_q.shape
    n = b_q.shape[0]
    cfg = config or _config_for(b_scale, b_scale_op, n, k, m, b_rows_per_scale)
    cfg.check(k, "gemm_dense.block_scaled_matmul")
    if cfg.split != "rows":
        raise ValueError(f"gemm_dense.block_scaled_matmul: split {cfg.split!r} is the grouped kernel's; the dense kernel splits rows")
    row_scales = uses_row_scales(cfg, b_rows_per_scale)
    cta_m = 2 * cfg.tile_m
    mp = -(-m // cta_m) * cta_m
    a = jnp.pad(a_q, [(0, mp - m), (0, 0)]) if mp != m else a_q
    sa_t = a_scale_operand(a_scale, a_scale_op, m, k // BLOCK_K, mp, "gemm_dense.block_scaled_matmul")
    sb_t = checked_scale_operand(b_scale, b_scale_op, n, b_rows_per_scale, cfg, "gemm_dense.block_scaled_matmul")
    kernel = functools.partial(_dense_kernel, cfg=cfg, row_scales=row_scales)
    out = launch_persistent(kernel, jax.ShapeDtypeStruct((mp, n), out_dtype), a, b_q, sa_t, sb_t, name="gemm_dense_fp8",
                            interpret=interpret)
    return out[:m]
