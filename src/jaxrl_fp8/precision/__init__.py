"""THE precision contract of jaxrl_fp8: formats, reference quantizers, recipes and the per-layer policy.

Every stage that touches low-precision numbers (trainer forward, Pallas kernels, converters, live export,
embedded rollout) calls these functions or is tested bitwise against them. This package imports nothing
else of jaxrl_fp8. The exact rules are in docs/decisions/0001-precision-contract.md.
"""

from jaxrl_fp8.precision import names
from jaxrl_fp8.precision.arith import bf16_to_f32, ceil_pow2, fp8_to_f32, ieee_div
from jaxrl_fp8.precision.formats import (
    AMAX_FLOOR,
    BF16,
    E2M1_MAX,
    E4M3_MAX,
    E5M2_MAX,
    FORMATS,
    FP8_BLOCK,
    MXFP8,
    NVFP4,
    QUANTIZED_FORMATS,
    check_format,
    fp8_max,
)
from jaxrl_fp8.precision.fp8 import (
    dequantize_fp8_per_block,
    dequantize_fp8_per_channel,
    dequantize_fp8_per_tensor,
    dequantize_fp8_per_token_group,
    quantize_fp8_per_block,
    quantize_fp8_per_channel,
    quantize_fp8_per_tensor,
    quantize_fp8_per_token_group,
)
from jaxrl_fp8.precision.kv import KV_CACHE_FORMATS, QuantizedKV, dequantize_kv, fake_quantize_kv, quantize_kv
from jaxrl_fp8.precision.mx import dequantize_mxfp8, e8m0_to_float, float_to_e8m0, quantize_mxfp8
from jaxrl_fp8.precision.nvfp4 import dequantize_nvfp4, nvfp4_global_amax, quantize_nvfp4, quantize_nvfp4_pair
from jaxrl_fp8.precision.policy import PrecisionPolicy, load_precision_config
from jaxrl_fp8.precision.quantized import (
    QuantizedWeight,
    dequantize_weight,
    quantize_dequantize_activation,
    quantize_weight,
    weight_global_amax,
)
from jaxrl_fp8.precision.recipes import RECIPES, Recipe, detect_hardware, get_recipe

__all__ = [n for n in dir() if not n.startswith("_")]
