"""Scalar operation tables for the row-per-thread kernel bodies: `MlirOps` emits MLIR / inline PTX on the GPU,
`JnpOps` the same operations on jnp arrays (interpret mode, and the exhaustive checks of the formulas).

Formulas written once over `ops` (e2m1_words) run unchanged on both, so the CPU tests check the GPU's formula.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental.mosaic.gpu import fragmented_array as mgpu_fa

from pallas_kernels.exact_arith import _MARKSTEIN_ONCE_PTX, _RCP_RN_PTX

F32 = jnp.float32


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
