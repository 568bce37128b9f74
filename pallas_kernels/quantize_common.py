"""Shared pieces of the quantization kernels: the exact arithmetic, tiling, and a persistent TMA pipeline.

Bitwise equality with `jaxrl_fp8.precision` rests on three rules (docs/decisions/0006-quantize-kernels.md):
- every division of the contract is correctly rounded. Pallas `/` is NOT: Mosaic lowers it to the
  approximate `div.full.f32` here (measured). Per-row divisions are the PTX instruction `div.rn.f32`
  written out (inline_mgpu); per-value divisions x / s are x * RN(1/s) plus two FMA corrections (Markstein),
  which returns the same bits at a third of the cost. In interpret mode the divisor goes through an
  optimization barrier, because XLA:CPU rewrites `a / broadcast(b)` into `a * (1 / b)`.
- the other operations are exact or correctly rounded in any order (abs, max, min, compares, bit ops,
  float32 -> fp8 round-to-nearest-even casts, one multiply), so the kernels may reduce in any order.
- no fused multiply-add outside the division sequence: no product is ever followed by an addition.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import fragmented_array as mgpu_fa
from jax.experimental.pallas import mosaic_gpu as plgpu

F32 = jnp.float32
F32_MAX = float(jnp.finfo(jnp.float32).max)
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

    def __post_init__(self):
        if self.rows is not None and (self.rows % ROW_MULTIPLE or self.rows <= 0):
            raise ValueError(f"TileConfig.rows must be a positive multiple of {ROW_MULTIPLE}, got {self.rows}")
        if self.division not in ("markstein", "div_rn", "divf"):
            raise ValueError(f"TileConfig.division must be 'markstein', 'div_rn' or 'divf', got {self.division!r}")
        if self.stages < 1 or self.ctas_per_sm < 1:
            raise ValueError(f"TileConfig.stages and ctas_per_sm must be >= 1, got {self}")


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


def num_sms(interpret: bool) -> int:
    if interpret:
        from pallas_kernels.interpret import INTERPRET_NUM_SMS  # noqa: PLC0415

        return INTERPRET_NUM_SMS
    return getattr(jax.devices()[0], "core_count", 132) or 132


def swizzle_transforms(minor_elems: int, dtype) -> tuple:
    """Tiling + swizzle for an SMEM tile whose rows are `minor_elems` of `dtype` (bank-conflict-free loads)."""
    itemsize = jnp.dtype(dtype).itemsize
    swizzle = plgpu.find_swizzle(minor_elems * itemsize * 8)
    if swizzle < 32:
        raise ValueError(f"rows of {minor_elems} x {jnp.dtype(dtype).name} are too narrow to swizzle (need >= 32 bytes)")
    return (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))


# ---------------------------------------------------------------------------------------------- arithmetic


def _ptx_div_rn(layout):
    def div(a, b):
        @plgpu.inline_mgpu(
            arg_types=(layout, layout),
            return_type=plgpu.ShapeDtypeStruct(a.shape, F32, layout),
        )
        def div_rn(ctx, a, b):
            del ctx
            return a._pointwise(mgpu_fa.FragmentedArray._lift_fast_instr("div.rn.f32"), b)

        return div_rn(a, b)

    return div


INTERPRET, PTX, DIVF, MARKSTEIN = "interpret", "ptx", "divf", "markstein"


def div_mode(interpret: bool, cfg: TileConfig) -> str:
    """How kernel bodies divide per value: interpret mode, Markstein, PTX div.rn.f32, or arith.divf."""
    if interpret:
        return INTERPRET
    return {"markstein": MARKSTEIN, "div_rn": PTX, "divf": DIVF}[cfg.division]


def ieee_div(a, b, *, layout, mode: str):
    """Correctly rounded float32 a / b (same shapes; `b` may be a scalar). Per-row / per-block use."""
    if not isinstance(b, jax.Array) or b.shape != a.shape:
        b = jnp.broadcast_to(jnp.asarray(b, F32), a.shape)
        if mode != INTERPRET:
            b = plgpu.layout_cast(b, layout)
    if mode == INTERPRET:
        return a / lax.optimization_barrier(b)
    if mode == DIVF:
        return a / b
    return _ptx_div_rn(layout)(a, b)


# q0 = x r; q1 = q0 - (s q0 - x) r; q = q1 - (s q1 - x) r, each FMA rounded once. r = RN(1/s) and q1 is
# within one ulp of x/s, so by Markstein's theorem the last step returns RN(x/s), the IEEE quotient. The
# residual is written s*q - x (not x - s*q) so that x = -0.0 gives -0.0. Valid for s positive normal or
# NaN and |x / s| < 2^126 (always true here: |x| <= amax and s >= amax / fmax).
_MARKSTEIN_PTX = """{
  .reg .f32 q, e, nx;
  mul.rn.f32 q, $1, $3;
  neg.f32 nx, $1;
  fma.rn.f32 e, $2, q, nx;
  neg.f32 e, e;
  fma.rn.f32 q, e, $3, q;
  fma.rn.f32 e, $2, q, nx;
  neg.f32 e, e;
  fma.rn.f32 $0, e, $3, q;
}"""


def _markstein_scalar(x, s, r):
    from jaxlib.mlir.dialects import llvm  # noqa: PLC0415

    return llvm.inline_asm(ir_f32(), [x, s, r], _MARKSTEIN_PTX, "=f,f,f,f")


def ir_f32():
    from jaxlib.mlir import ir  # noqa: PLC0415

    return ir.F32Type.get()


def divide_by_rows(x, s_rows, *, mode: str):
    """x [rows, cols] (TILE layout) divided by a per-row divisor s_rows [rows] (ROWS layout), IEEE-exact."""
    if mode == INTERPRET:
        return x / lax.optimization_barrier(row_broadcast(s_rows, x.shape))
    if mode != MARKSTEIN:
        return ieee_div(x, row_broadcast(s_rows, x.shape), layout=TILE, mode=mode)
    r_rows = rdiv(1.0, s_rows, layout=ROWS, mode=PTX)
    s, r = row_broadcast(s_rows, x.shape), row_broadcast(r_rows, x.shape)

    @plgpu.inline_mgpu(arg_types=(TILE, TILE, TILE), return_type=plgpu.ShapeDtypeStruct(x.shape, F32, TILE))
    def markstein(ctx, x, s, r):
        del ctx
        return x._pointwise(mgpu_fa.FragmentedArray._lift_fast_instr(_markstein_scalar), s, r)

    return markstein(x, s, r)


def row_mode(mode: str) -> str:
    """Per-row divisions (a few per tile) always use div.rn.f32, whatever the per-value method."""
    return PTX if mode == MARKSTEIN else mode


def rdiv(a, b, *, layout, mode: str):
    """Correctly rounded float32 a / b where `a` is a Python float."""
    a = jnp.broadcast_to(jnp.asarray(a, F32), b.shape)
    if mode != INTERPRET:
        a = plgpu.layout_cast(a, layout)
    return ieee_div(a, b, layout=layout, mode=row_mode(mode))


def abs_for_amax(x, mode: str):
    """|x| ready for a max reduction whose result is inf/NaN iff the group holds NaN or inf.

    On the GPU Mosaic reduces with `max.NaN.f32`, which propagates NaN, so |x| is enough. Interpret mode
    reduces with XLA:CPU, whose max may drop NaN, so there NaN is mapped to inf first.
    """
    a = jnp.abs(x)
    if mode == INTERPRET:
        a = jnp.where(a <= F32_MAX, a, jnp.inf)
    return a


def finite_or_nan(amax, floor: float):
    """The contract's block amax from max|x| (max propagates NaN): floored, and NaN if NaN or inf was seen."""
    return jnp.where(amax <= F32_MAX, jnp.maximum(amax, F32(floor)), jnp.nan)


def ceil_pow2_bits(s):
    """`jaxrl_fp8.precision.arith.ceil_pow2` for positive normal or NaN s, on the bits (exact)."""
    bits = lax.bitcast_convert_type(s, jnp.uint32)
    mantissa = bits & jnp.uint32(0x007FFFFF)
    exponent = bits & jnp.uint32(0x7F800000)
    up = lax.bitcast_convert_type(exponent + jnp.uint32(0x00800000), F32)
    out = jnp.where(mantissa == jnp.uint32(0), s, up)
    return jnp.where(s <= F32_MAX, out, s)


def e8m0_byte(s):
    """`jaxrl_fp8.precision.mx.float_to_e8m0` for positive power-of-two or NaN s."""
    byte = (lax.bitcast_convert_type(s, jnp.uint32) >> jnp.uint32(23)) & jnp.uint32(0xFF)
    return jnp.where(s <= F32_MAX, byte, jnp.uint32(255)).astype(jnp.uint8)


def row_broadcast(v, shape):
    return lax.broadcast_in_dim(v, shape, [0])


def load_tile(ref, mode: str):
    if mode == INTERPRET:
        return ref[...]
    return plgpu.load(ref, layout=TILE)


# ---------------------------------------------------------------------------------------------- pipeline


@dataclasses.dataclass(frozen=True)
class Stream:
    """One tensor the pipeline moves: its SMEM buffer and where tile t lives in GMEM."""

    gmem: object
    smem: object  # [stages, *tile]
    view: object  # (gmem_ref, tile_index) -> gmem ref slice of one tile


def run_persistent(body, *, ntiles: int, nct: int, stages: int, ins, outs, barrier):
    """Each of `nct` CTAs walks tiles c, c + nct, ... with `stages` TMA loads in flight.

    Steps past the last tile repeat the last tile (identical bytes written twice: benign), so every CTA
    runs the same static number of steps. body(tile_index, *in_smem_tiles, *out_smem_tiles).
    """
    steps = pl.cdiv(ntiles, nct)
    c = lax.axis_index("c")

    def tile(i):
        return jnp.minimum(c + i * nct, ntiles - 1)

    def fetch(i, slot):
        t = tile(i)
        for s in ins:
            plgpu.copy_gmem_to_smem(s.view(s.gmem, t), s.smem.at[slot], barrier.at[slot])

    for j in range(min(stages, steps)):
        fetch(j, j)

    @pl.loop(0, steps)
    def _step(i):
        slot = lax.rem(i, stages)
        t = tile(i)
        plgpu.barrier_wait(barrier.at[slot])
        plgpu.wait_smem_to_gmem(stages - 1, wait_read_only=True)  # this slot's previous store has read SMEM
        body(t, *(s.smem.at[slot] for s in ins), *(s.smem.at[slot] for s in outs))
        plgpu.commit_smem()  # fence + warpgroup barrier: SMEM writes visible to TMA, SMEM reads done
        for s in outs:
            plgpu.copy_smem_to_gmem(s.smem.at[slot], s.view(s.gmem, t), commit_group=False)
        plgpu.commit_smem_to_gmem_group()

        @pl.when(i + stages < steps)
        def _refill():
            fetch(i + stages, slot)

    plgpu.wait_smem_to_gmem(0)


def persistent_kernel(body, *, name, out_shapes, in_tiles, out_tiles, ntiles, cfg: TileConfig, interpret,
                      n_extra_in: int = 0, extra_out=()):
    """Builds a plgpu.kernel over a persistent grid that streams tiles through SMEM.

    in_tiles / out_tiles: (tile_shape, dtype, transforms, view) per streamed tensor; view(gmem_ref, t) is tile t.
    The kernel's arguments are the streamed inputs then `n_extra_in` whole-GMEM inputs; its outputs are
    `out_shapes` (streamed) then `extra_out` (whole-GMEM, written by the body directly).
    body(t, *in_smem_tiles, *out_smem_tiles, *extra_in_gmem, *extra_out_gmem) computes tile t.
    """
    stages = cfg.stages
    tile_bytes = sum(math.prod(shape) * jnp.dtype(dtype).itemsize for shape, dtype, _, _ in (*in_tiles, *out_tiles))
    resident = max(1, min(cfg.ctas_per_sm, SMEM_PER_SM // (stages * tile_bytes + SMEM_RESERVE)))
    nct = max(1, min(ntiles, num_sms(interpret) * resident))
    stages = max(1, min(stages, pl.cdiv(ntiles, nct)))
    smem = [plgpu.SMEM((stages, *shape), dtype, transforms=tr) for shape, dtype, tr, _ in (*in_tiles, *out_tiles)]
    barrier = plgpu.Barrier(num_arrivals=len(in_tiles), num_barriers=stages)
    n_in, n_out, n_xout = len(in_tiles), len(out_tiles), len(extra_out)

    def kernel(*refs):
        gmem_in, refs = refs[:n_in], refs[n_in:]
        extra_in, refs = refs[:n_extra_in], refs[n_extra_in:]
        gmem_out, refs = refs[:n_out], refs[n_out:]
        extra_gmem_out, refs = refs[:n_xout], refs[n_xout:]
        smem_refs, bar = refs[: len(smem)], refs[len(smem)]
        ins = [Stream(g, s, v[3]) for g, s, v in zip(gmem_in, smem_refs[:n_in], in_tiles)]
        outs = [Stream(g, s, v[3]) for g, s, v in zip(gmem_out, smem_refs[n_in:], out_tiles)]
        run_persistent(
            functools.partial(_call_body, body, (*extra_in, *extra_gmem_out)),
            ntiles=ntiles, nct=nct, stages=stages, ins=ins, outs=outs, barrier=bar,
        )

    return plgpu.kernel(
        kernel,
        out_type=(*out_shapes, *extra_out),
        grid=(nct,),
        grid_names=("c",),
        scratch_types=(*smem, barrier),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        kernel_name=name,
    )


def _call_body(body, extra, t, *tiles):
    body(t, *tiles, *extra)


# ---------------------------------------------------------------------------------------------- test hook


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
