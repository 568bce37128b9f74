"""The one timing loop of the benchmark scripts (imported as `timing` when a script runs from this folder)."""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time

import jax


def bench(fn, *args, iters: int = 20, warmup: int = 3, reps: int = 5) -> tuple[float, float]:
    """Per-call seconds as (median, min) over `reps` repetitions of `iters` back-to-back calls.

    The calls of one repetition are enqueued together and synchronised once, so host dispatch and clock drops
    between calls are not timed; `warmup` calls first absorb compilation and autotuning.
    """
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        out = [fn(*args) for _ in range(iters)]
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t) / iters)
        del out
    return statistics.median(times), min(times)


def write_results(path: str, obj) -> None:
    """JSON to `path` through a temp file in the same folder, renamed into place (a cut-short run leaves the
    previous file intact, never half a file)."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
    with os.fdopen(fd, "w") as fh:
        json.dump(obj, fh, indent=1)
    os.replace(tmp, path)
