"""Pallas (Mosaic GPU) quantization kernels, bitwise equal to `jaxrl_fp8.precision` (the contract).

    fp8_per_token_group(x, group_size=128, *, dtype, pow2_scale)  == precision.quantize_fp8_per_token_group
    fp8_gemm_operand(x, *, rows_multiple)                        == the same codes, scales transposed for the GEMMs
    fp8_per_block(w, (128, 128), *, dtype, pow2_scale)           == precision.quantize_fp8_per_block
    mxfp8(x, 32, *, dtype)                                       == precision.quantize_mxfp8
    nvfp4(x, *, global_amax, impl)                               == precision.quantize_nvfp4 (four_over_six=False)

Every function takes `interpret=True` to run on CPU (Mosaic GPU interpret mode; tests) and an optional
`config=TileConfig(...)` (tile rows, pipeline stages, CTAs per SM, division instruction, static or dynamic tile
schedule, Pallas' automatic barriers on or off) for benchmarks.
Design, tiling and measured bandwidth: docs/decisions/0006-quantize-kernels.md.
"""

from pallas_kernels.tiling import TileConfig
from pallas_kernels.quantize_fp8 import fp8_gemm_operand, fp8_per_block, fp8_per_token_group, mxfp8
from pallas_kernels.quantize_nvfp4 import nvfp4

__all__ = ["TileConfig", "fp8_gemm_operand", "fp8_per_block", "fp8_per_token_group", "mxfp8", "nvfp4"]
