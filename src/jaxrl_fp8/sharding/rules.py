"""Partition rules: the parameters' logical axis names -> mesh axes, for storage and for compute.

Every parameter of the model names its dimensions (`out_sharding` metadata: embed, heads, kv, mlp, expert,
vocab, None). A rule maps a logical name to a tuple of mesh axes, tried in order. Two layouts come out:

- storage: where the FP32 master, its gradient and its optimizer moments live between steps. `embed` is the
  FSDP dimension: it is split over `fsdp` and, for tensors without an expert dimension, also over `expert`
  (the expert axis is data-parallel for dense layers, so dense weights are ZeRO-3 sharded over it too).
- compute: the layout a weight has when it is multiplied. FSDP (`gathered`) names are all-gathered first,
  so only the splits that partition the GEMM itself remain (tensor: heads / kv / mlp / vocab; expert).
  Quantization happens in this layout, which is why the FP8 block check (`sharding.blocks`) uses it.

A mesh axis is used at most once per tensor (first dimension wins). A dimension that an axis product does not
divide keeps the longest prefix of its axes that does (possibly none) and the plan records a note, so a
vocabulary of 151 936 over tensor=3 is replicated rather than failing; quantized tensors are checked
separately and strictly.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxrl_fp8.sharding.mesh import BATCH_AXES

__all__ = ["PartitionRules", "DEFAULT_RULES", "leaf_name", "named_leaves", "logical_axes_of"]

DEFAULT_RULES: dict[str, tuple[str, ...]] = {
    "batch": BATCH_AXES,  # activations, token batches, KV cache rows
    "expert": ("expert",),
    "embed": ("fsdp", "expert"),
    "heads": ("tensor",),
    "kv": ("tensor",),
    "mlp": ("tensor",),
    "vocab": ("tensor",),
}


@dataclasses.dataclass(frozen=True)
class PartitionRules:
    """logical name -> mesh axes (tried in order); `gathered` names are storage-only (FSDP) splits."""

    rules: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=lambda: dict(DEFAULT_RULES))
    gathered: tuple[str, ...] = ("embed",)

    def spec(self, name: str, logical: tuple, shape: tuple[int, ...], mesh_sizes: Mapping[str, int], *,
             compute: bool = False, notes: list[str] | None = None) -> P:
        """PartitionSpec of tensor `name` with dimension names `logical` and `shape`."""
        if len(logical) != len(shape):
            raise ValueError(f"{name}: {len(logical)} logical axis names {logical} for a {len(shape)}-d tensor {shape}")
        used: set[str] = set()
        entries = []
        for dim, (ax, size) in enumerate(zip(logical, shape)):
            wanted = () if ax is None or (compute and ax in self.gathered) else tuple(self.rules.get(ax, ()))
            wanted = tuple(a for a in wanted if a not in used and mesh_sizes.get(a, 1) > 1)
            chosen = wanted
            while chosen and size % math.prod(mesh_sizes[a] for a in chosen):
                chosen = chosen[:-1]
            if chosen != wanted and notes is not None:
                dropped = ", ".join(f"{a}={mesh_sizes[a]}" for a in wanted[len(chosen):])
                notes.append(f"{name} dim {dim} ({ax}={size}) not split over {dropped}: not divisible")
            used.update(chosen)
            entries.append(None if not chosen else chosen[0] if len(chosen) == 1 else chosen)
        return P(*entries)


def _key_str(k) -> str:
    for attr in ("key", "idx", "name"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def leaf_name(path) -> str:
    """Dot-joined trainer path of a tree path: ['layers'][0]['moe']['up_proj']['weight'] -> layers.0.moe.up_proj.weight."""
    return ".".join(_key_str(k) for k in path)


def _is_var(x) -> bool:
    return isinstance(x, nnx.Variable)


def named_leaves(tree) -> list[tuple[str, Any]]:
    """(name, leaf) pairs, stopping at nnx Variables (which carry the logical axis names)."""
    return [(leaf_name(p), v) for p, v in jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_var)[0]]


def logical_axes_of(var) -> tuple | None:
    """The logical axis names an nnx Variable was created with (None when it has none)."""
    if not _is_var(var):
        return None
    meta = var.get_metadata()
    axes = meta.get("out_sharding", meta.get("sharding_names", meta.get("sharding")))
    return tuple(axes) if axes is not None else None


def map_shardings(tree, mesh, leaf_fn):
    """Tree of `tree`'s structure whose array leaves become NamedShardings; Variables keep their metadata.

    leaf_fn(name, logical_axes_or_None, value) -> PartitionSpec (value: an array or a QuantizedWeight).
    """
    def one(path, x):
        name = leaf_name(path)
        if _is_var(x):
            value = x.get_value()
            return x.replace(value=_value_shardings(name, logical_axes_of(x), value, mesh, leaf_fn))
        return _value_shardings(name, None, x, mesh, leaf_fn)

    return jax.tree_util.tree_map_with_path(one, tree, is_leaf=_is_var)


def _value_shardings(name, logical, value, mesh, leaf_fn):
    from jaxrl_fp8.precision import QuantizedWeight

    if isinstance(value, QuantizedWeight):
        from jaxrl_fp8.sharding.blocks import check_split

        spec = leaf_fn(name, logical, value)
        check_split(name, tuple(value.data.shape), spec, dict(mesh.shape), value.fmt, packed_k=value.fmt == "nvfp4")
        return quantized_weight_shardings(value, spec, mesh)
    return NamedSharding(mesh, leaf_fn(name, logical, value))


def quantized_weight_shardings(qw, spec: P, mesh):
    """A QuantizedWeight's data and scales split the same way (the block check makes the splits line up).

    data [..., N, K'] and scale [..., N or N/128, K/g] take the weight's spec; global_scale [...] (one per
    matrix, NVFP4) takes the spec of the leading (expert) dimensions.
    """
    entries = tuple(spec) + (None,) * (len(qw.data.shape) - len(tuple(spec)))
    lead = entries[:-2]
    gs = None if qw.global_scale is None else NamedSharding(mesh, P(*lead[: jax.numpy.ndim(qw.global_scale)]))
    return dataclasses.replace(qw, data=NamedSharding(mesh, P(*entries)), scale=NamedSharding(mesh, P(*entries)),
                               global_scale=gs)
