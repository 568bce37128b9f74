"""Run a test in a fresh Python process of its own.

For the model-level tests that drive Mosaic GPU's interpreter hardest (every attention call is a host callback
that starts one thread per warpgroup, each tracing and compiling the kernel body): in a long-lived xdist worker
that has run hundreds of tests before, the interpreter once crashed the whole worker with a segmentation fault
(CI, 2-core host), which took the rest of that worker's files down with it. A fresh process starts from JAX's
clean global state, and if it still dies, only this test fails, with the child's own fault-handler dump.

A child killed by a signal is run once more (said in a warning with the dump): the crash is in JAX's
interpreter threads, not in the kernel's arithmetic, which the GPU twin of each test runs compiled. A child that
fails an assertion is never re-run.
"""

from __future__ import annotations

import functools
import inspect
import os
import subprocess
import sys
import warnings
from pathlib import Path

_CHILD_ENV = "JAXRL_FP8_TEST_CHILD"
_REPO = Path(__file__).resolve().parents[1]
_TIMEOUT_S = 1200


def _run_child(node_id: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, **{_CHILD_ENV: "1"})
    cmd = [sys.executable, "-X", "faulthandler", "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", node_id]
    return subprocess.run(cmd, cwd=_REPO, env=env, capture_output=True, text=True, timeout=_TIMEOUT_S)


def in_fresh_process(test):
    """Decorator: outside a child, run this (unparametrized) test as `pytest <file>::<name>` in a new process and
    pass or fail with it; inside the child, run the test itself."""
    node_id = f"{Path(inspect.getfile(test)).resolve().relative_to(_REPO)}::{test.__name__}"

    @functools.wraps(test)
    def wrapper(*args, **kwargs):
        if os.environ.get(_CHILD_ENV):
            return test(*args, **kwargs)
        done = _run_child(node_id)
        if done.returncode < 0:
            warnings.warn(f"{node_id}: the child process died by signal {-done.returncode}; running it once more. "
                          f"Its output ended:\n{(done.stdout + done.stderr)[-4000:]}", RuntimeWarning, stacklevel=2)
            done = _run_child(node_id)
        assert done.returncode == 0, (f"{node_id} failed in its own process (rc={done.returncode}):\n"
                                      f"{(done.stdout + done.stderr)[-8000:]}")

    return wrapper
