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
    if mode == INTERPRET:  # both fenced: XLA would rewrite (a / b) / c into a / (b * c) (precision.arith.ieee_div)
        return lax.optimization_barrier(a) / lax.optimization_barrier(b)
    if mode == DIVF:
        return a / b
    return _ptx_div_rn(layout)(a, b)


# q0 = x r; q1 = q0 - (s q0 - x) r; q = q1 - (s q1 - x) r, each FMA rounded once. r = RN(1/s) and q1 is
# within one ulp of x/s, so by Markstein's theorem the last step returns RN(x/s), the IEEE quotient. The
# residual is written s*q - x (not x - s*q) so that x = -0.0 gives -0.0. Valid for s positive normal or
# NaN and |x / s| < 2^126 (always true here: |x| <= amax and s >= amax / fmax).
# One correction (NVFP4 v4 / v5): q0 = x * r; e = x - q0 * d; q1 = q0 + e * r. With r = RN(1/d) it is RN(x / d) for
# every float32 x and d while nothing overflows or underflows, shown in exact integer arithmetic by
# experiments/checks/nvfp4_formulas.py (results/nvfp4_formulas_cpu.json): exhaustively for bfloat16 x (all
# 2^7 x 2^23 significand pairs), and for float32 x over every pair whose quotient lies close enough to a rounding
# midpoint for the correction's error (< 2^-22 ulp) to matter (87 million pairs; no other pair can differ).
def _markstein_ptx(corrections: int) -> str:
    """The quotient sequence above with `corrections` residual steps ($0 = $1 / $2 given $3 = RN(1/$2))."""
    step = "  fma.rn.f32 e, $2, q, nx;\n  neg.f32 e, e;\n  fma.rn.f32 {out}, e, $3, q;\n"
    body = "".join(step.format(out="$0" if i == corrections - 1 else "q") for i in range(corrections))
    return "{\n  .reg .f32 q, e, nx;\n  mul.rn.f32 q, $1, $3;\n  neg.f32 nx, $1;\n" + body + "}"


_MARKSTEIN_ONCE_PTX = _markstein_ptx(1)
_MARKSTEIN_PTX = _markstein_ptx(2)


# RN(1/d) without div.rn's slow-path branch (NVFP4 v5, per row): the hardware estimate, one Newton step (its error
# squared: far inside 1 ulp), then one Markstein correction e = 1 - d r, r' = r + e r, which gives RN(1/d) from any
# estimate within 1 ulp for every float32 significand but the all-ones one (checked exhaustively in integers for
# both estimates within 1 ulp of each of the 2^23 significands: experiments/checks/nvfp4_formulas.py). For
# d = 2^k (2 - 2^-23), RN(1/d) = 2^-(k+1) (1 + 2^-23): bits ((253 << 23) - exponent bits of d) | 1. Valid for
# positive normal d with a normal reciprocal (d < 2^126); NVFP4's per-row d lies in [7e-17, 6e37].
_RCP_RN_PTX = """{
  .reg .f32 r, e, nd, f;
  .reg .b32 b, m, x;
  .reg .pred p;
  rcp.approx.f32 r, $1;
  neg.f32 nd, $1;
  fma.rn.f32 e, nd, r, 0f3F800000;
  fma.rn.f32 r, e, r, r;
  fma.rn.f32 e, nd, r, 0f3F800000;
  fma.rn.f32 r, e, r, r;
  mov.b32 b, $1;
  and.b32 m, b, 0x007FFFFF;
  setp.eq.u32 p, m, 0x007FFFFF;
  and.b32 x, b, 0x7F800000;
  sub.u32 x, 0x7E800000, x;
  or.b32 x, x, 1;
  mov.b32 f, x;
  selp.f32 $0, f, r, p;
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


def pow2_reciprocal_bits(s):
    """1/s for s a positive normal power of two 2^k (|k| <= 126) or NaN, from the bits: exactly RN(1/s).

    bits(2^-k) = (254 - E) << 23 = 0x7F000000 - bits(s) (E the biased exponent, mantissa 0); NaN stays NaN.
    """
    bits = lax.bitcast_convert_type(s, jnp.uint32)
    inv = lax.bitcast_convert_type(jnp.uint32(0x7F000000) - bits, F32)
    return jnp.where(s <= F32_MAX, inv, s)


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


def _fetch(ins, t, slot, barrier) -> None:
    """TMA loads of tile t of every streamed input into pipeline slot `slot`, completing on that slot's barrier."""
    for s in ins:
        plgpu.copy_gmem_to_smem(s.view(s.gmem, t), s.smem.at[slot], barrier.at[slot])


def _store_tile(t, slot, outs, stages: int) -> None:
    """Every thread's SMEM writes of the slot made visible to TMA (fence + CTA barrier), then tile t stored; then the
    storing thread waits until the store issued stages - 1 steps ago has read its buffers, which the next step
    writes. The caller follows this with a CTA barrier (a refill's `copy_gmem_to_smem` has one), so no thread writes
    those buffers before that wait: bulk-copy groups belong to the thread that issued them."""
    plgpu.commit_smem()  # fence + warpgroup barrier: SMEM writes visible to TMA, SMEM reads done
    for s in outs:
        plgpu.copy_smem_to_gmem(s.smem.at[slot], s.view(s.gmem, t), commit_group=False)
    plgpu.commit_smem_to_gmem_group()
    plgpu.wait_smem_to_gmem(stages - 1, wait_read_only=True)


def run_persistent(body, *, ntiles: int, nct: int, stages: int, ins, outs, barrier, auto_barriers: bool = True):
    """Each of `nct` CTAs walks tiles c, c + nct, ... with `stages` TMA loads in flight.

    Steps past the last tile repeat the last tile (identical bytes written twice: benign), so every CTA
    runs the same static number of steps. body(tile_index, *in_smem_tiles, *out_smem_tiles).
    Barriers each step needs, and where they are: all SMEM writes before the TMA store and all reads of the input
    slot before its refill (commit_smem in _store_tile); the storing thread's wait for the old store before any
    thread writes that store's buffers again (the barrier that closes the step: the refill's automatic one, or an
    explicit one). Bodies need none of their own: they read their input slot and write their output slots only
    (Mosaic's cross-warp reductions bring their own barriers).
    """
    steps = pl.cdiv(ntiles, nct)
    c = lax.axis_index("c")

    def tile(i):
        return jnp.minimum(c + i * nct, ntiles - 1)

    def fetch(i, slot):
        _fetch(ins, tile(i), slot, barrier)

    for j in range(min(stages, steps)):
        fetch(j, j)

    @pl.loop(0, steps)
    def _step(i):
        slot = lax.rem(i, stages)
        t = tile(i)
        plgpu.barrier_wait(barrier.at[slot])
        body(t, *(s.smem.at[slot] for s in ins), *(s.smem.at[slot] for s in outs))
        _store_tile(t, slot, outs, stages)
        refill = i + stages < steps

        @pl.when(refill)
        def _refill():
            fetch(i + stages, slot)  # with automatic barriers, copy_gmem_to_smem starts with a CTA barrier

        if auto_barriers:
            @pl.when(jnp.logical_not(refill))
            def _sync():
                plgpu.commit_smem()  # the CTA barrier a refill would have given (see _store_tile)
        else:
            plgpu.commit_smem()  # the step's closing CTA barrier (see _store_tile)

    plgpu.wait_smem_to_gmem(0)


_TICKET_LAYOUT = plgpu.Layout.WG_SPLAT((128,))  # one i32 register per thread; only thread 0's holds the ticket


def _take_ticket(counter_gmem):
    """Thread 0 of the CTA issues an atomic add on the GMEM counter; returns its ticket (valid in thread 0 only).

    The atomic is predicated, not branched around, so no join copies the result: thread 0 waits for it only
    where `_publish_tile` stores it, a whole tile of work later.
    """

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),),
                       return_type=plgpu.ShapeDtypeStruct((128,), jnp.int32, _TICKET_LAYOUT))
    def take(ctx, counter):
        del ctx
        from jax.experimental.mosaic.gpu import fragmented_array as fa, utils as mgpu_utils  # noqa: PLC0415
        from jaxlib.mlir import ir  # noqa: PLC0415
        from jaxlib.mlir.dialects import arith, llvm  # noqa: PLC0415

        i32 = ir.IntegerType.get_signless(32)
        first_thread = arith.extui(i32, arith.cmpi(arith.CmpIPredicate.eq, mgpu_utils.thread_idx(),
                                                   arith.constant(i32, 0)))
        ticket = llvm.inline_asm(
            i32, [mgpu_utils.memref_ptr(counter), first_thread],
            "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p atom.add.u32 $0, [$1], 1; }", "=r,l,r",
            has_side_effects=True)
        return fa.FragmentedArray.splat(ticket, (128,), layout=_TICKET_LAYOUT.to_mgpu(), is_signed=True)

    return take(counter_gmem)


def _publish_tile(ticket, id_smem, first: int):
    """Thread 0 writes tile `first + ticket` to id_smem[0]; then warp 0 agrees on it (bar.warp.sync).

    The TMA load of that tile is issued by warp 0's elected lane from the value read back right after, so every lane
    of warp 0 must see the write. The other warps read the slot for their own use only after the next CTA barrier.
    """

    @plgpu.inline_mgpu(arg_types=(_TICKET_LAYOUT, plgpu.RefType()))
    def publish(ctx, ticket, slot):
        del ctx
        from jax.experimental.mosaic.gpu import utils as mgpu_utils  # noqa: PLC0415
        from jaxlib.mlir import ir  # noqa: PLC0415
        from jaxlib.mlir.dialects import arith, llvm, memref, scf  # noqa: PLC0415

        i32 = ir.IntegerType.get_signless(32)
        value = arith.addi(ticket.registers.flat[0], arith.constant(i32, first))
        first_thread = arith.cmpi(arith.CmpIPredicate.eq, mgpu_utils.thread_idx(), arith.constant(i32, 0))
        branch = scf.IfOp(first_thread)
        with ir.InsertionPoint(branch.then_block):
            memref.store(value, slot, [arith.constant(ir.IndexType.get(), 0)])
            scf.yield_([])
        llvm.inline_asm(None, [], "bar.warp.sync -1;", "", has_side_effects=True)

    publish(ticket, id_smem)


def run_dynamic(body, *, ntiles: int, nct: int, stages: int, ins, outs, barrier, counter, ids,
                auto_barriers: bool = True):
    """Like run_persistent, but after its first `stages` tiles (c + j nct, static) a CTA takes tiles from `counter`.

    Why: the grid is `ctas_per_sm` x SMs CTAs, and when fewer fit on an SM at once (registers, SMEM) the rest run
    in a second, partial wave; with equal static shares the SMs then finish far apart (Nsight Compute: 18-23 % of
    the kernel's cycles the average SM idles, decision record 0006). With a shared counter a CTA that starts late
    simply takes fewer tiles.

    Order of events for the tile of step i + stages (stages >= 2): thread 0 takes a ticket before computing tile i
    (the atomic's latency hides behind the tile), and after step i's CTA-wide barrier (commit_smem) writes the tile
    to ids[slot]; warp 0 reads it back and issues its TMA load; every thread reads ids[slot] again after the barrier
    of step i + stages - 1, which follows the write. The other warps may still see the slot's old index when the load
    is issued, so the load is issued unconditionally (an index past the end loads the last tile again): with Pallas'
    automatic barriers `copy_gmem_to_smem` contains a CTA barrier, which every warp must reach. Tickets are taken in
    step order, so a CTA's tiles increase and its first tile past the end ends its loop; the `stages` loads still in
    flight then (each a repeat of the last tile) are waited for before the CTA exits, so none lands in SMEM that the
    next CTA on the SM already owns.
    """
    c = lax.axis_index("c")
    first = stages * nct
    last = ntiles - 1

    def fetch(t, slot):
        _fetch(ins, jnp.minimum(t, last), slot, barrier)

    for j in range(stages):
        fetch(c + j * nct, j)

    def step(carry):
        i, t = carry
        slot = lax.rem(i, stages)
        plgpu.barrier_wait(barrier.at[slot])
        ticket = _take_ticket(counter)  # in flight while the tile is computed
        body(t, *(s.smem.at[slot] for s in ins), *(s.smem.at[slot] for s in outs))
        _store_tile(t, slot, outs, stages)
        _publish_tile(ticket, ids.at[pl.ds(slot, 1)], first)
        fetch(ids[slot], slot)  # the tile of step i + stages (warp 0 issues it, from the index it just published)
        if not auto_barriers:
            plgpu.commit_smem()  # the step's closing CTA barrier (see _store_tile)
        nxt = i + 1
        t_next = jnp.where(nxt < stages, c + nxt * nct, ids[lax.rem(nxt, stages)])
        return nxt, t_next

    done, _ = lax.while_loop(lambda carry: carry[1] < ntiles, step, (jnp.int32(0), c))
    for j in range(stages):  # drain: the loads of steps done .. done + stages - 1 were issued and never consumed
        plgpu.barrier_wait(barrier.at[lax.rem(done + j, stages)])
    plgpu.wait_smem_to_gmem(0)


def persistent_kernel(body, *, name, out_shapes, in_tiles, out_tiles, ntiles, cfg: TileConfig, interpret,
                      n_extra_in: int = 0, extra_out=(), prologue=None, prologue_scratch=()):
    """Builds a plgpu.kernel over a persistent grid that streams tiles through SMEM.

    in_tiles / out_tiles: (tile_shape, dtype, transforms, view) per streamed tensor; view(gmem_ref, t) is tile t.
    The kernel's arguments are the streamed inputs then `n_extra_in` whole-GMEM inputs; its outputs are
    `out_shapes` (streamed) then `extra_out` (whole-GMEM, written by the body directly).
    body(t, *in_smem_tiles, *out_smem_tiles, *extra_in_gmem, *extra_out_gmem) computes tile t.
    prologue(*extra_in_gmem, *extra_out_gmem, *scratch_refs), if given, runs once per CTA before the first tile; what
    it returns is passed to every body call as one more trailing argument (loop-invariant values, e.g. a scale for
    every tile, or an SMEM table it filled: `prologue_scratch` are the SMEM buffers it gets, e.g. plgpu.SMEM(...)).
    """
    stages = cfg.stages
    tile_bytes = sum(math.prod(shape) * jnp.dtype(dtype).itemsize for shape, dtype, _, _ in (*in_tiles, *out_tiles))
    resident = max(1, min(cfg.ctas_per_sm, SMEM_PER_SM // (stages * tile_bytes + SMEM_RESERVE)))
    nct = max(1, min(ntiles, num_sms(interpret) * resident))
    stages = max(1, min(stages, pl.cdiv(ntiles, nct)))
    dynamic = cfg.schedule == "dynamic" and not interpret  # the interpreter can't run the inline atomic
    if dynamic:
        stages = max(2, stages)
    smem = [plgpu.SMEM((stages, *shape), dtype, transforms=tr) for shape, dtype, tr, _ in (*in_tiles, *out_tiles)]
    if dynamic:
        smem.append(plgpu.SMEM((stages,), jnp.int32))  # the tile index of each pipeline slot
    n_stream_smem = len(smem)
    smem += list(prologue_scratch)
    barrier = plgpu.Barrier(num_arrivals=len(in_tiles), num_barriers=stages)
    n_in, n_out, n_xout, n_counter = len(in_tiles), len(out_tiles), len(extra_out), int(dynamic)

    def kernel(*refs):
        gmem_in, refs = refs[:n_in], refs[n_in:]
        extra_in, refs = refs[:n_extra_in], refs[n_extra_in:]
        counter, refs = refs[:n_counter], refs[n_counter:]
        gmem_out, refs = refs[:n_out], refs[n_out:]
        extra_gmem_out, refs = refs[:n_xout], refs[n_xout:]
        smem_refs, pro_refs, bar = refs[:n_stream_smem], refs[n_stream_smem: len(smem)], refs[len(smem)]
        ins = [Stream(g, s, v[3]) for g, s, v in zip(gmem_in, smem_refs[:n_in], in_tiles)]
        outs = [Stream(g, s, v[3]) for g, s, v in zip(gmem_out, smem_refs[n_in:], out_tiles)]
        extra = (*extra_in, *extra_gmem_out)
        run = functools.partial(_call_body, body, extra if prologue is None else (*extra, prologue(*extra, *pro_refs)))
        if dynamic:
            run_dynamic(run, ntiles=ntiles, nct=nct, stages=stages, ins=ins, outs=outs, barrier=bar,
                        counter=counter[0], ids=smem_refs[-1], auto_barriers=cfg.auto_barriers)
        else:
            run_persistent(run, ntiles=ntiles, nct=nct, stages=stages, ins=ins, outs=outs, barrier=bar,
                           auto_barriers=cfg.auto_barriers)

    call = plgpu.kernel(
        kernel,
        out_type=(*out_shapes, *extra_out),
        grid=(nct,),
        grid_names=("c",),
        scratch_types=(*smem, barrier),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane,
                                             unsafe_no_auto_barriers=not cfg.auto_barriers),
        kernel_name=name + ("_dyn" if dynamic else ""),
    )
    if not dynamic:
        return call

    def with_counter(*args):
        # A fresh zeroed counter per call, passed as a mutable ref (XLA aliases it into the kernel: no stale
        # tickets from an earlier call). 16 bytes: the smallest GMEM allocation Mosaic aligns for. The zeros are
        # made to depend on the input (its first element's bits AND 0), so that partial evaluation (jax.checkpoint
        # and scan under jax.grad) keeps the ref's creation on the kernel's side: a ref can't be a residual.
        first = args[0].reshape(-1)[:1].astype(F32)
        zeros = jnp.zeros((4,), jnp.int32) + (lax.bitcast_convert_type(first, jnp.int32) & 0)
        return call(*args, jax.new_ref(zeros))

    return with_counter


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


# ---------------------------------------------------------------------------------------------- row-per-thread
# (additive: the "v2" NVFP4 / MXFP8 kernels; nothing above uses these.)
#
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


class MlirOps:
    """Scalar MLIR builders for inline_mgpu bodies (i32 / f32 values), mirroring the jnp forms of `JnpOps`."""

    def __init__(self):
        from jaxlib.mlir import ir  # noqa: PLC0415
        from jaxlib.mlir.dialects import arith, llvm, math as mmath  # noqa: PLC0415

        self.ir, self.arith, self.llvm, self.math = ir, arith, llvm, mmath
        self.i32 = ir.IntegerType.get_signless(32)
        self.i16 = ir.IntegerType.get_signless(16)
        self.i8 = ir.IntegerType.get_signless(8)
        self.f32 = ir.F32Type.get()

    def u(self, v: int):
        return self.arith.constant(self.i32, ir_int(v))

    def f(self, v: float):
        return self.arith.constant(self.f32, float(v))

    def bits(self, x):
        return self.arith.bitcast(self.i32, x)

    def float(self, b):
        return self.arith.bitcast(self.f32, b)

    def and_(self, a, b):
        return self.arith.andi(a, self._c(b))

    def or_(self, a, b):
        return self.arith.ori(a, self._c(b))

    def shr(self, a, n: int):
        return self.arith.shrui(a, self.u(n))

    def shl(self, a, n: int):
        return self.arith.shli(a, self.u(n))

    def add(self, a, b):
        return self.arith.addi(a, self._c(b))

    def sub(self, a, b):
        return self.arith.subi(a, self._c(b))

    def select(self, c, a, b):
        return self.arith.select(c, self._c(a), self._c(b))

    def fmax(self, a, b):  # NaN-propagating (max.NaN.f32), like jnp.maximum
        return self.arith.maximumf(a, self._cf(b))

    def fmin(self, a, b):
        return self.arith.minimumf(a, self._cf(b))

    def fmin_num(self, a, b):
        """PTX min.f32: the non-NaN operand when one is NaN (not minimumf's NaN)."""
        return self.arith.minnumf(a, self._cf(b))

    def fmax_num(self, a, b):
        return self.arith.maxnumf(a, self._cf(b))

    def fma(self, a, b, c):
        """fma.rn.f32 a * b + c, one rounding (inline PTX so LLVM cannot split or reassociate it)."""
        return self.asm(self.f32, [self._cf(a), self._cf(b), self._cf(c)], "fma.rn.f32 $0, $1, $2, $3;",
                        "=f,f,f,f")

    def fle(self, a, b):
        return self.arith.cmpf(self.arith.CmpFPredicate.OLE, a, self._cf(b))

    def fgt(self, a, b):
        return self.arith.cmpf(self.arith.CmpFPredicate.OGT, a, self._cf(b))

    def fselect(self, c, a, b):
        return self.arith.select(c, self._cf(a), self._cf(b))

    def abs(self, x):
        return self.math.absf(x)

    def mul(self, a, b):
        return self.arith.mulf(a, self._cf(b))

    def asm(self, ret, args, text, constraints):
        return self.llvm.inline_asm(ret, list(args), text, constraints)

    def div_rn(self, a, b):
        """IEEE a / b: the PTX instruction div.rn.f32 (not arith.divf, which lowers to div.full.f32 here)."""
        return self.asm(self.f32, [self._cf(a), self._cf(b)], "div.rn.f32 $0, $1, $2;", "=f,f,f")

    def rcp_rn(self, d):
        """RN(1/d) without a branch (see _RCP_RN_PTX for the range)."""
        return self.asm(self.f32, [d], _RCP_RN_PTX, "=f,f")

    def markstein_once(self, x, s, r):
        """x / s with one correction (see _MARKSTEIN_ONCE_PTX for when it is RN(x / s))."""
        return self.asm(self.f32, [x, s, r], _MARKSTEIN_ONCE_PTX, "=f,f,f,f")

    def prmt(self, a, b, sel: int):
        """PTX prmt.b32 (byte permute of {b, a}; a selector nibble's bit 3 replicates the byte's sign bit)."""
        return self.asm(self.i32, [a, b], f"prmt.b32 $0, $1, $2, {sel:#x};", "=r,r,r")

    def cvt_f8x2(self, hi, lo, name: str):
        """RNE satfinite cast of two float32 to one fp8 pair (lo in the low byte), as an i32 (upper 16 bits 0)."""
        h = self.asm(self.i16, [hi, lo], f"cvt.rn.satfinite.{name}x2.f32 $0, $1, $2;", "=h,f,f")
        return self.arith.extui(self.i32, h)

    def e4m3_to_f32(self, byte32):
        """float32 of the e4m3 byte in the low 8 bits of an i32 (exact: through f16, as Mosaic's astype)."""
        h = self.arith.trunci(self.i16, byte32)
        text = ("{ .reg .b32 t; .reg .f16 lo, hi; cvt.rn.f16x2.e4m3x2 t, $1; mov.b32 {lo, hi}, t; "
                "cvt.f32.f16 $0, lo; }")
        return self.asm(self.f32, [h], text, "=f,h")

    def _c(self, v):
        return self.u(v) if isinstance(v, int) else v

    def _cf(self, v):
        return self.f(v) if isinstance(v, float) else v


def splat_scalar(v):
    """The scalar ir.Value behind an inline_mgpu argument that Pallas passed as a splat FragmentedArray."""
    if isinstance(v, mgpu_fa.FragmentedArray):
        from jaxlib.mlir import ir  # noqa: PLC0415
        from jaxlib.mlir.dialects import vector  # noqa: PLC0415

        v = v.registers.flat[0]
        if isinstance(v.type, ir.VectorType):
            v = vector.extract(v, dynamic_position=[], static_position=ir.DenseI64ArrayAttr.get([0]))
    return v


def ir_int(v: int) -> int:
    """A Python int as the signed 32-bit value MLIR's i32 attribute wants."""
    v &= 0xFFFFFFFF
    return v - (1 << 32) if v >= 1 << 31 else v


class JnpOps:
    """The same operations on jnp uint32 / float32 arrays (interpret mode, and tests of the formulas)."""

    u = staticmethod(lambda v: jnp.uint32(v))
    f = staticmethod(lambda v: F32(v))
    bits = staticmethod(lambda x: lax.bitcast_convert_type(x, jnp.uint32))
    float = staticmethod(lambda b: lax.bitcast_convert_type(b, F32))
    and_ = staticmethod(lambda a, b: a & jnp.uint32(b))
    or_ = staticmethod(lambda a, b: a | jnp.uint32(b) if isinstance(b, int) else a | b)
    shr = staticmethod(lambda a, n: a >> jnp.uint32(n))
    shl = staticmethod(lambda a, n: a << jnp.uint32(n))
    add = staticmethod(lambda a, b: a + (jnp.uint32(b) if isinstance(b, int) else b))
    sub = staticmethod(lambda a, b: a - (jnp.uint32(b) if isinstance(b, int) else b))
    fmin_num = staticmethod(lambda a, b: jnp.fmin(a, F32(b)))  # NaN-ignoring, as PTX min.f32
    fmax_num = staticmethod(lambda a, b: jnp.fmax(a, F32(b)))
    abs = staticmethod(jnp.abs)

    @staticmethod
    def prmt(a, b, sel: int):
        """PTX prmt.b32 in its default mode: output byte k is byte (sel >> 4k) & 7 of {b, a} (a = bytes 0-3), or,
        when the nibble's bit 3 is set, that byte's bit 7 replicated over all eight bits."""
        out = jnp.zeros_like(a)
        for k in range(4):
            nib = (sel >> (4 * k)) & 0xF
            src = a if (nib & 7) < 4 else b
            byte = (src >> jnp.uint32(8 * (nib & 3))) & jnp.uint32(0xFF)
            if nib & 8:
                byte = jnp.where(byte >= 0x80, jnp.uint32(0xFF), jnp.uint32(0))
            out = out | (byte << jnp.uint32(8 * k))
        return out

    @staticmethod
    def fma(a, b, c):
        """a * b + c for the exact products the formulas use (b a power of two): one rounding, as fma.rn.f32."""
        return a * F32(b) + c



# What `e2m1_magnitude_biased` adds to every magnitude; a word of eight carries it times 0x11111111 (mod 2^32).
E2M1_BIAS = 0x0B0000FE
E2M1_WORD_BIAS = (E2M1_BIAS * 0x11111111) & 0xFFFFFFFF


def e2m1_magnitude_biased(y, ops):
    """E2M1 magnitude code of min(|y|, 6), round-to-nearest-even, plus E2M1_BIAS (mod 2^32): 6 instructions.

    One magic add for every binade instead of a comparison per E2M1 threshold: with P = 2^max(e, 0) (e the
    exponent of a = min(|y|, 6); P in {1, 2, 4}), s = a + P * 2^22 rounds a to a multiple of P / 2, ties to even,
    which is the E2M1 grid spacing of a's binade (0.5 below 2, then 1, then 2). bits(s) - bits(P) is then
    bits(2^22) - bits(1) + n with n = a / (P / 2) rounded (0..4 for P = 1, 2..4 for P = 2, 2..3 for P = 4), and
    the code is n + 2e = n + (bits(P) >> 22) - 254; the constants are E2M1_BIAS, removed once per word.
    a = min(|y|, 6) with PTX min.f32 semantics: a NaN y (the Markstein quotient past float32 max) gives 6, code 7.
    """
    a = ops.fmin_num(ops.abs(y), 6.0)
    p = ops.and_(ops.bits(ops.fmax_num(a, 1.0)), 0x7F800000)
    s = ops.fma(ops.float(p), 4194304.0, a)  # P * 2^22 is exact; one rounding of the sum
    return ops.add(ops.sub(ops.bits(s), p), ops.shr(p, 22))


# ------------------------------------------------------------------------------------- NVFP4 v6 forms
# The v4 word with shorter dependency chains (the kernel is latency-bound, docs/decisions/0006): magnitudes summed
# as a tree instead of one running sum, and the eight signs gathered into one word apart from the magnitudes. For
# bfloat16 input the signs come straight from the raw bf16x2 registers with four byte permutes (PRMT's
# sign-replicate mode) instead of a shift and a masked OR per value. Same bits as `e2m1_word`: integer addition
# and OR are associative, and each sign lands on bit 4e + 3 either way.


def _tree(vals, combine):
    while len(vals) > 1:
        vals = [combine(vals[i], vals[i + 1]) if i + 1 < len(vals) else vals[i] for i in range(0, len(vals), 2)]
    return vals[0]


def e2m1_word_tree(ys, sign_word, ops):
    """`e2m1_word` of eight quotients with the signs given as a word (sign of value e on bit 4e + 3, nothing else)."""
    ms = [e2m1_magnitude_biased(y, ops) for y in ys]
    w = _tree([m if e == 0 else ops.shl(m, 4 * e) for e, m in enumerate(ms)], ops.add)
    return ops.or_(ops.sub(w, E2M1_WORD_BIAS), sign_word)


def sign_word_f32(sign_bits, ops):
    """Bit 31 of each of eight float32 bit patterns on bit 4e + 3 of one word (OR tree)."""
    parts = [ops.and_(ops.shr(sb, 28 - 4 * e) if e < 7 else sb, 8 << (4 * e)) for e, sb in enumerate(sign_bits)]
    return _tree(parts, ops.or_)


# prmt selectors: [a.b1, b.b1, a.b3, b.b3] sign-replicated; then the even / odd bytes of the two results
_PRMT_SIGNS, _PRMT_EVEN, _PRMT_ODD = 0xFBD9, 0x5410, 0x7632


def sign_word_bf16(raw_words, ops):
    """Signs of eight bfloat16 values held as four bf16x2 words (value 2i in the low half of word i) on bit 4e + 3.

    A = prmt(w0, w1) = [s0, s2, s1, s3] and B = prmt(w2, w3) = [s4, s6, s5, s7] as 0x00 / 0xFF bytes; their even and
    odd bytes give [s0, s2, s4, s6] and [s1, s3, s5, s7]; byte k of the word takes bit 3 from the first (value 2k)
    and bit 7 from the second (value 2k + 1).
    """
    w0, w1, w2, w3 = raw_words
    a, b = ops.prmt(w0, w1, _PRMT_SIGNS), ops.prmt(w2, w3, _PRMT_SIGNS)
    even, odd = ops.prmt(a, b, _PRMT_EVEN), ops.prmt(a, b, _PRMT_ODD)
    return ops.or_(ops.and_(even, 0x08080808), ops.and_(odd, 0x80808080))
