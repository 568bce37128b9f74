"""`ShardingPlan`: one mesh + one rule set -> shardings of every tree the trainer moves, and the jitted step.

The trainer's state is (params, opt_state): FP32 masters in an nnx.State whose Variables carry logical axis
names, and an optax state that mirrors them (Adam moments are Variables with the same metadata; counters are
scalars -> replicated). So one function, `state_shardings`, serves masters, gradients and optimizer state.
Token batches split their leading (row) axis over (data, fsdp, expert); scalars are replicated.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxrl_fp8.sharding import blocks, rules as R
from jaxrl_fp8.sharding.mesh import BATCH_AXES, MeshError

__all__ = ["ShardingPlan", "per_device_bytes"]


@dataclasses.dataclass
class ShardingPlan:
    mesh: Mesh
    rules: R.PartitionRules = dataclasses.field(default_factory=R.PartitionRules)
    notes: list[str] = dataclasses.field(default_factory=list)

    # ------------------------------------------------------------------------------------------ basics
    @property
    def sizes(self) -> dict[str, int]:
        return dict(self.mesh.shape)

    @property
    def batch_axes(self) -> tuple[str, ...]:
        return tuple(a for a in BATCH_AXES if self.sizes[a] > 1)

    @property
    def batch_shards(self) -> int:
        return math.prod(self.sizes[a] for a in self.batch_axes)

    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, P())

    def _spec_fn(self, compute: bool):
        def fn(name, logical, value):
            shape = tuple(np.shape(value)) if not hasattr(value, "shape") else tuple(value.shape)
            if logical is None:
                return P()
            return self.rules.spec(name, logical, shape, self.sizes, compute=compute, notes=self.notes)
        return fn

    # ---------------------------------------------------------------------------------------- state trees
    def state_shardings(self, tree) -> Any:
        """Storage shardings of params / grads / optimizer state (Variables by their logical names)."""
        return R.map_shardings(tree, self.mesh, self._spec_fn(compute=False))

    def compute_shardings(self, tree) -> Any:
        """The layout weights have when multiplied: storage minus the FSDP (gathered) splits."""
        return R.map_shardings(tree, self.mesh, self._spec_fn(compute=True))

    def shard(self, tree, shardings=None) -> Any:
        """Place `tree` (host or device arrays, same values on every process) on the mesh."""
        shardings = self.state_shardings(tree) if shardings is None else shardings
        return jax.tree.map(_place, tree, shardings)

    def constrain_compute(self, tree) -> Any:
        """Inside jit: gather FSDP splits (keep tensor / expert splits) before the weights are used."""
        return jax.lax.with_sharding_constraint(tree, self.compute_shardings(tree))

    # -------------------------------------------------------------------------------------------- batches
    def batch_sharding(self, ndim: int) -> NamedSharding:
        axes = self.batch_axes
        lead = None if not axes else axes[0] if len(axes) == 1 else axes
        return NamedSharding(self.mesh, P(lead, *([None] * (ndim - 1))))

    def batch_shardings(self, batch: Mapping[str, Any]) -> dict:
        """Leading axis of every array of a minibatch split over the batch axes; checks divisibility."""
        out = {}
        for key, x in batch.items():
            if x is None:
                out[key] = None
                continue
            shape = np.shape(x)
            if not shape:
                out[key] = self.replicated()
                continue
            if shape[0] % self.batch_shards:
                over = " x ".join(f"{a}={self.sizes[a]}" for a in self.batch_axes)
                raise MeshError(f"minibatch[{key!r}] has {shape[0]} rows, not a multiple of the {self.batch_shards} "
                                f"batch shards ({over}); make the minibatch size a multiple of it")
            out[key] = self.batch_sharding(len(shape))
        return out

    def put_batch(self, batch: Mapping[str, Any], *, process_local: bool = False) -> dict:
        """Device arrays of a minibatch. process_local=True: each process passes only its own rows (multi-host),
        the global batch is their concatenation in process order."""
        if not process_local:
            sh = self.batch_shardings(batch)
            return {k: None if v is None else _place(v, sh[k]) for k, v in batch.items()}
        out = {}
        for k, v in batch.items():
            if v is None:
                continue
            v = np.asarray(v)
            glob = (v.shape[0] * jax.process_count(), *v.shape[1:])
            sh = self.batch_shardings({k: _Shape(glob)})[k]
            out[k] = jax.make_array_from_process_local_data(sh, v, glob)
        return out

    def kv_cache_shardings(self, cache) -> Any:
        """KVCache k/v [B, S, Hkv, D]: rows over the batch axes, KV heads over tensor when they divide."""
        t = self.sizes["tensor"]

        def one(x):
            b, _, h, _ = x.shape
            lead = self.batch_sharding(1).spec[0] if b % self.batch_shards == 0 else None
            return NamedSharding(self.mesh, P(lead, None, "tensor" if t > 1 and h % t == 0 else None, None))

        lengths = self.batch_sharding(1) if cache.lengths.shape[0] % self.batch_shards == 0 else self.replicated()
        return dataclasses.replace(cache, k=tuple(one(x) for x in cache.k), v=tuple(one(x) for x in cache.v), lengths=lengths)

    # ------------------------------------------------------------------------------------------ validation
    def validate(self, params, policy) -> list[str]:
        """Block check of every quantized tensor (see sharding.blocks); returns the names checked."""
        named = [(n, v.get_value() if R._is_var(v) else v) for n, v in R.named_leaves(params)]
        logical = {n: R.logical_axes_of(v) for n, v in R.named_leaves(params)}
        shapes = {n: tuple(v.shape) for n, v in named}

        def spec_of(compute):
            def fn(name):
                if logical[name] is None:
                    return P()
                return self.rules.spec(name, logical[name], shapes[name], self.sizes, compute=compute)
            return fn

        return blocks.validate_quantized_layout(named, policy, spec_of(True), spec_of(False), self.sizes)

    # ------------------------------------------------------------------------------------------------ jit
    def jit_train_step(self, step_fn: Callable, params, opt_state, example_batch: Mapping[str, Any], *, donate: bool = True):
        """jit `step_fn(params, opt_state, minibatch, num_tokens) -> (params, opt_state, metrics)` with explicit
        in/out shardings: state in its storage layout in and out, the minibatch split by rows, scalars and
        metrics replicated. The state buffers are donated (updated in place)."""
        ps, os_ = self.state_shardings(params), self.state_shardings(opt_state)
        bs = {k: v for k, v in self.batch_shardings(example_batch).items() if v is not None}
        rep = self.replicated()
        return jax.jit(step_fn, in_shardings=(ps, os_, bs, rep), out_shardings=(ps, os_, rep),
                       donate_argnums=(0, 1) if donate else ())


class _Shape:
    def __init__(self, shape):
        self.shape = shape


def _place(x, sharding):
    """device_put that also works when the sharding spans other processes (every process holds the value)."""
    if x is None or sharding is None:
        return x
    if isinstance(x, jax.Array) and x.is_fully_addressable is False:
        return jax.device_put(x, sharding)
    if sharding.is_fully_addressable:
        return jax.device_put(x, sharding)
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])


def per_device_bytes(tree) -> dict[int, int]:
    """{device id: bytes of `tree`'s shards it holds} (measured from the arrays' addressable shards)."""
    out: dict[int, int] = {}
    for leaf in jax.tree.leaves(tree):
        if not isinstance(leaf, jax.Array):
            continue
        for shard in leaf.addressable_shards:
            out[shard.device.id] = out.get(shard.device.id, 0) + shard.data.nbytes
    return out
