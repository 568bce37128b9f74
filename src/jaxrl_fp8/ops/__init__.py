"""Differentiable low-precision GEMMs (dense and grouped MoE) that pick a kernel backend per platform.

The model reaches every quantized matrix product through these two functions, so training, the embedded
rollout and the benchmarks share one implementation of the precision contract's block math.
"""

from jaxrl_fp8.ops.backends import BACKENDS
from jaxrl_fp8.ops.dense import linear
from jaxrl_fp8.ops.grouped import grouped_linear
from jaxrl_fp8.ops.operands import BACKWARD_MODES

__all__ = ["linear", "grouped_linear", "BACKENDS", "BACKWARD_MODES"]
