"""NVFP4: E2M1 values packed two per byte, an E4M3 scale per 16 values, and a float32 global scale.

The rule (docs/decisions/0001-precision-contract.md):
    g     = max(amax_finite, 1e-10) / (6 * E)     float32 IEEE; E = 448 (or 256 with four-over-six, so a
                                                  block mapped to 4 cannot overflow its E4M3 scale)
    bs    = cast_e4m3(min((block_amax / 6) / g, 448))     per 16 values (target 4 instead of 6 if chosen)
    d     = float32(bs) * g                        the block's dequantization multiplier
    code  = e2m1_rne(clamp(x / d, -6, 6))          0 when d == 0
    x_hat = e2m1_value(code) * d
`g` is ModelOpt's `weight_scale_2` and `bs` its `weight_scale`. The tensor amax ignores non-finite
entries, so a NaN/inf block poisons only itself (its bs is NaN, so it dequantizes to NaN).
Rounding to the E2M1 grid is written as threshold counts (ties to even code) so Pallas kernels can run the
very same comparisons; tests check it against ml_dtypes' float4_e2m1fn cast.
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxrl_fp8.precision.arith import F32, block_amax, finite_amax, fp8_to_f32, ieee_div
from jaxrl_fp8.precision.formats import AMAX_FLOOR, E2M1_GRID, E4M3_MAX, NVFP4_BLOCK

__all__ = [
    "quantize_nvfp4",
    "dequantize_nvfp4",
    "quantize_nvfp4_pair",
    "nvfp4_global_amax",
    "e2m1_codes",
    "e2m1_values",
    "pack_nibbles",
    "unpack_nibbles",
]

# (threshold, inclusive): |y| above (or at, if inclusive) a threshold moves one code up. Ties go to the even code.
_E2M1_THRESHOLDS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


def e2m1_codes(y: jnp.ndarray) -> jnp.ndarray:
    """Round float32 y (already clamped to [-6, 6]) to the E2M1 grid; returns 4-bit codes as uint8."""
    a = jnp.abs(y)
    mag = jnp.zeros(y.shape, jnp.uint8)
    for t, inclusive in _E2M1_THRESHOLDS:
        mag = mag + ((a >= t) if inclusive else (a > t)).astype(jnp.uint8)
    return mag | (jnp.signbit(y).astype(jnp.uint8) << 3)


def e2m1_values(codes: jnp.ndarray) -> jnp.ndarray:
    codes = jnp.asarray(codes).astype(jnp.int32)
    mag = jnp.asarray(E2M1_GRID)[codes & 7]
    return jnp.where((codes & 8) != 0, -mag, mag)


def pack_nibbles(codes: jnp.ndarray) -> jnp.ndarray:
    """[..., K] 4-bit codes -> [..., K/2] bytes, element 2i in the low nibble."""
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(jnp.uint8)


def unpack_nibbles(packed: jnp.ndarray) -> jnp.ndarray:
    packed = jnp.asarray(packed, jnp.uint8)
    lo, hi = packed & 0xF, packed >> 4
    return jnp.stack([lo, hi], axis=-1).reshape(*packed.shape[:-1], -1)


def nvfp4_global_amax(x, *, per_row: bool = False) -> jnp.ndarray:
    """Amax of the finite entries: per tensor (weights) or per row (per-token activations, shape x.shape[:-1])."""
    x = jnp.asarray(x)
    return finite_amax(x, axes=-1 if per_row else None)


def _expand_global(g, ndim: int):
    """A global scale's shape is a prefix of x.shape[:-1] (scalar, per expert, or per row): align it left."""
    return jnp.reshape(g, jnp.shape(g) + (1,) * (ndim - jnp.ndim(g)))


def _encode_blocks(xb, bamax, g, target):
    bs = jnp.minimum(ieee_div(ieee_div(bamax, target), g), E4M3_MAX).astype(jnp.float8_e4m3fn)  # two roundings (ieee_div)
    d = fp8_to_f32(bs) * g  # not bs.astype(F32): XLA:GPU would drop the f32 -> e4m3 -> f32 rounding (arith.fp8_to_f32)
    ok = d > 0
    y = ieee_div(xb, jnp.where(ok, d, 1.0)[..., None])
    y = jnp.where(ok[..., None], jnp.clip(y, -6.0, 6.0), 0.0)
    codes = e2m1_codes(y)
    return bs, codes, e2m1_values(codes) * d[..., None]


def quantize_nvfp4(x, *, global_amax=None, four_over_six: bool = False):
    """Returns (packed uint8 [..., Kp/2], block_scale e4m3 [..., Kp/16], global_scale float32).

    Kp is K rounded up to 16 (zero padding; pass k=K to `dequantize_nvfp4` to crop). `global_amax` defaults
    to the tensor's finite amax; pass a shared value to pair tensors, an array of shape x.shape[:1] for an
    expert stack, or x.shape[:-1] for per-token activation scaling (its shape must be a prefix of
    x.shape[:-1]). The returned global_scale has global_amax's shape.
    """
    x = jnp.asarray(x)
    if global_amax is None:
        global_amax = nvfp4_global_amax(x)
    emax = 256.0 if four_over_six else E4M3_MAX
    g = ieee_div(jnp.maximum(jnp.asarray(global_amax, F32), F32(AMAX_FLOOR)), 6.0 * emax)
    xp = x.astype(F32)
    pad = (-x.shape[-1]) % NVFP4_BLOCK
    if pad:
        xp = jnp.pad(xp, [(0, 0)] * (x.ndim - 1) + [(0, pad)])
    xb = xp.reshape(*x.shape[:-1], -1, NVFP4_BLOCK)
    bamax = block_amax(xb, -1, 0.0)
    g_b = jnp.broadcast_to(_expand_global(g, bamax.ndim), bamax.shape)
    bs, codes, deq = _encode_blocks(xb, bamax, g_b, 6.0)
    if four_over_six:
        bs4, codes4, deq4 = _encode_blocks(xb, bamax, g_b, 4.0)
        err6 = jnp.sum(jnp.square(deq - xb), axis=-1)
        err4 = jnp.sum(jnp.square(deq4 - xb), axis=-1)
        use4 = err4 < err6
        bs = jnp.where(use4, bs4, bs)
        codes = jnp.where(use4[..., None], codes4, codes)
    packed = pack_nibbles(codes.reshape(*x.shape[:-1], -1))
    return packed, bs, g


def dequantize_nvfp4(packed, block_scale, global_scale, *, k: int | None = None, out_dtype=jnp.float32):
    codes = unpack_nibbles(packed)
    vals = e2m1_values(codes).reshape(*codes.shape[:-1], -1, NVFP4_BLOCK)
    bs = fp8_to_f32(jnp.asarray(block_scale))
    d = bs * _expand_global(jnp.asarray(global_scale, F32), bs.ndim)
    x = (vals * d[..., None]).reshape(*codes.shape[:-1], -1)
    if k is not None:
        x = x[..., :k]
    return x.astype(out_dtype)


def quantize_nvfp4_pair(gate, up, *, four_over_six: bool = False):
    """Quantize gate and up projections of one expert on ONE global scale (the fused rollout GEMM needs it)."""
    amax = jnp.maximum(nvfp4_global_amax(gate), nvfp4_global_amax(up))
    return (
        quantize_nvfp4(gate, global_amax=amax, four_over_six=four_over_six),
        quantize_nvfp4(up, global_amax=amax, four_over_six=four_over_six),
    )
