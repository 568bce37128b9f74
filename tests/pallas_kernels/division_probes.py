"""Probe kernels for the GPU tests of the kernels' division sequences: each runs one sequence on many millions of
operands next to div.rn.f32, so a test can compare them bit for bit."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import fragmented_array as mgpu_fa
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.exact_arith import INTERPRET, MARKSTEIN, div_mode, divide_by_rows, load_tile
from pallas_kernels.scalar_ops import MlirOps
from pallas_kernels.tile_schedules import persistent_kernel
from pallas_kernels.tiling import ROWS, TILE, TileConfig, interpret_context, resolve_interpret, swizzle_transforms

F32 = jnp.float32


def _divide_body(t, x_ref, s_ref, y_ref, *, mode):
    del t
    x = load_tile(x_ref, mode)
    s = s_ref[...] if mode == INTERPRET else plgpu.load(s_ref, layout=ROWS)
    y_ref[...] = divide_by_rows(x, s, mode=mode)


def divide_rows(x, s, *, division: str = "markstein", interpret: bool = False):
    """x [R, 128] float32 / s [R] float32 per row, with the kernels' per-value division (a test hook).

    Lets a GPU test compare the Markstein sequence with div.rn.f32 on many millions of quotients.
    """
    interpret = resolve_interpret(interpret)
    cfg = TileConfig(division=division)
    r, cols = x.shape
    if cols != 128 or r % 64 or s.shape != (r,):
        raise ValueError(f"divide_rows wants x [R, 128] and s [R] with R % 64 == 0; got {x.shape}, {s.shape}")
    rows = lambda g, t: g.at[pl.ds(t * 64, 64)]
    call = persistent_kernel(
        functools.partial(_divide_body, mode=div_mode(interpret, cfg)),
        name="divide_rows",
        out_shapes=[jax.ShapeDtypeStruct((r, cols), F32)],
        in_tiles=[((64, cols), F32, swizzle_transforms(cols, F32), rows), ((64,), F32, (), rows)],
        out_tiles=[((64, cols), F32, swizzle_transforms(cols, F32), rows)],
        ntiles=r // 64,
        cfg=cfg,
        interpret=interpret,
    )
    with interpret_context(interpret):
        (y,) = jax.jit(call)(x.astype(F32), s.astype(F32))
        return y


def _reciprocal_body(t, d_ref, fast_ref, rn_ref):
    del t
    d = load_tile(d_ref, MARKSTEIN)

    @plgpu.inline_mgpu(arg_types=(TILE,), return_type=(plgpu.ShapeDtypeStruct(d.shape, F32, TILE),) * 2)
    def both(ctx, d):
        del ctx
        o, lift = MlirOps(), mgpu_fa.FragmentedArray._lift_fast_instr
        return d._pointwise(lift(o.rcp_rn)), d._pointwise(lift(lambda v: o.div_rn(1.0, v)))

    fast, rn = both(d)
    fast_ref[...] = fast
    rn_ref[...] = rn


def reciprocals(d):
    """(the branch-free RN(1/d) of _RCP_RN_PTX, div.rn.f32(1, d)) for d [R, 128] float32 on the GPU (a test hook)."""
    r, cols = d.shape
    if cols != 128 or r % 64:
        raise ValueError(f"reciprocals wants d [R, 128] with R % 64 == 0; got {d.shape}")
    rows = lambda g, t: g.at[pl.ds(t * 64, 64)]
    tile = ((64, cols), F32, swizzle_transforms(cols, F32), rows)
    call = persistent_kernel(
        _reciprocal_body,
        name="reciprocals",
        out_shapes=[jax.ShapeDtypeStruct((r, cols), F32)] * 2,
        in_tiles=[tile],
        out_tiles=[tile, tile],
        ntiles=r // 64,
        cfg=TileConfig(),
        interpret=False,
    )
    return jax.jit(call)(d.astype(F32))
