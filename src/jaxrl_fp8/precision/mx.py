"""MXFP8: E4M3 values, one UE8M0 (power-of-two exponent byte) scale per 32 values along K.

Scale rule as SGLang and TransformerEngine compute it: s = 2^ceil(log2(amax / 448)), so no value
saturates. It is exactly the FP8 group rule with group 32 and pow2_scale=True; the scale is stored as its
biased exponent byte (byte b means 2^(b - 127); 255 is NaN).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from jaxrl_fp8.precision.arith import F32
from jaxrl_fp8.precision.fp8 import dequantize_fp8_per_token_group, quantize_fp8_per_token_group
from jaxrl_fp8.precision.formats import MXFP8_BLOCK

__all__ = ["quantize_mxfp8", "dequantize_mxfp8", "e8m0_to_float", "float_to_e8m0"]


def float_to_e8m0(s: jnp.ndarray) -> jnp.ndarray:
    """Biased exponent byte of a positive power-of-two float32 (NaN/inf -> 255)."""
    s = jnp.asarray(s, F32)
    byte = (lax.bitcast_convert_type(s, jnp.uint32) >> 23) & jnp.uint32(0xFF)
    return jnp.where(jnp.isfinite(s), byte, 255).astype(jnp.uint8)


def e8m0_to_float(byte: jnp.ndarray) -> jnp.ndarray:
    """2^(byte - 127) exactly; byte 0 is 2^-127 (an fp32 subnormal); 255 is NaN."""
    b = jnp.asarray(byte).astype(jnp.uint32)
    normal = lax.bitcast_convert_type(b << 23, F32)
    out = jnp.where(b == 0, lax.bitcast_convert_type(jnp.uint32(0x00400000), F32), normal)
    return jnp.where(b == 255, jnp.nan, out)


def quantize_mxfp8(x, block: int = MXFP8_BLOCK, *, dtype=jnp.float8_e4m3fn):
    """Returns (q e4m3 with x's shape, scale uint8 UE8M0 [..., ceil(K / block)])."""
    q, s = quantize_fp8_per_token_group(x, block, dtype=dtype, pow2_scale=True)
    return q, float_to_e8m0(s)


def dequantize_mxfp8(q, scale_e8m0, block: int = MXFP8_BLOCK, *, out_dtype=jnp.float32):
    return dequantize_fp8_per_token_group(q, e8m0_to_float(scale_e8m0), block, out_dtype=out_dtype)
