"""Collocated rollout: the embedded engine runs on the training mesh with the trainer's sharded parameters.

`rollout.placement = "collocated"` (config) gives the `EmbeddedEngine` a `CollocatedPlacement`. Then:

- Weights arrive by reference: the trainer hands the engine its sharded (storage-layout) arrays, cast to the
  compute dtype on the devices; `prepare` quantizes them into the rollout operands inside ONE jitted program
  whose outputs stay on the mesh (no host copy, no gather of the model onto one device). The outputs are
  placed in the storage layout too (FSDP shards, experts on their devices); a stored `QuantizedWeight` keeps
  its scales next to its blocks, so a split that would cut a block is narrowed (`block_safe_spec`, recorded
  in `notes`). Every output is a fresh buffer: the trainer donates its own buffers to the next update.
- Inside each generate program the weights are put in the COMPUTE layout at use (`constrain_weights`, the
  same `ShardingPlan.constrain_compute` as the trainer's forward: FSDP shards gathered, expert / tensor
  splits kept), the MoE layers run expert-parallel (`make_moe_impl`, the trainer's own shard_map), and the
  rows of the prompt batch, the sampling parameters and the KV cache are split over the batch axes.
- A chunk has a multiple of 2 x (batch shards) rows, so every device holds at least two rows in a decode
  step: XLA:CPU's one-row matrix-vector path sums in another order (`ops.xla_gemm.pad_rows_min2`, which
  sees only the global shape), and that would break row invariance on the mesh.

The same sharded forward then runs in the trainer and in the engine, so unified recipes keep their
train-rollout log-probs equal bit for bit (tests/sharding/collocated.py measures it).

Multi-process jobs (jax.distributed, several hosts): the generate programs are SPMD over the whole mesh, so
every process must run the same programs on the same global inputs. `EmbeddedEngine.generate` therefore first
all-gathers the requests of every process (`EmbeddedEngine._union_rows`: prompt ids, sampling parameters with
the base seeds already drawn, the routed-experts flag; one host all-gather, in process order), and every
process schedules the identical ordered union (same sort, same chunks, same buckets, same compiled programs).
Host arrays enter the programs as global arrays built from that identical host value (`put_rows`:
`make_array_from_callback`, each process filling its own shards); results leave through `fetch`
(`process_allgather`, since a process cannot read shards on another host), and each process keeps only the
samples of its own requests, in its own order. Sampling is seeded per row and the forward is row invariant, so
a process's samples are bit for bit those a one-process engine draws for the same requests
(tests/sharding/two_process_collocated.py). Cost: every process decodes the union of all processes' rows on
the shared mesh (the rows are split over the batch axes, so the devices share the work, but the host side
handles every row and receives every chunk's outputs), plus host all-gathers: one of the requests per call and
one per output array of every chunk (tokens, log-probs, counts, routed experts if any process asked). A
request one process rejects fails `generate` on every process (none of them runs a chunk); `generate` is a
collective, so every process must call it as often as the others (the trainer does: one call per step).
Not supported on a multi-process job: `EmbeddedEngine.update_weights` from host buckets (it raises; the
trainer's push `update_params` works; `update_weights_from_disk` places its weights like the initial ones).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jaxrl_fp8.precision import QuantizedWeight
from jaxrl_fp8.sharding import rules as R
from jaxrl_fp8.sharding.blocks import GRANULARITY, _axes
from jaxrl_fp8.sharding.expert import make_moe_impl

__all__ = ["CollocatedPlacement", "PLACEMENTS", "block_safe_spec"]

PLACEMENTS = ("separate", "collocated")


def block_safe_spec(name: str, spec, value: QuantizedWeight, sizes, notes: list[str] | None = None):
    """`spec` with the axes of the N / K dims narrowed (last axis first) until no quantization block is cut."""
    if value.fmt not in GRANULARITY:
        return spec
    rows, cols, what = GRANULARITY[value.fmt]
    shape = tuple(value.data.shape)
    nd = len(shape)
    entries = list(tuple(spec) + (None,) * (nd - len(tuple(spec))))
    for dim, need in ((nd - 2, rows), (nd - 1, cols)):
        axes = _axes(entries[dim])
        size = shape[dim] * (2 if value.fmt == "nvfp4" and dim == nd - 1 else 1)
        kept = axes
        while kept and (size % math.prod(sizes[a] for a in kept) or (size // math.prod(sizes[a] for a in kept)) % need):
            kept = kept[:-1]
        if kept != axes and notes is not None:
            notes.append(f"rollout {name} dim {dim} (size {size}) not split over {', '.join(axes[len(kept):])}: "
                         f"it would cut a {need}-wide {what}")
        entries[dim] = None if not kept else kept[0] if len(kept) == 1 else kept
    return jax.sharding.PartitionSpec(*entries)


class CollocatedPlacement:
    """The embedded engine's view of the training mesh (hashable by identity: a static jit argument)."""

    def __init__(self, plan, *, moe: bool):
        self.plan = plan
        self.mesh = plan.mesh
        mesh_processes = {d.process_index for d in self.mesh.devices.flat}
        if len(mesh_processes) != jax.process_count():
            raise ValueError(f"config.rollout.placement='collocated' needs a training mesh over every process's devices; "
                             f"this mesh spans processes {sorted(mesh_processes)} of {jax.process_count()}")
        self.multi_process = jax.process_count() > 1
        self.moe_impl = make_moe_impl(plan.mesh) if moe else None
        self.notes: list[str] = []
        self._prepare_jit = {}

    # -------------------------------------------------------------------------------------------- shapes
    @property
    def row_multiple(self) -> int:
        """Rows of a chunk are a multiple of this: >= 2 rows on every device of the batch axes."""
        return 2 * self.plan.batch_shards

    def rows_for(self, n: int) -> int:
        m = self.row_multiple
        return -(-max(n, 1) // m) * m

    # ------------------------------------------------------------------------------------------- weights
    def weight_shardings(self, state):
        """Storage layout of the rollout operands (QuantizedWeights narrowed to whole blocks)."""
        base = self.plan._spec_fn(compute=False)
        sizes = self.plan.sizes

        def fn(name, logical, value):
            spec = base(name, logical, value)
            if isinstance(value, QuantizedWeight):
                spec = block_safe_spec(name, spec, value, sizes, self.notes)
            return spec

        return R.map_shardings(state, self.mesh, fn)

    def prepare(self, graphdef, state, prepare_fn):
        """prepare_fn(graphdef, state) -> rollout state, run as one jitted program on the mesh.

        The trainer's arrays are already on the mesh (taken by reference); others (the initial model, a
        checkpoint loaded from disk) are first placed in the storage layout."""
        mesh_devices = set(self.mesh.devices.flat)
        if any(isinstance(x, jax.Array) and set(x.sharding.device_set) != mesh_devices for x in jax.tree.leaves(state)):
            state = self.place(state)
        key = (graphdef, prepare_fn)
        if key not in self._prepare_jit:
            def fresh(gd, st):  # copies: the outputs never alias the trainer's (donated) buffers
                return jax.tree.map(lambda x: jnp.copy(x), prepare_fn(gd, st))

            abstract = jax.eval_shape(lambda st: fresh(graphdef, st), state)
            self._prepare_jit[key] = jax.jit(lambda st: fresh(graphdef, st), out_shardings=self.weight_shardings(abstract))
        return self._prepare_jit[key](state)

    def place(self, state):
        """`state` (host or device arrays, the same values on every process) in the storage layout on the mesh.
        Multi-process: each process fills its own shards from its copy (`plan.shard`); a jax.device_put of a
        one-device array onto devices of other processes is not possible."""
        if not self.multi_process:
            return jax.device_put(state, self.weight_shardings(state))
        return self.plan.shard(state, self.weight_shardings(state))

    def constrain_weights(self, state):
        """Inside jit: the compute layout (FSDP shards gathered at use, expert / tensor splits kept)."""
        return self.plan.constrain_compute(state)

    # ---------------------------------------------------------------------------------------------- rows
    def row_sharding(self, ndim: int):
        return self.plan.batch_sharding(ndim)

    def constrain_rows(self, x):
        return jax.lax.with_sharding_constraint(x, self.row_sharding(x.ndim))

    def put_rows(self, x: np.ndarray) -> jax.Array:
        """A host array of a chunk as a global array split over the batch axes. Multi-process: every process
        passes the same (global) value and fills the shards of its own devices."""
        x = np.asarray(x)
        sharding = self.row_sharding(x.ndim)
        if not self.multi_process:
            return jax.device_put(x, sharding)
        return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])

    def fetch(self, x) -> np.ndarray:
        """The whole value of an output array on the host of every process (a collective when multi-process:
        every process must fetch the same arrays in the same order)."""
        if not self.multi_process or not isinstance(x, jax.Array) or x.is_fully_addressable:
            return np.asarray(x)
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))

    def constrain_cache(self, cache):
        return jax.lax.with_sharding_constraint(cache, self.plan.kv_cache_shardings(cache))

