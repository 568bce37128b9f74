"""The one place that reaches Mosaic GPU's interpret mode (runs a GPU kernel on CPU, for tests).

jax 0.11.2 re-exports it as `plgpu.force_gpu_interpret_mode` / `plgpu.InterpretGPUParams`; keeping the
import here means an API move breaks one file.
"""

from __future__ import annotations

import contextlib
import warnings

import jax
from jax.experimental.pallas import mosaic_gpu as plgpu

# Kernels size their persistent grid from the device's SM count; interpret mode has none, so a small
# grid still exercises the "several output tiles per program" path.
INTERPRET_NUM_SMS = 3


def num_sms(interpret: bool) -> int:
    """Programs of a persistent kernel: INTERPRET_NUM_SMS in interpret mode, else the device's SM count, or an
    H200's 132 where the device has none (lowering for CUDA on a CPU host). Callers go through this module
    (`interpret.num_sms(...)`), so a test or tool can set it."""
    if interpret:
        return INTERPRET_NUM_SMS
    return getattr(jax.devices()[0], "core_count", None) or 132


_warned_async = False


def _warn_if_async_dispatch() -> None:
    """Interpret mode can deadlock under the CPU client's asynchronous dispatch (tests/conftest.py says how);
    say so once, with the fix, instead of hanging silently."""
    global _warned_async
    if jax.config.read("jax_cpu_enable_async_dispatch") and not _warned_async:
        _warned_async = True
        warnings.warn(
            "Mosaic GPU interpret mode with jax_cpu_enable_async_dispatch=True can deadlock (XLA's in-flight "
            "computation limit is reached while a kernel's host callback launches nested computations); set "
            "jax.config.update('jax_cpu_enable_async_dispatch', False) before the first JAX computation",
            RuntimeWarning, stacklevel=3)


@contextlib.contextmanager
def gpu_interpret_mode():
    _warn_if_async_dispatch()
    with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
        yield


def reset_after_error() -> None:
    """Interpret mode keeps global state; after a kernel raised, it must be reset before the next run."""
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as ipc  # noqa: PLC0415

    reset = getattr(ipc, "reset_gpu_interpret_mode_state", None)
    if reset is not None:
        reset()


def launch(call, *args, interpret: bool):
    """Run a built `plgpu.kernel` call, inside interpret mode when asked (CPU tests)."""
    if interpret:
        with gpu_interpret_mode():
            return call(*args)
    return call(*args)
