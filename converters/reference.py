"""Reference weights for `converters.verify`: an HF BF16 directory, trainer parameters, or an Orbax checkpoint.

Every source answers the same four questions the conversion step asks of its input (`names`, `read`,
`file_of`, `in`), so verification replays exactly the converter's per-tensor step on it.

Orbax: the trainer's checkpoint layout is NOT final yet. `open_reference` restores an Orbax directory with
`orbax.checkpoint.StandardCheckpointer` (no target: arrays come back as saved) and looks for the parameter
tree as the first nested mapping that holds both `embed` and `layers` (trainer paths of names.TABLE), so a
tree saved as {"params": ...}, {"state": {"params": ...}} or the bare parameter tree all work. When the
trainer's layout is fixed, replace `_find_param_tree` by the exact path. The whole tree is held in memory.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import numpy as np

from jaxrl_fp8.model.hf_io import INDEX_NAME, SINGLE_NAME, CheckpointError

from converters.export import _plan, flatten_params
from converters.pipeline import SourceCheckpoint

__all__ = ["HFReference", "ParamsReference", "open_reference", "is_orbax_dir"]


class HFReference:
    """An HF BF16 checkpoint directory, read one tensor at a time."""

    def __init__(self, path: str):
        self.src = SourceCheckpoint.open(path)
        self.path = path
        self.config = self.src.config

    def names(self) -> list[str]:
        return self.src.names()

    def read(self, name: str) -> np.ndarray:
        return self.src.read(name)

    def file_of(self, name: str) -> str:
        return self.src.file_of(name)

    def __contains__(self, name: str) -> bool:
        return name in self.src

    def describe(self) -> str:
        return f"HF checkpoint {self.path}"


class ParamsReference:
    """Trainer parameters (nested mapping / nnx.State / nnx.Module) seen through their HF names."""

    def __init__(self, params, path: str = "<trainer parameters>", config: dict | None = None):
        self.flat = flatten_params(params)
        self.plan = {hf: (p, e) for hf, p, e in _plan(self.flat)}
        self.path = path
        self.config = config

    def names(self) -> list[str]:
        return list(self.plan)

    def read(self, name: str) -> np.ndarray:
        if name not in self.plan:
            raise CheckpointError(f"{self.path} has no parameter for HF tensor {name!r}")
        path, expert = self.plan[name]
        value = self.flat[path]
        return np.asarray(value if expert is None else value[expert])

    def file_of(self, name: str) -> str:
        path, expert = self.plan[name]
        return f"{self.path}:{path}" + ("" if expert is None else f"[{expert}]")

    def __contains__(self, name: str) -> bool:
        return name in self.plan

    def describe(self) -> str:
        return f"trainer parameters {self.path}"


def is_orbax_dir(path: str) -> bool:
    markers = ("_CHECKPOINT_METADATA", "_METADATA", "manifest.ocdbt", "checkpoint")
    return os.path.isdir(path) and any(os.path.exists(os.path.join(path, m)) for m in markers)


def _find_param_tree(tree):
    if isinstance(tree, Mapping):
        if "embed" in tree and "layers" in tree:
            return tree
        for value in tree.values():
            found = _find_param_tree(value)
            if found is not None:
                return found
    return None


def open_reference(path: str):
    """HFReference for an HF directory; ParamsReference for an Orbax checkpoint of trainer parameters."""
    if os.path.isfile(os.path.join(path, INDEX_NAME)) or os.path.isfile(os.path.join(path, SINGLE_NAME)):
        return HFReference(path)
    if is_orbax_dir(path):
        import orbax.checkpoint as ocp

        tree = ocp.StandardCheckpointer().restore(os.path.abspath(path))
        params = _find_param_tree(tree)
        if params is None:
            raise CheckpointError(f"Orbax checkpoint {path}: no parameter tree with 'embed' and 'layers' found (top-level keys: {sorted(tree) if isinstance(tree, Mapping) else type(tree).__name__})")
        return ParamsReference(params, path)
    raise CheckpointError(f"reference {path!r} is neither an HF checkpoint ({INDEX_NAME} / {SINGLE_NAME}) nor an Orbax checkpoint")
