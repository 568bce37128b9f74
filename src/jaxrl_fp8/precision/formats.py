"""Names and numeric constants of the low-precision formats of the contract."""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np

BF16 = "bf16"
FP8_BLOCK = "fp8-block"
MXFP8 = "mxfp8"
NVFP4 = "nvfp4"
FORMATS = (BF16, FP8_BLOCK, MXFP8, NVFP4)
QUANTIZED_FORMATS = (FP8_BLOCK, MXFP8, NVFP4)

# Largest finite magnitudes. float8_e4m3fn has no inf (overflow becomes NaN), so values are clamped first.
E4M3_MAX = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)  # 448
E5M2_MAX = float(ml_dtypes.finfo(ml_dtypes.float8_e5m2).max)  # 57344
E2M1_MAX = 6.0
# Floor on every block / group / tensor amax: an all-zero block gets a finite scale and q = 0 (never 0/0).
AMAX_FLOOR = 1e-10

FP8_BLOCK_WEIGHT = (128, 128)
FP8_ACT_GROUP = 128
MXFP8_BLOCK = 32
NVFP4_BLOCK = 16

# E2M1 magnitudes indexed by the 3-bit code (sign is bit 3).
E2M1_GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float32)


def fp8_max(dtype) -> float:
    """Largest finite value of an FP8 dtype (E4M3 or E5M2)."""
    dtype = jnp.dtype(dtype)
    if dtype == jnp.float8_e4m3fn:
        return E4M3_MAX
    if dtype == jnp.float8_e5m2:
        return E5M2_MAX
    raise ValueError(f"unsupported FP8 dtype {dtype}; use jnp.float8_e4m3fn or jnp.float8_e5m2")


def check_format(fmt: str, *, what: str = "format") -> str:
    if fmt not in FORMATS:
        raise ValueError(f"unknown {what} {fmt!r}; expected one of {', '.join(FORMATS)}")
    return fmt
