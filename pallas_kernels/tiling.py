"""How the quantization kernels tile a tensor: the tile configuration, register layouts, SM and interpret-mode facts.

Shared by every quantization kernel (FP8, MXFP8, NVFP4): `TileConfig` is the knob benchmarks sweep, the layouts are
how a tile sits in registers (the wgmma layout, or one whole row per thread).
"""

from __future__ import annotations

import contextlib
import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

# Register layouts: a [rows, cols] tile in the wgmma layout (64-row slabs, 2 adjacent columns per
# register) and a per-row vector of it (the result of reducing along columns).
TILE = plgpu.Layout.WGMMA
ROWS = plgpu.Layout.WGMMA.reduce(1)
ROW_MULTIPLE = 64  # the wgmma layout tiles rows in slabs of 64
# Flat [R, group] views are padded to a multiple of 16 rows: TMA's tiled view needs 8, and 1-D outputs
# (scales, packed bytes) are stored with cp.async.bulk, whose clipped tail must stay a multiple of 16 bytes.
ROW_PAD = 16
TILE_VALUES = 8192  # default values per tile: 64 float32 registers per thread of one warpgroup
SMEM_PER_SM = 228 * 1024  # H100/H200: 228 KiB of shared memory per SM (227 KiB usable by one CTA)
SMEM_RESERVE = 4 * 1024  # barriers, reduction scratch, alignment


SCHEDULES = ("static", "dynamic")


@dataclasses.dataclass(frozen=True)
class TileConfig:
    """How a kernel walks its tensor: `rows` x group tiles, `stages` TMA buffers, CTAs per SM."""

    rows: int | None = None  # None: 8192 // group rows (a [64, 128] tile; narrow groups get taller tiles)
    stages: int = 2
    ctas_per_sm: int = 2
    # How x / s is computed per value (per-row and per-block divisions are always PTX div.rn.f32):
    #   "markstein": q = x * r with r = div.rn(1, s) per row, then two FMA corrections: exactly div.rn
    #                (Markstein's theorem; checked against div.rn on the GPU), at a third of its cost;
    #   "div_rn":    the PTX instruction div.rn.f32 per value;
    #   "divf":      MLIR arith.divf, which LLVM lowers to div.full.f32 here (approximate: NOT bitwise;
    #                kept only to measure what exact division costs).
    division: str = "markstein"
    # Which tiles a CTA takes (GPU only; interpret mode always walks the static order, same bits either way):
    #   "static":  CTA c walks c, c + nct, c + 2 nct, ... (every CTA the same number of steps);
    #   "dynamic": after its first `stages` tiles (static), a CTA takes the next tile from an atomic counter
    #              in GMEM, so CTAs that started late or run slower take fewer tiles (see run_dynamic).
    schedule: str = "static"
    # Pallas' automatic barriers (CompilerParams.unsafe_no_auto_barriers): on, every copy_gmem_to_smem and every Pallas
    # ref store carries CTA barriers (four extra per tile in the FP8 and MXFP8 bodies); off, the pipeline's own
    # barriers are the only ones (enough for these bodies: see run_persistent). GPU only; the bits don't change.
    auto_barriers: bool = True

    def __post_init__(self):
        if self.rows is not None and (self.rows % ROW_MULTIPLE or self.rows <= 0):
            raise ValueError(f"TileConfig.rows must be a positive multiple of {ROW_MULTIPLE}, got {self.rows}")
        if self.division not in ("markstein", "div_rn", "divf"):
            raise ValueError(f"TileConfig.division must be 'markstein', 'div_rn' or 'divf', got {self.division!r}")
        if self.stages < 1 or self.ctas_per_sm < 1:
            raise ValueError(f"TileConfig.stages and ctas_per_sm must be >= 1, got {self}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"TileConfig.schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if not isinstance(self.auto_barriers, bool):
            raise ValueError(f"TileConfig.auto_barriers must be True or False, got {self.auto_barriers!r}")
        if self.schedule == "dynamic" and self.stages < 2:
            raise ValueError(f"TileConfig.schedule='dynamic' needs stages >= 2 (a tile's index is published one "
                             f"pipeline step before it is read), got {self}")


def tile_rows(cfg: TileConfig, group: int) -> int:
    """Rows per tile: the configured value, or enough rows of `group` values for 8192 values per tile."""
    if cfg.rows is not None:
        return cfg.rows
    return max(ROW_MULTIPLE, TILE_VALUES // group)


def interpret_forced() -> bool:
    """True inside `pallas_kernels.interpret.gpu_interpret_mode()` (then kernels must trace their CPU form)."""
    from jax._src import config  # noqa: PLC0415  (private: the flag force_gpu_interpret_mode sets)

    return config.pallas_tpu_interpret_mode_context_manager.value is not None


def resolve_interpret(interpret: bool) -> bool:
    return bool(interpret) or interpret_forced()


def interpret_context(interpret: bool):
    if not interpret:
        return contextlib.nullcontext()
    from pallas_kernels.interpret import gpu_interpret_mode  # noqa: PLC0415

    return gpu_interpret_mode()


def swizzle_transforms(minor_elems: int, dtype) -> tuple:
    """Tiling + swizzle for an SMEM tile whose rows are `minor_elems` of `dtype` (bank-conflict-free loads)."""
    itemsize = jnp.dtype(dtype).itemsize
    swizzle = plgpu.find_swizzle(minor_elems * itemsize * 8)
    if swizzle < 32:
        raise ValueError(f"rows of {minor_elems} x {jnp.dtype(dtype).name} are too narrow to swizzle (need >= 32 bytes)")
    return (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))


# The wgmma layout spreads a narrow row (16 or 32 values) over 4 lanes, so every per-row step (shuffle
# reduction, the div.rn chain, the scale byte) is done by 4 threads for 4 or 8 values each. ROW_LAYOUT gives
# each thread whole rows instead: thread t of the warpgroup holds row t of every 128-row slab, in registers
# of 16 bytes (8 bf16 / 4 f32 values: the widest vector Mosaic moves through a swizzled SMEM tile). A row's
# amax is then a chain of in-thread max instructions, and each per-row step runs once per row per thread.
# With the TMA swizzle the 16-byte loads of 8 consecutive threads fall in 8 distinct bank quads.


SLAB_ROWS = 128  # rows of one row_layout slab: one row per thread of the warpgroup


def row_layout(group: int, dtype):
    """[rows, group] tile layout: one row per thread (rows t, t + 128, ...), vectors of 16 bytes."""
    vec = 16 // jnp.dtype(dtype).itemsize
    if group % vec:
        raise ValueError(f"row_layout: group {group} is not a multiple of {vec} {jnp.dtype(dtype).name} values")
    return plgpu.Layout.TILED(plgpu.Tiling(((128, group), (32, group), (vec,))), warp_dims=(-5,), lane_dims=(-3,),
                              vector_dim=-1)
