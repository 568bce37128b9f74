"""Run the multi-device scripts of this directory in fresh interpreters (the pytest process has 1 device)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
# Fast XLA:CPU compiles (the scripts compile several train steps); every mesh of a script uses the same flags.
XLA_FLAGS = "--xla_backend_optimization_level=0"


def env() -> dict:
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join([os.path.join(ROOT, "src"), ROOT, e.get("PYTHONPATH", "")])
    e["XLA_FLAGS"] = XLA_FLAGS
    e.pop("JAX_PLATFORMS", None)
    e["JAX_PLATFORMS"] = "cpu"
    return e


def run_script(name: str, *args: str, timeout: int) -> subprocess.CompletedProcess:
    p = subprocess.run([sys.executable, os.path.join(HERE, name), *args], env=env(), capture_output=True, text=True,
                       timeout=timeout)
    if p.returncode:
        raise AssertionError(f"{name} {' '.join(args)} failed (rc {p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}")
    return p


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def run_processes(name: str, argsets: list[list[str]], *, timeout: int) -> list[str]:
    """Start one process per argument list, wait for all; on any failure or timeout kill the others."""
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, name), *a], env=env(), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for a in argsets]
    outs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            outs.append(out)
            if p.returncode:
                raise AssertionError(f"{name} {argsets[len(outs) - 1]} failed (rc {p.returncode}):\n{_tail(out)}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return outs


def _tail(out: str) -> str:
    lines = [ln for ln in out.splitlines() if not ln.lstrip().startswith("@") and "Gloo" not in ln]
    return "\n".join(lines[-60:])
