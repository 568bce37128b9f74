"""One compiled kernel per distinct kernel, not per call site.

Mosaic GPU keys its compiled kernels by a SHA-256 of the serialized kernel module (`kernel_hash`). In jax 0.11.2
every lowering also stamps the module with a per-process counter, `mosaic_gpu.dump_basename = "<name>_<n>"` (only
used to name dump files), so the same kernel called from 48 layers hashes 48 ways and is compiled by ptxas 48
times. Measured cause on CPU (the lowered modules of three identical call sites differ in that one string
and nowhere else); the H200 compile time of the embedded engine's decode program (~58 s for 6 layers)
is what it should shorten (not yet re-measured).

`install()` wraps Mosaic GPU's serialization step to drop that attribute, unless Mosaic dumps are requested
(then the counter names the files, as upstream intends). Identical kernels then share one hash and one compile;
different kernels still differ (the hash covers the whole module). If jax's internals move, this does nothing.

`traced_once(...)` fixes the other half, the lowering: every call site of a kernel entry point traced the kernel
body and lowered it to a Mosaic module again (measured here by lowering the 6-layer decode step of
experiments/benchmarks/decode.py for CUDA on the CPU: 28 of its 29 s of lowering went to 51 Mosaic lowerings of
13 distinct kernels). Wrapped in `jax.jit` with its configuration static, an entry point is traced once per
(shapes, configuration), and JAX lowers each distinct jitted call once per program. Measured on this CPU, lowering
for CUDA: the decode step 51 -> 14 Mosaic lowerings (lowering 21 -> 4.3 s); a 4-layer FP8 training step (forward and
fp8 backward) 103 -> 34 (26 distinct), trace 21.2 -> 4.4 s, lowering 37.0 -> 6.5 s. GPU compile times not re-measured.
"""

from __future__ import annotations

import os

_ATTR = "mosaic_gpu.dump_basename"
_installed = False


def _dumping() -> bool:
    return any(k.startswith("MOSAIC_GPU_DUMP") and v not in ("", "0") for k, v in os.environ.items())


def install() -> bool:
    """Idempotent. Returns True when the serialization step is wrapped."""
    global _installed
    if _installed:
        return True
    try:
        from jax.experimental.mosaic.gpu import core
    except ImportError:
        return False
    serde = getattr(core, "_run_serde_pass", None)
    if serde is None:
        return False

    def run_serde_pass(module, *, serialize, ir_version=None):
        if serialize and not _dumping():
            attrs = module.operation.attributes
            if _ATTR in attrs:
                del attrs[_ATTR]
        return serde(module, serialize=serialize, ir_version=ir_version)

    core._run_serde_pass = run_serde_pass
    _installed = True
    return True


def traced_once(*static_argnames: str):
    """Decorator for a kernel entry point: call it through one `jax.jit`, static in `static_argnames` (its
    configuration: block sizes, dtypes, tiles, interpret), so identical calls share one trace and one lowering.
    Numerics are unchanged: the body is the same, now inlined by XLA from a call. `__wrapped__` is the bare function."""
    import jax

    return lambda fn: jax.jit(fn, static_argnames=static_argnames)
