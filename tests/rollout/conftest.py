"""Fixtures for rollout tests: fake engines in-thread and fake servers as real subprocesses."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # the test doubles live beside the tests

import jaxrl_fp8  # noqa: E402

SRC = Path(jaxrl_fp8.__file__).resolve().parents[1]


class ServerProcess:
    def __init__(self, proc: subprocess.Popen, port_file: Path, log_path: Path):
        self.proc, self.port_file, self.log_path = proc, port_file, log_path
        self.port: int | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout_s: float = 30.0) -> "ServerProcess":
        deadline = time.monotonic() + timeout_s
        while not self.port_file.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"fake server did not start: {self.log_path.read_text()[-2000:]}")
            time.sleep(0.02)
        self.port = int(self.port_file.read_text())
        return self

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def spawn_server(tmp_path: Path, name: str, *args: str) -> ServerProcess:
    """Start `fake_rollout_server.py` in a new process (a real process, so tests can SIGKILL it)."""
    port_file = tmp_path / f"{name}.port"
    log_path = tmp_path / f"{name}.log"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]))
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, str(HERE / "fake_rollout_server.py"), "--port-file", str(port_file),
                                 *args], stdout=log, stderr=subprocess.STDOUT, env=env)
    return ServerProcess(proc, port_file, log_path)


@pytest.fixture
def server_procs(tmp_path):
    """Factory: server_procs([(name, *cli_args), ...]) -> ready ServerProcesses (started in parallel).

    Every process is killed at teardown.
    """
    started: list[ServerProcess] = []

    def start(specs):
        procs = [spawn_server(tmp_path, name, *args) for name, *args in specs]
        started.extend(procs)
        return [p.wait_ready() for p in procs]

    yield start
    for sp in started:
        sp.kill()
