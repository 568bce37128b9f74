"""Crash safety: a training CLI killed with SIGKILL while it runs resumes to the same numbers as an uninterrupted run,
and a process killed in the middle of a checkpoint write leaves the previous checkpoint restorable.

Both tests use real processes and real signals (no clean shutdown path runs): the first drives
`python -m jaxrl_fp8.train` exactly as a user would, the second stops Orbax inside its commit step.
"""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from jaxrl_fp8.metrics import read_metrics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "experiments", "configs", "tiny.py")
TIMING = {"time", "rollout_seconds", "train_seconds", "logprob_seconds", "update_seconds", "sync_seconds", "step_seconds",
          "tokens_per_second"}
STEPS, EVERY = 12, 3
TIMEOUT = 600


def _train_cmd(workdir) -> list[str]:
    """The default config at test sizes; async checkpointing stays on (the default), so a save may be in flight."""
    overrides = {
        "workdir": str(workdir), "total_steps": STEPS, "seed": 0,
        "data.prompts_per_step": 4, "rollout.n_samples": 4, "rollout.max_new_tokens": 3,
        "checkpoint.every_steps": EVERY, "checkpoint.export_final_hf": False,
        "logging.eval_every_steps": 0, "logging.plot_at_end": False, "logging.tensorboard": False,
        "logging.progress_bar": False,
    }
    return [sys.executable, "-m", "jaxrl_fp8.train", f"--config={TINY}", *(f"--config.{k}={v}" for k, v in overrides.items())]


def _env() -> dict:
    env = dict(os.environ)
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.join(ROOT, "src"), ROOT, env.get("PYTHONPATH", "")) if p)
    return env


def _committed_steps(ckpt_dir) -> list[int]:
    """Steps whose final directory exists (Orbax renames `<step>.orbax-checkpoint-tmp` to `<step>` on commit)."""
    if not os.path.isdir(ckpt_dir):
        return []
    return sorted(int(n) for n in os.listdir(ckpt_dir) if n.isdigit())


def _metric_steps(workdir) -> list[int]:
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        lines = [line for line in f.read().split("\n") if line.strip()]
    steps = []
    for line in lines:
        try:
            steps.append(json.loads(line)["step"])
        except json.JSONDecodeError:  # a line being written right now
            break
    return steps


def _start(workdir) -> subprocess.Popen:
    """The CLI in a subprocess; its output goes to a file (a pipe nobody reads could fill up and stall it)."""
    log = open(f"{workdir}.log", "a")
    proc = subprocess.Popen(_train_cmd(workdir), env=_env(), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    log.close()
    proc.log_path = log.name
    return proc


def _tail(proc: subprocess.Popen) -> str:
    with open(proc.log_path) as f:
        return f.read()[-4000:]


def _finish(proc: subprocess.Popen) -> None:
    proc.wait(timeout=TIMEOUT)
    assert proc.returncode == 0, _tail(proc)


def _deterministic(record: dict) -> dict:
    return {k: v for k, v in record.items() if k not in TIMING}


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def _kill_after_checkpoint(proc: subprocess.Popen, workdir) -> None:
    """SIGKILL `proc` once a checkpoint is committed *and* the run has gone past it: the steps after the checkpoint
    are lost work the resume must redo (and drop from metrics.jsonl), and the next async save may be in flight."""
    deadline = time.monotonic() + TIMEOUT
    while True:
        if proc.poll() is not None:
            pytest.fail(f"training exited (rc={proc.returncode}) before it could be killed:\n{_tail(proc)}")
        assert time.monotonic() < deadline, "no checkpoint within the time limit"
        committed = _committed_steps(os.path.join(workdir, "checkpoints"))
        if committed and committed[-1] < STEPS - EVERY and max(_metric_steps(workdir), default=0) > committed[-1]:
            break
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL, f"rc={proc.returncode}: the kill did not hit a running process"


@pytest.mark.slow
def test_sigkill_mid_run_then_resume_matches_uninterrupted(tmp_path):
    killed, straight = tmp_path / "killed", tmp_path / "straight"
    reference = _start(straight)  # the uninterrupted run, alongside (two processes at most)
    try:
        proc = _start(killed)
        try:
            _kill_after_checkpoint(proc, killed)
        finally:
            _stop(proc)
        killed_at = time.time()
        last_complete = _committed_steps(killed / "checkpoints")[-1]
        steps_at_kill = _metric_steps(killed)
        assert 0 < last_complete < max(steps_at_kill) < STEPS, (last_complete, steps_at_kill)
        leftovers = sorted(n for n in os.listdir(killed / "checkpoints") if not n.isdigit())
        print(f"killed after step {max(steps_at_kill)}, last committed checkpoint {last_complete}, other entries {leftovers}")
        _finish(_start(killed))  # the same command again: resumes from `last_complete`
        _finish(reference)
    finally:
        _stop(reference)
    a, b = read_metrics(str(straight)), read_metrics(str(killed))
    assert [r["step"] for r in a] == list(range(1, STEPS + 1))
    assert [r["step"] for r in b] == list(range(1, STEPS + 1)), "one record per step after the resume"
    for ra, rb in zip(a, b):  # bit for bit: the step after the checkpoint and every one before and after it
        assert _deterministic(rb) == _deterministic(ra), (ra["step"], last_complete)
    assert all(r["train_rollout_logprob_abs_diff"] == 0.0 for r in b)
    # and it really resumed (a restart from scratch would match too, the run being deterministic): the records up to
    # the checkpoint are the killed process's, every later one was written by the resumed process
    assert all((r["time"] < killed_at) == (r["step"] <= last_complete) for r in b), [(r["step"], r["time"] - killed_at) for r in b]


_CHILD = textwrap.dedent("""
    import sys, time
    import numpy as np
    import orbax.checkpoint._src.path.atomicity as atomicity
    from jaxrl_fp8.checkpoint import Checkpointer

    directory, marker, level = sys.argv[1], sys.argv[2], sys.argv[3]
    ckpt = Checkpointer(directory, max_to_keep=3, async_save=True)
    state = lambda k: {"w": np.full((256, 128), float(k), np.float32), "b": np.arange(7, dtype=np.float32) * k}
    ckpt.save(1, state(1), {"step": 1})
    ckpt.wait()

    original = atomicity.AtomicRenameTemporaryPath.finalize

    async def stall_before_commit(self):
        # Orbax commits each item's tmp directory (state/, meta/) inside the step's tmp directory, then the step's.
        # "item": stop at the first item commit (arrays partly committed); "step": everything of step 2 is written
        # and only the step directory's rename is left.
        is_step = str(self.get_final().parent) == directory
        if is_step == (level == "step"):
            open(marker, "w").write(str(self.get()))
            time.sleep(3600)
        await original(self)

    atomicity.AtomicRenameTemporaryPath.finalize = stall_before_commit
    ckpt.save(2, state(2), {"step": 2})
    ckpt.wait()
""")


@pytest.mark.parametrize("level", ["item", "step"])
def test_kill_during_checkpoint_write_keeps_last_complete(tmp_path, level):
    from jaxrl_fp8.checkpoint import Checkpointer

    directory, marker = tmp_path / "checkpoints", tmp_path / "in_commit"
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, str(directory), str(marker), level], env=_env(), cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while not (marker.exists() and marker.read_text()):
            assert proc.poll() is None, f"child exited (rc={proc.returncode}):\n{proc.stderr.read()[-4000:]}"
            assert time.monotonic() < deadline, "the child never reached the commit step"
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL

    # What the kill left: step 1 committed, step 2 only as Orbax's temporary directory (verified, not assumed).
    names = sorted(os.listdir(directory))
    stalled = marker.read_text()
    step_tmp = stalled if level == "step" else os.path.dirname(stalled)
    assert os.path.dirname(step_tmp) == str(directory), stalled
    assert os.path.basename(step_tmp).startswith("2.orbax-checkpoint-tmp"), stalled
    assert os.path.basename(step_tmp) in names and "1" in names and "2" not in names, names
    assert os.listdir(stalled), "the interrupted write had already put files into the tmp directory"
    if level == "step":  # both items were committed (renamed) inside the step's tmp directory before the kill
        assert {"state", "meta"} <= set(os.listdir(stalled)), os.listdir(stalled)
    else:
        assert os.path.basename(stalled).endswith(".orbax-checkpoint-tmp"), stalled

    ckpt = Checkpointer(str(directory), max_to_keep=3, async_save=False)
    assert ckpt.latest_step == 1 and ckpt.all_steps() == [1]
    abstract = {"w": np.zeros((256, 128), np.float32), "b": np.zeros(7, np.float32)}
    state, meta = ckpt.restore(None, abstract)
    assert meta == {"step": 1}
    np.testing.assert_array_equal(np.asarray(state["w"]), np.full((256, 128), 1.0, np.float32))
    np.testing.assert_array_equal(np.asarray(state["b"]), np.arange(7, dtype=np.float32))
    # and the run can go on: the interrupted step is written again and becomes the latest
    ckpt.save(2, {"w": np.full((256, 128), 2.0, np.float32), "b": np.arange(7, dtype=np.float32) * 2}, {"step": 2})
    ckpt.close()
    again = Checkpointer(str(directory), max_to_keep=3, async_save=False)
    assert again.latest_step == 2
    state, meta = again.restore(None, abstract)
    assert meta == {"step": 2} and float(np.asarray(state["w"])[0, 0]) == 2.0
    again.close()
