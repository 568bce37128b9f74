"""The one timing loop of the benchmark scripts (imported as `timing` when a script runs from this folder)."""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import statistics
import sys
import tempfile
import time

import jax


def bench(fn, *args, iters: int = 20, warmup: int = 3, reps: int = 5) -> tuple[float, float]:
    """Per-call seconds as (median, min) over `reps` repetitions of `iters` back-to-back calls.

    The calls of one repetition are enqueued together and synchronised once, so host dispatch and clock drops
    between calls are not timed; `warmup` calls first absorb compilation and autotuning.
    """
    d = bench_detail(fn, *args, iters=iters, warmup=warmup, reps=reps)
    return d["median_s"], d["min_s"]


def bench_detail(fn, *args, iters: int = 20, warmup: int = 3, reps: int = 5) -> dict:
    """bench's loop, with the spread and the host's enqueue time per call (median over reps).

    Why the enqueue time: when enqueuing a call takes about as long as running it, the GPU waits on the host and
    the median measures dispatch, not the kernel (then a faster kernel can't show).
    """
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times, enqueue = [], []
    for _ in range(reps):
        t = time.perf_counter()
        out = [fn(*args) for _ in range(iters)]
        enqueue.append((time.perf_counter() - t) / iters)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t) / iters)
        del out
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times),
            "enqueue_median_s": statistics.median(enqueue)}


# datasheet HBM bandwidth by device kind (a substring of jax's device_kind): an upper bound beside the measured copy
# anchor, never the roofline itself
_HBM_SPEC_BPS = (("H200", 4.8e12), ("H100 80GB HBM3", 3.35e12))


def hbm_spec_bandwidth(device_kind: str | None = None) -> float | None:
    """The datasheet HBM bandwidth of the device (default: the first one), None for a kind not listed (CPU)."""
    kind = device_kind if device_kind is not None else jax.devices()[0].device_kind
    return next((bps for name, bps in _HBM_SPEC_BPS if name in kind), None)


def copy_bandwidth(mib: int = 2048, warmup_s: float = 1.0) -> float:
    """Bytes/s of a device-to-device copy (one read and one write an element: x + 1 in float32), the anchor every
    roofline here divides by: the best of 5 rounds of 20 chained copies, after `warmup_s` of copying. Why the
    warm-up and the rounds: best-of-5 single copies straight after start-up measured 2.40-2.50 TB/s on an H100
    where warmed rounds measure ~2.9 (the memory clock had not ramped, and a single copy also times its own
    dispatch and sync), which made the decode roofline fractions look ~20 % better than they were. Chained (each
    copy reads the last one's output), so at most two buffers are alive."""
    import jax.numpy as jnp

    x = jnp.arange(mib * 2**20 // 4, dtype=jnp.float32)
    f = jax.jit(lambda a: a + 1.0)

    def chain(y, n):
        for _ in range(n):
            y = f(y)
        return jax.block_until_ready(y)

    chain(x, 1)
    start = time.perf_counter()
    while time.perf_counter() - start < warmup_s:
        chain(x, 10)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        chain(x, 20)
        best = min(best, (time.perf_counter() - t) / 20)
    return 2 * x.nbytes / best


def write_results(path: str, obj) -> None:
    """JSON to `path` through a temp file in the same folder, renamed into place (a cut-short run leaves the
    previous file intact, never half a file)."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
    with os.fdopen(fd, "w") as fh:
        json.dump(obj, fh, indent=1)
    os.replace(tmp, path)


def run_header(script: str, argv=None) -> dict:
    """What every result JSON opens with: date (UTC), the command that made it, the device, the versions and the XLA
    flags (the contract's own, and any A/B flag a run set: e.g. where the command buffers end)."""
    dev = jax.devices()[0]
    args = argv if argv is not None else sys.argv[1:]
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": f"python experiments/benchmarks/{script} " + " ".join(args),
            "device": {"platform": dev.platform, "kind": dev.device_kind, "count": jax.device_count()},
            "versions": {"python": platform.python_version(), "jax": jax.__version__,
                         "jaxlib": importlib.metadata.version("jaxlib"), "flax": importlib.metadata.version("flax")},
            "xla_flags": os.environ.get("XLA_FLAGS", "")}
