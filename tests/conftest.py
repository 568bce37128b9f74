"""Shared pytest set-up: one persistent compilation cache per run, compiled programs dropped after each test file,
GPU-marked tests skipped (with the reason) when no CUDA device is visible."""

import gc
import os
import tempfile
import warnings

import pytest

# One persistent compilation cache for the whole run, shared by the xdist workers and the training processes the
# tests start (they inherit the environment): the tiny model's programs are compiled once, not once per process
# (a SIGKILL-and-resume test runs the same training three times). Keys hash the program, options and versions.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(tempfile.gettempdir(), f"jaxrl_fp8_tests_jax_cache_{os.getuid()}"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")

# Mosaic GPU's interpreter runs each warpgroup of a kernel as its own jitted computation on its own Python thread,
# from inside a host callback, and the warpgroups meet at barriers inside further callbacks. XLA:CPU may run any of
# those computations on its intra-op pool, which has one thread per core by default: on a 2-core host the kernel's
# callback and one warpgroup parked at a barrier hold both pool threads while the warpgroup they wait for queues for
# one, forever (CI: a worker silent in `tests/pallas_kernels/test_gemm_grouped.py` until pytest-timeout killed it at
# 900 s, "node down", and the run passed its time limit; reproduced here, and with PJRT_NPROC=1 every time). A kernel
# needs at most 1 + its warpgroups (3) pool threads, two concurrent kernels twice that: 16 leaves room. PJRT_NPROC
# sizes the pool; read when the CPU client is created, so before any test touches JAX. Training processes the tests
# start inherit it. Set here, not by the package: only tests run the interpreter on CPU, and the tiny training run
# (60 steps, 2-core host) took 127-136 s with 16 pool threads against 120-122 s with the default 2.
os.environ.setdefault("PJRT_NPROC", str(max(16, os.cpu_count() or 1)))

import jaxrl_fp8  # noqa: F401  (first: sets the XLA flags of the precision contract before JAX starts)

import jax  # noqa: E402  (after jaxrl_fp8, see above)

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

# Mosaic GPU's interpret mode runs jitted code inside host callbacks of the kernel's own computation. With the CPU
# client's asynchronous dispatch, queued computations that wait on the kernel's outputs each hold one of XLA's
# 32 in-flight slots, and the callback's nested launch then waits for a slot forever (seen in CI and reproduced
# here: gdb shows the callback thread and the main thread in xla::Semaphore::Acquire under
# CpuPjRtRawLoadedExecutable::Execute). Inline dispatch holds a slot only while a computation runs. Read when the
# CPU client is created, so before any test touches JAX.
jax.config.update("jax_cpu_enable_async_dispatch", False)


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drops every compiled program when a test file ends. Each XLA:CPU executable keeps ~3 memory mappings while
    any jit cache holds it, and one xdist worker compiles tens of thousands (Mosaic GPU interpret mode jits inside
    its callbacks): past `vm.max_map_count` (65530 by default) LLVM cannot map the next one and the worker aborts
    (seen in CI at 91 %, inside the persistent cache's deserialization; here a worker reached 53k mappings without
    this, 15k with it). Later files recompile what they share, mostly from the persistent cache."""
    yield
    jax.clear_caches()
    gc.collect()
    mappings, limit = _memory_mappings()
    if mappings > 0.8 * limit:
        warnings.warn(f"this worker still holds {mappings} memory mappings after a test file (vm.max_map_count "
                      f"{limit}): past it the next compile aborts the worker")


def _memory_mappings() -> tuple[int, int]:
    """(this process's memory mappings, the kernel's vm.max_map_count); (0, 1) where /proc does not say."""
    try:
        with open(f"/proc/{os.getpid()}/maps") as maps, open("/proc/sys/vm/max_map_count") as limit:
            return sum(1 for _ in maps), int(limit.read())
    except (OSError, ValueError):
        return 0, 1


def _has_gpu() -> bool:
    try:
        import jax

        return any(d.platform == "gpu" for d in jax.devices())
    except RuntimeError:
        return False


def pytest_collection_modifyitems(config, items):
    # files with end-to-end (slow) tests first, so the two xdist workers (one file at a time) do not end on one of them
    slow_files = {item.path for item in items if "slow" in item.keywords}
    items.sort(key=lambda item: item.path not in slow_files)
    invariant = [item for item in items if "row_invariant_cpu" in item.keywords]
    if invariant:
        from jaxrl_fp8.ops.xla_gemm import cpu_dots_row_invariant

        if not cpu_dots_row_invariant():
            skip_host = pytest.mark.skip(
                reason="this host's XLA:CPU dots are not row invariant (jaxrl_fp8.ops.xla_gemm.cpu_dots_row_invariant; "
                "e.g. an AVX2-only AMD EPYC): bitwise row invariance on CPU holds only where they are")
            for item in invariant:
                item.add_marker(skip_host)
    if _has_gpu():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (run `pytest -m gpu` on the device machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
