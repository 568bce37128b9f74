"""Exact float32 arithmetic inside the quantization kernels: correctly rounded division, and scale bits.

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

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.mosaic.gpu import fragmented_array as mgpu_fa
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.tiling import ROWS, TILE, TileConfig

F32 = jnp.float32
F32_MAX = float(jnp.finfo(jnp.float32).max)


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
