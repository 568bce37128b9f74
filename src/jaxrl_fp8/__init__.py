"""jaxrl_fp8: RL for Mixture-of-Experts LLMs in JAX with one low-precision contract for rollout and training."""

import os as _os
import sys as _sys
import warnings as _warnings

__version__ = "0.1.0"

# The precision contract divides with IEEE float32 division (docs/decisions/0001). XLA:GPU lowers `a / b` to the
# approximate div.full.f32 unless LLVM's NVPTX backend is told otherwise; measured on the H200
# (experiments/checks/gpu_division.py): 1.19M of 4.19M quotients differ from IEEE by default, 0 with this option,
# and the FP8 quantizers then match the CPU bit for bit. The option must be set before JAX creates its backends.
_IEEE_DIV = "--xla_backend_extra_options=-nvptx-prec-divf32=2"
# BF16 graphs: XLA may skip intermediate BF16 roundings depending on fusion, so the same token's value would
# depend on the graph it sits in (decode step vs full forward). Row invariance needs every rounding done.
_NO_EXCESS = "--xla_allow_excess_precision=false"


def _require_ieee_division() -> None:
    flags = _os.environ.get("XLA_FLAGS", "")
    wanted = [f for key, f in (("nvptx-prec-divf32", _IEEE_DIV), ("xla_allow_excess_precision", _NO_EXCESS)) if key not in flags]
    if not wanted:
        return
    if "jax" in _sys.modules:
        try:
            from jax._src import xla_bridge

            if xla_bridge.backends_are_initialized():
                _warnings.warn(
                    "jaxrl_fp8 was imported after JAX initialised its backends: on GPU, float32 division may be "
                    f"approximate and quantization not bitwise with the contract. Set XLA_FLAGS='{_IEEE_DIV} {_NO_EXCESS}' first.",
                    stacklevel=3,
                )
                return
        except (ImportError, AttributeError):
            pass
    _os.environ["XLA_FLAGS"] = " ".join([flags, *wanted]).strip()


_require_ieee_division()
