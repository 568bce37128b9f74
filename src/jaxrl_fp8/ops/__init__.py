"""Differentiable low-precision GEMMs (dense and grouped MoE) that pick a kernel backend per platform.

The model reaches every quantized matrix product through these two functions, so training, the embedded
rollout and the benchmarks share one implementation of the precision contract's block math.

Layers (a module imports only from the layers below it and from earlier modules of its own layer):
- reference math, choosing no backend: `reference` (float64 NumPy), `xla_gemm` (XLA dots, the block math),
  `grouping` (expert-sorted row tiles, the XLA grouped paths), `operands` (GEMM operands through the contract);
- backends: `backends` (which implementation runs a GEMM; the BF16 grouped GEMMs) -> `high_precision` (the
  row-invariant float32 / BF16 products, the XLA path's block product) -> `block_scaled` (the FP8 GEMMs);
- public ops: `dense.linear`, `grouped.grouped_linear`.
"""

from jaxrl_fp8.ops.backends import BACKENDS
from jaxrl_fp8.ops.dense import linear
from jaxrl_fp8.ops.grouped import grouped_linear
from jaxrl_fp8.ops.operands import BACKWARD_MODES

__all__ = ["linear", "grouped_linear", "BACKENDS", "BACKWARD_MODES"]
