"""Block-wise FP8 quantization: the single definition used by trainer, kernels, converters and rollout.

The rule (docs/decisions/0001-precision-contract.md), per group / block of values `x`:
    amax  = max |x| in float32, floored at 1e-10        (NaN if the block holds NaN or inf)
    s     = amax / fmax                                  (IEEE float32 division; fmax 448 for E4M3)
    s     = 2^ceil(log2 s)                               (only with pow2_scale=True; exact, on the bits)
    q     = cast_rne(clamp(x / s, -fmax, fmax))          (IEEE division, then round-to-nearest-even)
    x_hat = float32(q) * s                               (s is a dequantization multiplier, `weight_scale_inv`;
                                                          float32(q) decoded from the bits: arith.fp8_to_f32)
Partial groups and blocks are zero-padded before the amax and cropped after, so padding never changes a scale.
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from jaxrl_fp8.precision.arith import F32, block_amax, ceil_pow2, fp8_to_f32, ieee_div
from jaxrl_fp8.precision.formats import AMAX_FLOOR, fp8_max

__all__ = [
    "scale_from_amax",
    "cast_scaled",
    "quantize_fp8_per_token_group",
    "dequantize_fp8_per_token_group",
    "quantize_fp8_per_block",
    "dequantize_fp8_per_block",
    "quantize_fp8_per_tensor",
    "dequantize_fp8_per_tensor",
    "quantize_fp8_per_channel",
    "dequantize_fp8_per_channel",
]


def scale_from_amax(amax: jnp.ndarray, fmax: float, pow2_scale: bool = False) -> jnp.ndarray:
    """s = amax / fmax (IEEE), optionally rounded up to a power of two."""
    s = ieee_div(amax, fmax)
    return ceil_pow2(s) if pow2_scale else s


def cast_scaled(x: jnp.ndarray, s_broadcast: jnp.ndarray, fmax: float, dtype) -> jnp.ndarray:
    """cast_rne(clamp(x / s, -fmax, fmax)); `s_broadcast` must broadcast against x."""
    y = ieee_div(x, s_broadcast)
    return jnp.clip(y, -fmax, fmax).astype(dtype)


def _pad_last(x: jnp.ndarray, multiple: int) -> jnp.ndarray:
    pad = (-x.shape[-1]) % multiple
    if pad == 0:
        return x
    return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])


def _pad_last2(x: jnp.ndarray, bn: int, bk: int) -> jnp.ndarray:
    pn, pk = (-x.shape[-2]) % bn, (-x.shape[-1]) % bk
    if pn == 0 and pk == 0:
        return x
    return jnp.pad(x, [(0, 0)] * (x.ndim - 2) + [(0, pn), (0, pk)])


def quantize_fp8_per_token_group(x, group_size: int = 128, *, dtype=jnp.float8_e4m3fn, pow2_scale: bool = False):
    """Quantize along the last axis in groups of `group_size` (activations and gradients: 1x128 per token).

    Returns (q with x's shape in `dtype`, scale float32 of shape x.shape[:-1] + (ceil(K / group_size),)).
    K need not divide by the group: the last group is zero-padded for its amax, and q is cropped to K.
    """
    x = jnp.asarray(x)
    if x.ndim == 0:
        raise ValueError("quantize_fp8_per_token_group needs at least one axis")
    fmax = fp8_max(dtype)
    k = x.shape[-1]
    xg = _pad_last(x.astype(F32), group_size)
    xg = xg.reshape(*x.shape[:-1], -1, group_size)
    scale = scale_from_amax(block_amax(xg, -1, AMAX_FLOOR), fmax, pow2_scale)
    q = cast_scaled(xg, scale[..., None], fmax, dtype)
    return q.reshape(*x.shape[:-1], -1)[..., :k], scale


def dequantize_fp8_per_token_group(q, scale, group_size: int = 128, *, out_dtype=jnp.float32):
    """x_hat = float32(q) * s per group; inverse layout of `quantize_fp8_per_token_group`."""
    q = jnp.asarray(q)
    k = q.shape[-1]
    qg = _pad_last(fp8_to_f32(q), group_size).reshape(*q.shape[:-1], -1, group_size)
    if qg.shape[-2] != scale.shape[-1]:
        raise ValueError(f"scale has {scale.shape[-1]} groups but q needs {qg.shape[-2]} (K={k}, group={group_size})")
    x = (qg * jnp.asarray(scale, F32)[..., None]).reshape(*q.shape[:-1], -1)[..., :k]
    return x.astype(out_dtype)


def quantize_fp8_per_block(w, block=(128, 128), *, dtype=jnp.float8_e4m3fn, pow2_scale: bool = False):
    """Quantize the last two axes [N, K] in bn x bk blocks (weights: 128x128; `[E, N, K]` stacks too).

    Returns (q with w's shape, scale_inv float32 [..., ceil(N/bn), ceil(K/bk)]) where scale_inv is the
    dequantization multiplier SGLang reads as `weight_scale_inv`.
    """
    w = jnp.asarray(w)
    if w.ndim < 2:
        raise ValueError(f"quantize_fp8_per_block needs [..., N, K]; got shape {w.shape}")
    bn, bk = block
    fmax = fp8_max(dtype)
    n, k = w.shape[-2:]
    wp = _pad_last2(w.astype(F32), bn, bk)
    lead = w.shape[:-2]
    nb, kb = wp.shape[-2] // bn, wp.shape[-1] // bk
    wb = wp.reshape(*lead, nb, bn, kb, bk)
    scale = scale_from_amax(block_amax(wb, (-3, -1), AMAX_FLOOR), fmax, pow2_scale)
    q = cast_scaled(wb, scale[..., :, None, :, None], fmax, dtype)
    return q.reshape(*lead, nb * bn, kb * bk)[..., :n, :k], scale


def dequantize_fp8_per_block(q, scale_inv, block=(128, 128), *, out_dtype=jnp.float32):
    q = jnp.asarray(q)
    bn, bk = block
    n, k = q.shape[-2:]
    qp = _pad_last2(fp8_to_f32(q), bn, bk)
    lead = q.shape[:-2]
    nb, kb = qp.shape[-2] // bn, qp.shape[-1] // bk
    if tuple(scale_inv.shape[-2:]) != (nb, kb):
        raise ValueError(f"scale_inv shape {tuple(scale_inv.shape)} does not match q {tuple(q.shape)} in {bn}x{bk} blocks (expected [..., {nb}, {kb}])")
    x = qp.reshape(*lead, nb, bn, kb, bk) * jnp.asarray(scale_inv, F32)[..., :, None, :, None]
    return x.reshape(*lead, nb * bn, kb * bk)[..., :n, :k].astype(out_dtype)


def quantize_fp8_per_tensor(x, *, dtype=jnp.float8_e4m3fn, pow2_scale: bool = False):
    """One float32 scale for the whole tensor (the block is the tensor)."""
    x = jnp.asarray(x)
    fmax = fp8_max(dtype)
    axes = tuple(range(x.ndim))
    scale = scale_from_amax(block_amax(x, axes, AMAX_FLOOR), fmax, pow2_scale)
    return cast_scaled(x, scale, fmax, dtype), scale


def dequantize_fp8_per_tensor(q, scale, *, out_dtype=jnp.float32):
    return (fp8_to_f32(q) * jnp.asarray(scale, F32)).astype(out_dtype)


def quantize_fp8_per_channel(w, *, dtype=jnp.float8_e4m3fn, pow2_scale: bool = False):
    """One scale per output row: a per-block quantization with blocks of 1 x K. scale [..., N, 1]."""
    w = jnp.asarray(w)
    return quantize_fp8_per_block(w, (1, w.shape[-1]), dtype=dtype, pow2_scale=pow2_scale)


def dequantize_fp8_per_channel(q, scale, *, out_dtype=jnp.float32):
    q = jnp.asarray(q)
    return dequantize_fp8_per_block(q, scale, (1, q.shape[-1]), out_dtype=out_dtype)


def num_blocks(size: int, block: int) -> int:
    return math.ceil(size / block)
