"""Multi-host start-up through JAX's own runtime (`jax.distributed.initialize`); no cluster manager of ours.

Where the coordinator address, process count and process id come from, first match wins:
1. `config.distributed.*` (coordinator_address non-empty),
2. the environment: JAXRL_COORDINATOR_ADDRESS / JAXRL_NUM_PROCESSES / JAXRL_PROCESS_ID (JAX's own
   JAX_COORDINATOR_ADDRESS etc. are read by JAX itself),
3. JAX's cluster auto-detection (SLURM, Open MPI, TPU pods, Kubernetes) when `auto_detect` is set,
otherwise the job is single-process and nothing is initialized. On CPU the cross-process collectives need an
implementation: `cpu_collectives` (default "gloo") is set before initialization.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import ml_collections

__all__ = ["DistributedConfig", "config_defaults", "initialize", "is_initialized", "allgather_json", "gather_process_states",
           "own_process_state", "global_count", "allgather_rows", "local_rows", "is_writer", "barrier", "ENV_ADDRESS",
           "ENV_NUM", "ENV_ID"]

ENV_ADDRESS = "JAXRL_COORDINATOR_ADDRESS"
ENV_NUM = "JAXRL_NUM_PROCESSES"
ENV_ID = "JAXRL_PROCESS_ID"


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    coordinator_address: str = ""  # host:port of process 0
    num_processes: int = 0  # 0: from the environment / auto-detection
    process_id: int = -1  # -1: from the environment / auto-detection
    local_device_ids: tuple[int, ...] = ()  # () : all local devices
    auto_detect: bool = False  # let JAX detect SLURM / MPI / TPU / k8s clusters
    cpu_collectives: str = "gloo"  # gloo | mpi | none (CPU backend only)
    initialization_timeout_s: int = 300

    @classmethod
    def from_config(cls, c) -> "DistributedConfig":
        if c is None:
            return cls()
        if isinstance(c, DistributedConfig):
            return c
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(c.keys()) - known)
        if unknown:
            raise ValueError(f"config.distributed.{unknown[0]}: unknown key; known keys: {', '.join(sorted(known))}")
        kw = {k: c[k] for k in c.keys()}
        if "local_device_ids" in kw:
            kw["local_device_ids"] = tuple(int(i) for i in kw["local_device_ids"] or ())
        return cls(**kw)

    def resolved(self, environ=None) -> "DistributedConfig | None":
        """The settings to initialize with, or None for a single-process job. Raises naming the key."""
        env = os.environ if environ is None else environ
        addr, num, pid = self.coordinator_address, self.num_processes, self.process_id
        src = "config.distributed"
        if not addr and env.get(ENV_ADDRESS):
            addr, src = env[ENV_ADDRESS], "environment"
            num = num or _env_int(env, ENV_NUM)
            pid = pid if pid >= 0 else _env_int(env, ENV_ID)
        if not addr:
            return dataclasses.replace(self) if self.auto_detect else None
        if num < 1:
            raise ValueError(f"{src}: coordinator_address={addr!r} needs num_processes >= 1 (config.distributed.num_processes "
                             f"or {ENV_NUM})")
        if not 0 <= pid < num:
            raise ValueError(f"{src}: process_id={pid} must be in [0, num_processes={num}) (config.distributed.process_id or "
                             f"{ENV_ID})")
        if ":" not in addr:
            raise ValueError(f"{src}: coordinator_address={addr!r} must be host:port")
        return dataclasses.replace(self, coordinator_address=addr, num_processes=num, process_id=pid)


def _env_int(env, key: str) -> int:
    value = env.get(key, "")
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {key}={value!r} must be an integer") from None


def config_defaults() -> ml_collections.ConfigDict:
    """`config.distributed` (all empty: single process unless the environment says otherwise)."""
    c = ml_collections.ConfigDict()
    for f in dataclasses.fields(DistributedConfig):
        c[f.name] = f.default if f.name != "local_device_ids" else ()
    return c


_STATE = {"initialized": False}


def is_initialized() -> bool:
    return _STATE["initialized"]


def initialize(config=None, *, environ=None) -> bool:
    """Initialize jax.distributed if the config / environment asks for it; returns whether it did.

    Must run before anything touches a JAX device (it sets the CPU collectives implementation too).
    """
    cfg = DistributedConfig.from_config(config).resolved(environ)
    if cfg is None:
        return False
    if cfg.cpu_collectives and cfg.cpu_collectives != "none":
        jax.config.update("jax_cpu_collectives_implementation", cfg.cpu_collectives)
    kw = dict(initialization_timeout=cfg.initialization_timeout_s)
    if cfg.local_device_ids:
        kw["local_device_ids"] = list(cfg.local_device_ids)
    if cfg.coordinator_address:
        jax.distributed.initialize(cfg.coordinator_address, cfg.num_processes, cfg.process_id, **kw)
    else:
        jax.distributed.initialize(**kw)  # auto-detection
    _STATE["initialized"] = True
    return True


def allgather_json(obj) -> list:
    """Every process's JSON-serializable `obj`, in process order (a collective: all processes must call it)."""
    import json

    import numpy as np

    data = np.frombuffer(json.dumps(obj, sort_keys=True).encode(), np.uint8)
    if jax.process_count() == 1:
        return [json.loads(data.tobytes().decode())]
    from jax.experimental import multihost_utils

    lengths = np.asarray(multihost_utils.process_allgather(np.int32(data.size)))
    padded = np.zeros((int(lengths.max()),), np.uint8)
    padded[: data.size] = data
    rows = np.asarray(multihost_utils.process_allgather(padded))
    return [json.loads(rows[i, : int(lengths[i])].tobytes().decode()) for i in range(len(lengths))]


def gather_process_states(state) -> dict:
    """{process index: state} of a per-process value (e.g. the data iterator, sharded by process), to be saved
    once in checkpoint metadata (Orbax writes JSON metadata from process 0 only)."""
    return {str(i): s for i, s in enumerate(allgather_json(state))}


def own_process_state(states: dict):
    """This process's entry of `gather_process_states(...)`; fails naming the index when it is missing."""
    key = str(jax.process_index())
    if key not in states:
        raise ValueError(f"checkpoint metadata has data-iterator states for processes {sorted(states)}, not for process "
                         f"{key}: resume with the same number of processes ({jax.process_count()} now)")
    return states[key]


# ------------------------------------------------------------------------------------------------------------
# Multi-host pieces of the training step and of file writes (each is the identity / a no-op on one process)


def global_count(n) -> int:
    """Sum over processes of a per-process integer (e.g. a minibatch's response tokens); a collective."""
    if jax.process_count() == 1:
        return int(n)
    import numpy as np
    from jax.experimental import multihost_utils

    return int(np.asarray(multihost_utils.process_allgather(np.int32(n))).astype(np.int64).sum())


def allgather_rows(x):
    """Every process's rows of a per-process numpy array, concatenated in process order (a collective)."""
    import numpy as np

    if jax.process_count() == 1:
        return np.asarray(x)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(np.asarray(x), tiled=True))


def local_rows(x):
    """This process's rows of a global array split by rows (the inverse of `ShardingPlan.put_batch(...,
    process_local=True)`): its addressable row blocks in global order, replicas counted once."""
    import numpy as np

    if not isinstance(x, jax.Array) or x.is_fully_addressable:
        return np.asarray(x)
    if x.ndim == 0:
        return np.asarray(x.addressable_data(0))
    blocks = {}
    for shard in x.addressable_shards:
        blocks.setdefault(shard.index[0].start or 0, shard.data)
    return np.concatenate([np.asarray(blocks[k]) for k in sorted(blocks)], axis=0)


def is_writer() -> bool:
    """Whether this process writes shared files (exports, plots, metrics, config): process 0 only."""
    return jax.process_index() == 0


def barrier(name: str) -> None:
    """All processes wait here (no-op on one process), e.g. until process 0 has renamed a file into place."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)
