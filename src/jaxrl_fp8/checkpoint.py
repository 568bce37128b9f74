"""Orbax checkpoints of the trainer: params (FP32 masters), optimizer state, RNG, step and data-iterator state.

Orbax writes each step into a temporary directory and renames it when complete, so a run killed during a
save (or a failed step) leaves the previous checkpoint valid. Saves are asynchronous: the train loop goes on
while arrays are written, and `wait()` is called before exit.

Verified with SIGKILL (tests/test_kill_resume.py, orbax-checkpoint 0.12): step N goes to `N.orbax-checkpoint-tmp/`,
whose items (`state/`, `meta/`) are committed inside it first, then the directory is renamed to `N/`. A kill before
that rename leaves the tmp directory on disk; `latest_step` ignores it, the previous step restores, and saving step
N again replaces it. A run killed between steps resumes bit for bit from its last committed step.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import orbax.checkpoint as ocp

__all__ = ["Checkpointer"]


class Checkpointer:
    def __init__(self, directory: str, *, max_to_keep: int = 3, async_save: bool = True):
        self.directory = os.path.abspath(directory)
        options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, enable_async_checkpointing=async_save, create=True)
        self._manager = ocp.CheckpointManager(self.directory, options=options)

    @property
    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def save(self, step: int, state: Any, meta: dict) -> None:
        """`state`: a pytree of arrays (params, opt state, rng); `meta`: JSON (data iterator state, versions)."""
        self._manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)))

    def restore(self, step: int | None, abstract_state: Any) -> tuple[Any, dict]:
        """Restore into the structure/shardings of `abstract_state` (arrays or jax.ShapeDtypeStruct leaves)."""
        step = self.latest_step if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        abstract = jax.tree.map(_as_abstract, abstract_state)
        out = self._manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
        return out["state"], out["meta"]

    def wait(self) -> None:
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()


def _as_abstract(x):
    if isinstance(x, jax.ShapeDtypeStruct):
        return x
    sharding = getattr(x, "sharding", None)
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
