"""Format-generic entry points: quantize a weight or an activation the way a format prescribes.

`QuantizedWeight` is the pytree that travels from checkpoints, converters and the trainer into `ops`, so a
kernel never has to guess how its operand was produced.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxrl_fp8.precision import formats as F
from jaxrl_fp8.precision.fp8 import (
    dequantize_fp8_per_block,
    dequantize_fp8_per_token_group,
    quantize_fp8_per_block,
    quantize_fp8_per_token_group,
)
from jaxrl_fp8.precision.mx import dequantize_mxfp8, quantize_mxfp8
from jaxrl_fp8.precision.nvfp4 import dequantize_nvfp4, nvfp4_global_amax, quantize_nvfp4

__all__ = ["QuantizedWeight", "quantize_weight", "dequantize_weight", "quantize_dequantize_activation", "weight_global_amax"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
    """A weight `[..., N, K]` (HF `[out, in]` layout; `[E, N, K]` for expert stacks) in a quantized format.

    fp8-block: data e4m3 [..., N, K], scale f32 [..., ceil(N/128), ceil(K/128)], global_scale None.
    mxfp8:     data e4m3 [..., N, K], scale uint8 UE8M0 [..., N, ceil(K/32)], global_scale None.
    nvfp4:     data uint8 [..., N, Kp/2], scale e4m3 [..., N, Kp/16], global_scale f32 [...] (one per matrix).
    """

    data: jax.Array
    scale: jax.Array
    global_scale: jax.Array | None = None
    fmt: str = dataclasses.field(default=F.FP8_BLOCK, metadata=dict(static=True))
    k: int = dataclasses.field(default=0, metadata=dict(static=True))  # logical K (NVFP4 pads to 16)
    pow2_scale: bool = dataclasses.field(default=False, metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.data.shape[:-1], self.k)

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        return dequantize_weight(self, dtype)


def weight_global_amax(w) -> jax.Array:
    """NVFP4 tensor-level amax of a weight: one per matrix (per expert for `[E, N, K]` stacks)."""
    w = jnp.asarray(w)
    return nvfp4_global_amax(w.reshape(*w.shape[:-2], -1), per_row=True) if w.ndim > 2 else nvfp4_global_amax(w)


def quantize_weight(w, fmt: str, *, pow2_scale: bool = False, global_amax=None, four_over_six: bool = False) -> QuantizedWeight:
    """Quantize a weight `[..., N, K]` as `fmt` prescribes for weights."""
    w = jnp.asarray(w)
    k = int(w.shape[-1])
    if fmt == F.FP8_BLOCK:
        q, s = quantize_fp8_per_block(w, F.FP8_BLOCK_WEIGHT, pow2_scale=pow2_scale)
        return QuantizedWeight(q, s, None, fmt, k, pow2_scale)
    if fmt == F.MXFP8:
        q, s = quantize_mxfp8(w, F.MXFP8_BLOCK)
        return QuantizedWeight(q, s, None, fmt, k, True)
    if fmt == F.NVFP4:
        amax = weight_global_amax(w) if global_amax is None else global_amax
        p, bs, g = quantize_nvfp4(w, global_amax=amax, four_over_six=four_over_six)
        return QuantizedWeight(p, bs, g, fmt, k, False)
    raise ValueError(f"quantize_weight: format {fmt!r} is not a quantized format ({', '.join(F.QUANTIZED_FORMATS)})")


def dequantize_weight(qw: QuantizedWeight, dtype=jnp.float32) -> jax.Array:
    if qw.fmt == F.FP8_BLOCK:
        return dequantize_fp8_per_block(qw.data, qw.scale, F.FP8_BLOCK_WEIGHT, out_dtype=dtype)
    if qw.fmt == F.MXFP8:
        return dequantize_mxfp8(qw.data, qw.scale, F.MXFP8_BLOCK, out_dtype=dtype)
    if qw.fmt == F.NVFP4:
        return dequantize_nvfp4(qw.data, qw.scale, qw.global_scale, k=qw.k, out_dtype=dtype)
    raise ValueError(f"dequantize_weight: unknown format {qw.fmt!r}")


def quantize_dequantize_activation(x, fmt: str, *, pow2_scale: bool = False, dtype=None) -> jax.Array:
    """The values an activation takes in `fmt` (1x128 FP8 groups, 1x32 MXFP8, per-token NVFP4), dequantized.

    Emulated GEMMs (MXFP8/NVFP4 on Hopper and CPU) multiply exactly these values.
    """
    x = jnp.asarray(x)
    dtype = dtype or x.dtype
    if fmt == F.BF16:
        return x.astype(dtype)
    if fmt == F.FP8_BLOCK:
        q, s = quantize_fp8_per_token_group(x, F.FP8_ACT_GROUP, pow2_scale=pow2_scale)
        return dequantize_fp8_per_token_group(q, s, F.FP8_ACT_GROUP, out_dtype=dtype)
    if fmt == F.MXFP8:
        q, s = quantize_mxfp8(x, F.MXFP8_BLOCK)
        return dequantize_mxfp8(q, s, F.MXFP8_BLOCK, out_dtype=dtype)
    if fmt == F.NVFP4:
        p, bs, g = quantize_nvfp4(x, global_amax=nvfp4_global_amax(x, per_row=True))
        return dequantize_nvfp4(p, bs, g, k=x.shape[-1], out_dtype=dtype)
    raise ValueError(f"unknown format {fmt!r}; expected one of {', '.join(F.FORMATS)}")
