"""Rotary position embeddings as HF Qwen3 computes them (default, linear, yarn, llama3 frequencies).

Inverse frequencies depend only on the config, so they are computed once in float32 numpy with the same
operations as transformers; cos/sin are elementwise functions of the (float32) position, so a token's
rotation is the same in the full forward and in a decode step.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_fp8.model.config import ModelConfig
from jaxrl_fp8.model.numerics import lanewise, rounded_product

__all__ = ["inverse_frequencies", "rope_cos_sin", "apply_rope"]


def _default_inv_freq(theta: float, dim: int) -> np.ndarray:
    exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    return (np.float32(1.0) / (np.float32(theta) ** exponents)).astype(np.float32)


def inverse_frequencies(cfg: ModelConfig) -> tuple[np.ndarray, float]:
    """(inv_freq float32 [head_dim/2], attention scaling applied to cos/sin)."""
    dim = cfg.head_dim
    rs = cfg.rope_scaling
    base = _default_inv_freq(cfg.rope_theta, dim)
    if rs.rope_type == "default":
        return base, 1.0
    if rs.rope_type == "linear":
        return (base / np.float32(rs.factor)).astype(np.float32), 1.0
    if rs.rope_type == "llama3":
        return _llama3(base, rs), 1.0
    if rs.rope_type == "yarn":
        return _yarn(cfg, dim)
    raise ValueError(f"config field 'rope_scaling.rope_type' = {rs.rope_type!r} is not supported")


def _llama3(inv_freq: np.ndarray, rs) -> np.ndarray:
    old = rs.original_max_position_embeddings
    low_wl, high_wl = old / rs.low_freq_factor, old / rs.high_freq_factor
    wavelen = np.float32(2 * math.pi) / inv_freq
    scaled = np.where(wavelen > low_wl, inv_freq / np.float32(rs.factor), inv_freq).astype(np.float32)
    smooth = ((old / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor)).astype(np.float32)
    smoothed = ((1 - smooth) * scaled / np.float32(rs.factor) + smooth * scaled).astype(np.float32)
    medium = ~(wavelen < high_wl) & ~(wavelen > low_wl)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def _yarn(cfg: ModelConfig, dim: int) -> tuple[np.ndarray, float]:
    rs = cfg.rope_scaling
    base, factor = cfg.rope_theta, rs.factor
    orig = rs.original_max_position_embeddings

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = rs.attention_factor
    if attention_factor is None:
        if rs.mscale and rs.mscale_all_dim:
            attention_factor = float(mscale(factor, rs.mscale) / mscale(factor, rs.mscale_all_dim))
        else:
            attention_factor = mscale(factor)
    beta_fast = rs.beta_fast or 32
    beta_slow = rs.beta_slow or 1

    def correction_dim(rot):
        return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rs.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1).astype(np.float32)
    pos_freqs = (np.float32(base) ** (np.arange(0, dim, 2).astype(np.float32) / np.float32(dim))).astype(np.float32)
    extrapolation = (np.float32(1.0) / pos_freqs).astype(np.float32)
    interpolation = (np.float32(1.0) / (np.float32(factor) * pos_freqs)).astype(np.float32)
    extra_factor = (1 - ramp).astype(np.float32)
    inv = interpolation * (1 - extra_factor) + extrapolation * extra_factor
    return inv.astype(np.float32), float(attention_factor)


def rope_cos_sin(cfg: ModelConfig, positions: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """cos, sin [..., head_dim] for integer positions [...], cast to the activation dtype like HF."""
    inv_freq, attention_scaling = inverse_frequencies(cfg)
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    cos, sin = lanewise(jnp.cos, emb), lanewise(jnp.sin, emb)
    if attention_scaling != 1.0:
        cos, sin = cos * jnp.float32(attention_scaling), sin * jnp.float32(attention_scaling)
    return cos.astype(dtype), sin.astype(dtype)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [B, T, heads, D]; cos/sin [B, T, D]. x*cos + rotate_half(x)*sin, as HF."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    # both products rounded before the add (no FMA), computed in one op (one kernel instead of two)
    both = rounded_product(jnp.stack([x, rotated]), jnp.stack([cos, sin])[:, :, :, None, :])
    return both[0] + both[1]
