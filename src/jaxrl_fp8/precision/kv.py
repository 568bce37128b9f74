"""The FP8 KV-cache contract: keys and values as e4m3 with one power-of-two scale per (token, head).

A recipe with `kv_cache="fp8"` quantizes k (after k-norm and RoPE) and v of every token once, where attention
consumes them, on both sides: the rollout's paged cache stores the e4m3 values and scales (half the bytes a
decode step reads), and the trainer's forward attends over the dequantized values (`fake_quantize_kv`, whose
gradient passes straight through). A token's keys are therefore the same BF16 numbers in the trainer, in a
prefill and in a decode step, and the attention kernels keep their bits (decision record 0009).

Why a power of two per (token, head), over head_dim:
- per token: a cache appends tokens one at a time, so a token's scale may depend on that token alone (a block
  over tokens would change the scale of tokens already written);
- a power of two: dequantization value x scale is exact in BF16 (and in any float arithmetic), so the kernel
  that dequantizes in shared memory, XLA in the trainer and the CPU reference agree without a rounding rule;
- the scale exponent is at least MIN_EXPONENT, so the smallest e4m3 subnormal (2^-9) times the scale is a
  normal BF16 number: no product is subnormal, none meets a flush-to-zero.

The scale is the smallest power of two s (within the exponent bounds) with amax <= 448 s, from the exponent of
amax (integer arithmetic, no rounded logarithm); an all-zero row gets the lower bound. Float32-subnormal inputs
(|x| < 2^-126) may be flushed to zero by the device (XLA:CPU does): both sides quantize on one device, so
they agree. A row holding inf or NaN gets a NaN scale: it dequantizes to
NaN everywhere (a cache must hold finite keys; the bf16 cache fails the same way).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from jaxrl_fp8.precision.arith import bf16_to_f32, fp8_to_f32
from jaxrl_fp8.precision.formats import E4M3_MAX

__all__ = ["KV_CACHE_FORMATS", "MIN_EXPONENT", "QuantizedKV", "quantize_kv", "dequantize_kv", "fake_quantize_kv",
           "check_kv_cache", "kv_cache_of"]

KV_CACHE_FORMATS = ("bf16", "fp8")
MIN_EXPONENT = -117  # 2^-9 (smallest e4m3 subnormal) * 2^-117 = 2^-126, BF16's smallest normal
MAX_EXPONENT = 126  # 2^-e stays a normal float32 too (amax < 2^128 never needs more than 2^120)


def check_kv_cache(kv_cache: str, *, what: str = "kv_cache") -> str:
    if kv_cache not in KV_CACHE_FORMATS:
        raise ValueError(f"{what}={kv_cache!r} is not a KV-cache format; expected one of {', '.join(KV_CACHE_FORMATS)}")
    return kv_cache


def kv_cache_of(policy) -> str:
    """The KV-cache format a `PrecisionPolicy` computes with ("bf16" for None: the parameters' dtype, no recipe)."""
    return "bf16" if policy is None else policy.kv_cache


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedKV:
    """values float8_e4m3fn [..., D]; scales float32 [...] (a power of two per row of D, or NaN)."""

    values: jax.Array
    scales: jax.Array

    @property
    def shape(self):
        return self.values.shape

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        return dequantize_kv(self.values, self.scales, dtype)


def _pow2(e: jax.Array) -> jax.Array:
    """2^e as float32 from its bits (e in [-126, 127]): exact by construction, unlike `jnp.ldexp`, which multiplies
    by `2 ** e` (a float power on the device)."""
    return lax.bitcast_convert_type(((e + 127).astype(jnp.uint32) << jnp.uint32(23)), jnp.float32)


def _scale_exponent(amax: jax.Array) -> jax.Array:
    """The smallest e with amax <= 448 * 2^e: amax = m 2^E (m in [0.5, 1)) and 448 = 0.875 * 2^9."""
    m, e = jnp.frexp(amax)
    e = jnp.where(m <= 0.875, e - 9, e - 8)
    return jnp.where(amax > 0, jnp.clip(e, MIN_EXPONENT, MAX_EXPONENT), MIN_EXPONENT)


def quantize_kv(x: jax.Array) -> QuantizedKV:
    """x [..., D] (any float dtype) -> e4m3 values and one power-of-two scale per row of D."""
    xf = bf16_to_f32(x) if x.dtype == jnp.bfloat16 else x.astype(jnp.float32)  # from the bits: the BF16 rounding stays
    amax = jnp.max(jnp.abs(xf), axis=-1)
    e = _scale_exponent(amax)
    finite = jnp.all(jnp.isfinite(xf), axis=-1)  # not isfinite(amax): a max need not propagate NaN (XLA:CPU)
    scales = jnp.where(finite, _pow2(e), jnp.float32(jnp.nan))
    # x * 2^-e is exact (a power of two, no overflow: |x| <= 448 2^e); e4m3 rounding is to nearest even
    inv = jnp.where(finite, _pow2(-e), jnp.float32(jnp.nan))
    y = jnp.clip(xf * inv[..., None], -E4M3_MAX, E4M3_MAX)
    return QuantizedKV(y.astype(jnp.float8_e4m3fn), scales)


def dequantize_kv(values: jax.Array, scales: jax.Array, dtype=jnp.float32) -> jax.Array:
    """values x scale: exact (a normal BF16 / float32 number, or 0 or NaN). The e4m3 values are decoded from their
    bits (`arith.fp8_to_f32`): XLA:GPU may delete a float32 -> e4m3 -> float32 convert chain, which would skip the
    rounding in `fake_quantize_kv`."""
    return (fp8_to_f32(values) * scales[..., None]).astype(dtype)


@jax.custom_vjp
def fake_quantize_kv(x: jax.Array) -> jax.Array:
    """The values an FP8 cache gives back for x, in x's dtype; the gradient passes straight through (the trainer
    differentiates attention over the keys the sampler saw, as if the rounding were not there)."""
    return quantize_kv(x).dequantize(x.dtype)


def _fake_fwd(x):
    return fake_quantize_kv(x), None


def _fake_bwd(_, g):
    return (g,)


fake_quantize_kv.defvjp(_fake_fwd, _fake_bwd)
