"""The exact arithmetic the contract is written in.

XLA's simplifier rewrites `a / constant` and `a / broadcast(b)` into `a * (1/b)`, which differs from IEEE
division by one ulp in about half the cases (REFERENCE.md, measured). The contract is defined with IEEE
(correctly rounded) float32 division, so every division of the contract goes through `ieee_div`, whose
divisor is hidden from the simplifier behind an optimization barrier. Pallas kernels use plain `/` on
vectors (lowered to correctly rounded division) and are tested bitwise against these functions.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

F32 = jnp.float32


def ieee_div(a: jnp.ndarray, b) -> jnp.ndarray:
    """Correctly rounded float32 `a / b`, with `b` broadcast to `a`'s shape."""
    a = jnp.asarray(a, F32)
    b = jnp.broadcast_to(jnp.asarray(b, F32), jnp.broadcast_shapes(jnp.shape(a), jnp.shape(b)))
    a = jnp.broadcast_to(a, b.shape)
    return a / lax.optimization_barrier(b)


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
