"""The exact arithmetic the contract is written in.

XLA's simplifier rewrites `a / constant` and `a / broadcast(b)` into `a * (1/b)`, which differs from IEEE
division by one ulp in about half the cases (measured on XLA:CPU, jax 0.11.2). The contract is defined with IEEE
(correctly rounded) float32 division, so every division of the contract goes through `ieee_div`, whose
divisor is hidden from the simplifier behind an optimization barrier. Pallas kernels use plain `/` on
vectors (lowered to correctly rounded division) and are tested bitwise against these functions.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

F32 = jnp.float32


def ieee_div(a: jnp.ndarray, b) -> jnp.ndarray:
    """Correctly rounded float32 `a / b`, with `b` broadcast to `a`'s shape.

    Both operands sit behind optimization barriers so XLA cannot rewrite the quotient algebraically: with a
    known divisor it would multiply by a reciprocal, and its simplifier turns (a / b) / c into a / (b * c),
    which rounds differently (one NVFP4 block: (amax / 6) / g = 200.00002 -> e4m3 208, but amax / (6 * g) =
    200.0, a tie that rounds to the even 192; the jitted contract wrote 192 on XLA:CPU and on XLA:GPU, eager
    dispatch 208).

    The divisor is materialised at the quotient's shape because XLA also rewrites a / broadcast(b) into
    a * broadcast(1 / b). A concrete divisor of exactly 1 (a Python / NumPy scalar) returns `a` as it is: the
    quotient is exact, and no tensor of ones is written (the trainer's logits at temperature 1: [2048, 151936]
    float32 a chunk, re-read by every vocabulary pass).
    """
    if isinstance(b, (int, float, np.number)) and float(b) == 1.0:
        return jnp.asarray(a, F32)
    a = jnp.asarray(a, F32)
    b = jnp.broadcast_to(jnp.asarray(b, F32), jnp.broadcast_shapes(jnp.shape(a), jnp.shape(b)))
    a = jnp.broadcast_to(a, b.shape)
    return lax.optimization_barrier(a) / lax.optimization_barrier(b)


_FP8_LAYOUT = {  # dtype name -> (exponent bits, mantissa bits, bias, has inf)
    "float8_e4m3fn": (4, 3, 7, False),
    "float8_e5m2": (5, 2, 15, True),
}


def fp8_to_f32(q: jnp.ndarray) -> jnp.ndarray:
    """float32(q) for float8_e4m3fn / float8_e5m2 `q`, decoded from the bits (other dtypes: a plain cast).

    Bit for bit what XLA:CPU's convert (and ml_dtypes) gives, NaN included (the quiet NaN 0x7FC00000 with
    q's sign). Why not `q.astype(float32)`: XLA:GPU's SimplifyFPConversions pass (on while
    `--xla_allow_excess_precision` is true, XLA's default) deletes a float32 -> fp8 -> float32 convert
    chain, so inside one jit `x.astype(e4m3).astype(f32)` is `x` on the GPU: the NVFP4 block scale then
    multiplied into d unrounded (541 575 bytes of a 4096x1024 tensor differed from the CPU) and every
    quantize-dequantize round trip was a no-op. Integer ops and a bitcast are not converts, so no pass removes
    the rounding; the result is exact (normal: exponent rebias; subnormal: m * 2^(1-bias-mbits)).
    """
    q = jnp.asarray(q)
    layout = _FP8_LAYOUT.get(q.dtype.name)
    if layout is None:
        return q.astype(F32)
    ebits, mbits, bias, has_inf = layout
    u32 = jnp.uint32
    b = lax.bitcast_convert_type(q, jnp.uint8).astype(u32)
    sign = (b & u32(0x80)) << u32(24)
    e = (b >> u32(mbits)) & u32((1 << ebits) - 1)
    m = b & u32((1 << mbits) - 1)
    normal = ((e + u32(127 - bias)) << u32(23)) | (m << u32(23 - mbits))
    sub = lax.bitcast_convert_type(m.astype(F32) * F32(2.0 ** (1 - bias - mbits)), u32)  # exact, a normal f32
    mag = jnp.where(e == 0, sub, normal)
    top = e == u32((1 << ebits) - 1)
    if has_inf:  # IEEE-like: exponent all ones is inf (m == 0) or NaN
        mag = jnp.where(top, jnp.where(m == 0, u32(0x7F800000), u32(0x7FC00000)), mag)
    else:  # "fn": no inf; only all-ones exponent and mantissa is NaN
        mag = jnp.where(top & (m == u32((1 << mbits) - 1)), u32(0x7FC00000), mag)
    return lax.bitcast_convert_type(mag | sign, F32)


def bf16_to_f32(h: jnp.ndarray) -> jnp.ndarray:
    """float32(h) for bfloat16 `h`, from the bits (bfloat16 is float32's top half): exact for every code, NaN bits
    included. Why not `h.astype(float32)`: like the fp8 chain above, XLA:GPU may delete a float32 -> bf16 -> float32
    convert chain inside one jit when excess precision is allowed, and `a - float32(bf16(a))` would become 0."""
    u = lax.bitcast_convert_type(jnp.asarray(h, jnp.bfloat16), jnp.uint16).astype(jnp.uint32) << jnp.uint32(16)
    return lax.bitcast_convert_type(u, F32)


def ceil_pow2(s: jnp.ndarray) -> jnp.ndarray:
    """Smallest power of two >= s for positive normal float32 s, computed on the bits (exact, no log2)."""
    s = jnp.asarray(s, F32)
    bits = lax.bitcast_convert_type(s, jnp.uint32)
    mantissa = bits & jnp.uint32(0x007FFFFF)
    exponent = bits & jnp.uint32(0x7F800000)
    up = lax.bitcast_convert_type(exponent + jnp.uint32(0x00800000), F32)
    out = jnp.where(mantissa == 0, s, up)
    return jnp.where(jnp.isfinite(s), out, s)


def block_amax(x: jnp.ndarray, axes, floor: float) -> jnp.ndarray:
    """max |x| over `axes` in float32, floored at `floor`; NaN if the block holds any NaN or inf.

    Making a non-finite block's amax NaN (instead of letting inf/NaN flow through max) gives one documented
    behaviour: the whole block (and only that block) dequantizes to NaN.
    """
    x = jnp.asarray(x, F32)
    amax = jnp.max(jnp.abs(x), axis=axes)
    finite = jnp.all(jnp.isfinite(x), axis=axes)
    return jnp.where(finite, jnp.maximum(amax, F32(floor)), jnp.nan)


def finite_amax(x: jnp.ndarray, axes=None, floor: float = 0.0) -> jnp.ndarray:
    """max |x| over the finite entries only (used for NVFP4's tensor-level scale, so one bad block stays local)."""
    x = jnp.asarray(x, F32)
    a = jnp.where(jnp.isfinite(x), jnp.abs(x), 0.0)
    return jnp.maximum(jnp.max(a, axis=axes), F32(floor))
