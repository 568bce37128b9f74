"""The one function that turns an HF weight into the tensors a quantized checkpoint stores.

Converters (`hf_to_*`), live export (`converters.export`) and the verifier all call `quantize_hf_tensor`, so
their outputs are bit-identical on the same weights by construction. The arithmetic itself is the precision
contract's (`jaxrl_fp8.precision`); this module only chooses the contract function for a `QuantSpec`, jits
it, and names / shapes / dtypes the results the way SGLang loads them (the layouts: `converters.spec`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_fp8.precision import (
    BF16,
    FP8_BLOCK,
    MXFP8,
    NVFP4,
    dequantize_fp8_per_block,
    dequantize_fp8_per_channel,
    dequantize_fp8_per_tensor,
    dequantize_mxfp8,
    dequantize_nvfp4,
    nvfp4_global_amax,
    quantize_fp8_per_block,
    quantize_fp8_per_channel,
    quantize_fp8_per_tensor,
    quantize_weight,
)
from jaxrl_fp8.ops.backends import backend_of_array, fp8_weight_operands
from jaxrl_fp8.precision import names as N

from converters.spec import QuantSpec

__all__ = [
    "ConversionError",
    "quantize_hf_tensor",
    "dequantize_hf_module",
    "output_names",
    "pair_partner",
    "pair_global_amax",
    "check_finite",
    "module_of",
    "NVFP4_INPUT_SCALE",
]

# input_scale written for NVFP4 without activation calibration: 1.0, as the reference converter
# (miles tools/convert_hf_to_nvfp4.py: `torch.ones_like(weight_scale_2)`) writes it.
NVFP4_INPUT_SCALE = 1.0


class ConversionError(ValueError):
    """A tensor or file cannot be converted; the message names it."""


def module_of(hf_name: str) -> str:
    if not hf_name.endswith(".weight"):
        raise ConversionError(f"tensor {hf_name!r} is not a '.weight' tensor")
    return hf_name[: -len(".weight")]


def output_names(hf_name: str, spec: QuantSpec, fmt: str) -> list[str]:
    """Names of the tensors `quantize_hf_tensor` writes for `hf_name` in format `fmt`."""
    if fmt == BF16:
        return [hf_name]
    m = module_of(hf_name)
    if fmt == FP8_BLOCK:
        return [hf_name, f"{m}.weight_scale_inv" if spec.strategy == "block" else f"{m}.weight_scale"]
    if fmt == MXFP8:
        return [hf_name, f"{m}.weight_scale_inv"]
    if fmt == NVFP4:
        return [hf_name, f"{m}.weight_scale", f"{m}.weight_scale_2", f"{m}.input_scale"]
    raise ConversionError(f"unknown format {fmt!r} for tensor {hf_name!r}")


def check_finite(name: str, w: np.ndarray, where: str = "") -> None:
    """Raise naming the tensor if it holds NaN or inf (the contract would write a NaN block)."""
    a = np.asarray(w)
    if not (np.issubdtype(a.dtype, np.floating) or "float" in a.dtype.name):  # ml_dtypes' bf16 / fp8 included
        return
    f = a.astype(np.float32, copy=False)
    bad = ~np.isfinite(f)
    if bad.any():
        idx = tuple(int(i) for i in np.argwhere(bad)[0])
        loc = f" in {where}" if where else ""
        raise ConversionError(
            f"tensor {name!r}{loc} holds {int(bad.sum())} non-finite value(s) (first at index {idx}: {f[idx]}); "
            "refusing to quantize it (the block would become NaN)"
        )


def pair_partner(hf_name: str) -> str | None:
    """The up_proj of an expert's gate_proj and vice versa (NVFP4 pairs them on one global scale)."""
    if N.role_of_hf(hf_name) != N.TensorRole.EXPERT:
        return None
    if hf_name.endswith(".gate_proj.weight"):
        return hf_name[: -len("gate_proj.weight")] + "up_proj.weight"
    if hf_name.endswith(".up_proj.weight"):
        return hf_name[: -len("up_proj.weight")] + "gate_proj.weight"
    return None


@jax.jit
def _amax(w):
    return nvfp4_global_amax(w)


def pair_global_amax(a, b) -> jax.Array:
    """max(finite amax of a, finite amax of b): the shared NVFP4 amax of gate and up (as quantize_nvfp4_pair)."""
    return jnp.maximum(_amax(jnp.asarray(a)), _amax(jnp.asarray(b)))


@functools.partial(jax.jit, static_argnames=("fmt", "strategy", "block_size", "pow2_scale", "four_over_six", "backend"))
def _quantize(w, global_amax, *, fmt, strategy, block_size, pow2_scale, four_over_six, backend):
    if fmt == FP8_BLOCK:
        if strategy == "block" and tuple(block_size) == (128, 128):
            # the trainer's maker of GEMM operands, on the backend it would pick (the Pallas kernel on Hopper)
            return fp8_weight_operands(w, backend, pow2_scale=pow2_scale)
        if strategy == "block":
            return quantize_fp8_per_block(w, block_size, pow2_scale=pow2_scale)
        if strategy == "channel":
            return quantize_fp8_per_channel(w, pow2_scale=pow2_scale)
        q, s = quantize_fp8_per_tensor(w, pow2_scale=pow2_scale)
        return q, jnp.reshape(s, (1,))
    if fmt == MXFP8:
        qw = quantize_weight(w, MXFP8)
        return qw.data, qw.scale
    if fmt == NVFP4:
        qw = quantize_weight(w, NVFP4, global_amax=global_amax, four_over_six=four_over_six)
        return qw.data, qw.scale, qw.global_scale, jnp.full(jnp.shape(qw.global_scale), NVFP4_INPUT_SCALE, jnp.float32)
    raise ValueError(fmt)


def _check_shape(hf_name: str, shape, fmt: str) -> None:
    if len(shape) != 2:
        raise ConversionError(f"tensor {hf_name!r} has shape {tuple(shape)}; a quantized projection must be 2-D [out, in]")
    k = shape[-1]
    if fmt == MXFP8 and k % 32:
        raise ConversionError(f"tensor {hf_name!r}: in-features {k} is not a multiple of 32, which MXFP8 checkpoints need")
    if fmt == NVFP4 and k % 16:
        raise ConversionError(f"tensor {hf_name!r}: in-features {k} is not a multiple of 16, which NVFP4 checkpoints need")


def quantize_hf_tensor(hf_name: str, w, spec: QuantSpec, fmt: str, *, global_amax=None) -> list[tuple[str, np.ndarray]]:
    """[(name, host array)] that a checkpoint in `spec` stores for the HF weight `hf_name` under format `fmt`.

    `fmt` is the policy's decision for this tensor (bf16 = keep as is). For NVFP4 expert gate/up pass the
    pair's `global_amax` (see `pair_global_amax`); without it the tensor's own amax is used.
    Returned arrays are numpy-owned copies (host memory the caller can account for).
    """
    if fmt == BF16:
        return [(hf_name, np.asarray(w))]
    if fmt != spec.fmt:
        raise ConversionError(f"tensor {hf_name!r}: the policy asks for {fmt} but the checkpoint format is {spec.fmt}")
    _check_shape(hf_name, np.shape(w), fmt)
    if fmt != NVFP4:
        global_amax = None
    elif global_amax is not None:
        global_amax = jnp.asarray(global_amax, jnp.float32)
    w = jnp.asarray(w)
    out = _quantize(
        w,
        global_amax,
        fmt=fmt,
        strategy=spec.strategy,
        block_size=tuple(spec.block_size),
        pow2_scale=spec.pow2_scale,
        four_over_six=spec.four_over_six,
        backend=backend_of_array(w),
    )
    return [(name, np.array(a)) for name, a in zip(output_names(hf_name, spec, fmt), out)]


def dequantize_hf_module(hf_name: str, tensors: dict[str, np.ndarray], spec: QuantSpec, fmt: str) -> np.ndarray:
    """float32 values of a stored weight: `tensors` maps the names of `output_names(hf_name, ...)` to arrays."""
    names = output_names(hf_name, spec, fmt)
    missing = [n for n in names if n not in tensors]
    if missing:
        raise ConversionError(f"tensor {hf_name!r} ({fmt}): missing {', '.join(missing)}")
    t = [tensors[n] for n in names]
    if fmt == BF16:
        return np.asarray(t[0]).astype(np.float32)
    if fmt == FP8_BLOCK:
        if spec.strategy == "block":
            x = dequantize_fp8_per_block(t[0], jnp.asarray(t[1]), spec.block_size)
        elif spec.strategy == "channel":
            x = dequantize_fp8_per_channel(t[0], jnp.asarray(t[1]))
        else:
            x = dequantize_fp8_per_tensor(t[0], jnp.asarray(t[1]).reshape(()))
    elif fmt == MXFP8:
        x = dequantize_mxfp8(t[0], t[1])
    elif fmt == NVFP4:
        x = dequantize_nvfp4(t[0], t[1], jnp.asarray(t[2]).reshape(()))
    else:
        raise ConversionError(f"unknown format {fmt!r}")
    return np.asarray(x, np.float32)
