"""Versioned weight updates for a set of rollout servers, all-or-nothing.

From disk (the default path): the trainer's exporter writes a checkpoint into a directory every server
can read; then
    pause_generation(abort) on all → update_weights_from_disk{model_path, load_format, weight_version,
    flush_cache} on all (concurrently) → retry the failures → verify each server's /model_info
    weight_version → continue_generation on all.
If some server still fails, every server is rolled back to the previous checkpoint (same request,
previous path and version) and `WeightSyncError` names the failing server: the servers stay on one
version. A server that cannot be rolled back either is listed in `WeightSyncError.quarantine`, and a
fleet takes it out of rotation. `continue_generation` is always sent, even on failure.

"abort" is the pause mode because it is the only one under which no sample mixes versions: the
in-flight requests come back aborted and the fleet re-sends them after the update.

NCCL (optional, `NcclWeightBroadcaster`): `/init_weights_update_group` once, then per push
`/update_weights_from_distributed{names, dtypes, shapes, group_name, weight_version, flush_cache}` on
every server while the trainer broadcasts each tensor from rank 0 of a dedicated torch.distributed
group. UNTESTED against SGLang: needs torch with NCCL, GPUs and a real SGLang server; the HTTP side is
the same client code the disk path uses.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from jaxrl_fp8.rollout.sglang_client import RetryPolicy, SGLangClient, SGLangError, ServerUnavailable

log = logging.getLogger(__name__)


class WeightSyncError(SGLangError):
    """A push failed. `quarantine` lists servers left on an unknown or wrong version."""

    def __init__(self, message: str, *, failed: dict[str, str], quarantine: Sequence[str] = ()):
        super().__init__(message)
        self.failed = dict(failed)
        self.quarantine = list(quarantine)


@dataclasses.dataclass(frozen=True)
class WeightSyncConfig:
    load_format: str | None = None
    flush_cache: bool = True
    pause_mode: str = "abort"
    retries: int = 2  # extra rounds for the servers that failed
    retry_backoff_s: float = 1.0
    verify_version: bool = True
    # A server that cannot be reached at all: "fail" treats it like a failed load (roll back, raise);
    # "exclude" leaves it out and reports it (a fleet then keeps it out until it re-syncs).
    unreachable: str = "fail"

    def __post_init__(self) -> None:
        if self.unreachable not in ("fail", "exclude"):
            raise ValueError(f"WeightSyncConfig.unreachable must be 'fail' or 'exclude', got {self.unreachable!r}")
        if self.pause_mode not in ("abort", "retract", "in_place"):
            raise ValueError(f"WeightSyncConfig.pause_mode must be abort, retract or in_place, got {self.pause_mode!r}")


@dataclasses.dataclass
class SyncReport:
    weight_version: str
    updated: list[str]
    excluded: dict[str, str]  # url → why it was left out (unreachable)
    attempts: dict[str, int]
    elapsed_s: float


class WeightSynchronizer:
    """Pushes checkpoints to a fixed set of servers, remembering the last consistent one for rollback."""

    def __init__(
        self,
        clients: Sequence[SGLangClient],
        *,
        config: WeightSyncConfig = WeightSyncConfig(),
        previous_checkpoint: str | None = None,
        previous_version: str | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ):
        if not clients:
            raise ValueError("WeightSynchronizer needs at least one server")
        self.clients = list(clients)
        self.config = config
        self.previous_checkpoint = previous_checkpoint
        self.previous_version = previous_version
        self._sleep = sleep
        self._lock = threading.Lock()

    def push_from_disk(self, model_path: str, weight_version: str) -> SyncReport:
        """Move every server to (model_path, weight_version), or leave them all where they were."""
        if not weight_version:
            raise ValueError("weight_version must be a non-empty string")
        with self._lock:
            start = time.monotonic()
            excluded: dict[str, str] = {}
            paused = self._pause_all(excluded)
            try:
                attempts, failed = self._update_all(paused, model_path, weight_version, excluded)
                if failed:
                    self._roll_back(paused, excluded, model_path, weight_version, failed)
                self.previous_checkpoint, self.previous_version = model_path, weight_version
                return SyncReport(weight_version, [c.url for c in paused if c.url not in excluded], excluded,
                                  attempts, time.monotonic() - start)
            finally:
                self._continue_all(paused, excluded)

    # -- steps ----------------------------------------------------------------------------------

    def _pause_all(self, excluded: dict[str, str]) -> list[SGLangClient]:
        outcomes = _parallel(self.clients, lambda c: c.pause_generation(self.config.pause_mode))
        paused, errors = [], {}
        for c, err in zip(self.clients, outcomes):
            if err is None:
                paused.append(c)
            elif isinstance(err, ServerUnavailable) and self.config.unreachable == "exclude":
                excluded[c.url] = str(err)
            else:
                errors[c.url] = str(err)
        if errors:
            self._continue_all(paused, excluded)
            raise WeightSyncError(
                f"could not pause generation on {sorted(errors)}; no weights were changed: {errors}", failed=errors
            )
        return paused

    def _update_all(
        self, clients: list[SGLangClient], path: str, version: str, excluded: dict[str, str]
    ) -> tuple[dict[str, int], dict[str, str]]:
        attempts = {c.url: 0 for c in clients}
        todo = list(clients)
        failed: dict[str, str] = {}
        for round_ in range(self.config.retries + 1):
            if round_:
                self._sleep(self.config.retry_backoff_s * 2 ** (round_ - 1))
                log.warning("retrying weight update %s on %s", version, [c.url for c in todo])
            for c in todo:
                attempts[c.url] += 1
            errors = _parallel(todo, lambda c: self._load(c, path, version))
            failed = {}
            for c, err in zip(todo, errors):
                if err is not None:
                    failed[c.url] = str(err)
            todo = [c for c in todo if c.url in failed]
            if not todo:
                break
        if self.config.unreachable == "exclude":
            for c in list(todo):
                if not c.health(timeout_s=2.0):
                    excluded[c.url] = failed.pop(c.url)
        return attempts, failed

    def _load(self, client: SGLangClient, path: str, version: str) -> None:
        client.update_weights_from_disk(path, weight_version=version, load_format=self.config.load_format,
                                        flush_cache=self.config.flush_cache, retry=RetryPolicy(max_attempts=1))
        if self.config.verify_version:
            got = client.weight_version(retry=RetryPolicy(max_attempts=2))
            if got != version:
                raise SGLangError(f"{client.url} reports weight_version {got!r} after loading {version!r}")

    def _roll_back(
        self, paused: list[SGLangClient], excluded: dict[str, str], path: str, version: str, failed: dict[str, str]
    ) -> None:
        targets = [c for c in paused if c.url not in excluded]
        what = f"weight update to {version!r} ({path}) failed on {sorted(failed)}: {failed}"
        if self.previous_checkpoint is None or self.previous_version is None:
            # Nothing to go back to: keep the servers that made it, take the others out.
            raise WeightSyncError(
                f"{what}; no previous checkpoint to roll back to, so {sorted(failed)} must be taken out of "
                f"rotation (the others now serve {version!r})",
                failed=failed,
                quarantine=sorted(failed),
            )
        log.error("%s; rolling every server back to %r", what, self.previous_version)
        errors = _parallel(targets, lambda c: self._load(c, self.previous_checkpoint, self.previous_version))
        stuck = {c.url: str(e) for c, e in zip(targets, errors) if e is not None}
        if stuck:
            raise WeightSyncError(
                f"{what}; rollback to {self.previous_version!r} also failed on {sorted(stuck)}: {stuck}. "
                f"Those servers are on an unknown version and must be taken out of rotation",
                failed=failed,
                quarantine=sorted(stuck),
            )
        raise WeightSyncError(
            f"{what}; every server was rolled back to {self.previous_version!r} ({self.previous_checkpoint})",
            failed=failed,
        )

    def _continue_all(self, paused: list[SGLangClient], excluded: dict[str, str]) -> None:
        errors = _parallel(paused, lambda c: c.continue_generation())
        for c, err in zip(paused, errors):
            if err is not None:
                log.error("continue_generation failed on %s: %s", c.url, err)
                excluded.setdefault(c.url, f"continue_generation failed: {err}")


def _parallel(clients: Sequence[SGLangClient], fn: Callable[[SGLangClient], Any]) -> list[BaseException | None]:
    """Run fn on every client concurrently; one exception (or None) per client, in order."""
    if not clients:
        return []
    with ThreadPoolExecutor(max_workers=len(clients)) as pool:
        futures = [pool.submit(fn, c) for c in clients]
        return [f.exception() for f in futures]


# ---------------------------------------------------------------------------------------------
# Optional NCCL path. UNTESTED against SGLang (needs torch + NCCL + GPUs + SGLang servers).
# ---------------------------------------------------------------------------------------------

_TORCH_DTYPE_NAMES = {
    "float32": "float32",
    "float16": "float16",
    "bfloat16": "bfloat16",
    "float8_e4m3fn": "float8_e4m3fn",
    "float8_e5m2": "float8_e5m2",
    "int32": "int32",
    "int64": "int64",
    "uint8": "uint8",
    "int8": "int8",
}


def torch_dtype_name(array: Any) -> str:
    """The dtype string SGLang's /update_weights_from_distributed expects (`getattr(torch, name)`)."""
    name = str(getattr(array, "dtype", np.asarray(array).dtype)).removeprefix("torch.")
    if name not in _TORCH_DTYPE_NAMES:
        raise ValueError(f"dtype {name} cannot be sent to SGLang; expected one of {sorted(_TORCH_DTYPE_NAMES)}")
    return _TORCH_DTYPE_NAMES[name]


def _to_torch(array: Any, device: str) -> Any:
    import torch

    if isinstance(array, torch.Tensor):
        return array.to(device)
    host = np.asarray(array)
    name = torch_dtype_name(host)
    if name in ("bfloat16",):  # numpy has no bf16: move the bits, reinterpret on the torch side
        return torch.from_numpy(host.view(np.uint16).copy()).view(torch.bfloat16).to(device)
    if name.startswith("float8"):
        return torch.from_numpy(host.view(np.uint8).copy()).view(getattr(torch, name)).to(device)
    return torch.from_numpy(np.ascontiguousarray(host)).to(device)


class NcclWeightBroadcaster:
    """Trainer side of SGLang's NCCL weight update. UNTESTED without SGLang and GPUs.

    The trainer process is rank 0 of a dedicated process group; server s occupies ranks
    `rank_offset_s .. rank_offset_s + tp_size_s - 1`. Requires `torch` (optional dependency).
    """

    def __init__(
        self,
        clients: Sequence[SGLangClient],
        *,
        master_address: str,
        master_port: int,
        server_world_sizes: Sequence[int],
        group_name: str = "weight_update_group",
        backend: str = "nccl",
        device: str = "cuda",
        pause_mode: str = "abort",
    ):
        try:
            import torch.distributed  # noqa: F401
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise ImportError("NcclWeightBroadcaster needs torch (pip install torch)") from e
        if len(server_world_sizes) != len(clients):
            raise ValueError(f"{len(server_world_sizes)} world sizes for {len(clients)} servers")
        self.clients = list(clients)
        self.master_address = master_address
        self.master_port = int(master_port)
        self.server_world_sizes = [int(w) for w in server_world_sizes]
        self.world_size = 1 + sum(self.server_world_sizes)
        self.group_name = group_name
        self.backend = backend
        self.device = device
        self.pause_mode = pause_mode
        self._group = None

    def init_group(self, timeout_s: float = 600.0) -> None:
        """Create the group: servers join over HTTP (blocking calls, in threads) while we join as rank 0."""
        offsets = np.cumsum([1] + self.server_world_sizes[:-1]).tolist()
        with ThreadPoolExecutor(max_workers=len(self.clients)) as pool:
            futures = [
                pool.submit(c.init_weights_update_group, master_address=self.master_address,
                            master_port=self.master_port, rank_offset=off, world_size=self.world_size,
                            group_name=self.group_name, backend=self.backend)
                for c, off in zip(self.clients, offsets)
            ]
            self._group = _new_process_group(self.backend, f"tcp://{self.master_address}:{self.master_port}",
                                             self.world_size, 0, self.group_name, timeout_s)
            errors = {c.url: f.exception() for c, f in zip(self.clients, futures) if f.exception()}
        if errors:
            raise WeightSyncError(f"init_weights_update_group failed on {sorted(errors)}: {errors}",
                                  failed={k: str(v) for k, v in errors.items()})

    def push(self, named_arrays: Iterable[tuple[str, Any]], weight_version: str,
             bucket_bytes: int = 1 << 30) -> None:
        """Broadcast the arrays (HF names) in buckets; the last bucket sets the version and flushes."""
        import torch.distributed as dist

        if self._group is None:
            raise RuntimeError("call init_group() before push()")
        items = list(named_arrays)
        buckets, current, size = [], [], 0
        for name, arr in items:
            nbytes = int(np.prod(np.shape(arr))) * np.dtype(np.asarray(arr).dtype).itemsize
            if current and size + nbytes > bucket_bytes:
                buckets.append(current)
                current, size = [], 0
            current.append((name, arr))
            size += nbytes
        if current:
            buckets.append(current)
        _parallel(self.clients, lambda c: c.pause_generation(self.pause_mode))
        try:
            for b, bucket in enumerate(buckets):
                last = b == len(buckets) - 1
                with ThreadPoolExecutor(max_workers=len(self.clients)) as pool:
                    futures = [
                        pool.submit(c.update_weights_from_distributed,
                                    names=[n for n, _ in bucket],
                                    dtypes=[torch_dtype_name(a) for _, a in bucket],
                                    shapes=[list(np.shape(a)) for _, a in bucket],
                                    group_name=self.group_name,
                                    weight_version=weight_version if last else None,
                                    flush_cache=last)
                        for c in self.clients
                    ]
                    for _, arr in bucket:
                        dist.broadcast(_to_torch(arr, self.device), src=0, group=self._group)
                    errors = {c.url: f.exception() for c, f in zip(self.clients, futures) if f.exception()}
                if errors:
                    raise WeightSyncError(
                        f"update_weights_from_distributed failed on {sorted(errors)} (bucket {b}); servers may "
                        f"hold a mix of versions: reload a checkpoint from disk on all of them",
                        failed={k: str(v) for k, v in errors.items()},
                        quarantine=sorted(errors),
                    )
        finally:
            _parallel(self.clients, lambda c: c.continue_generation())


def _new_process_group(backend: str, init_method: str, world_size: int, rank: int, group_name: str,
                       timeout_s: float) -> Any:
    """A process group that is not torch's default one (the trainer is JAX; SGLang joins by name).

    SGLang's servers create theirs with torch's private `_new_process_group_helper` over a store
    prefixed by the group name; we must do the same or the two sides would never meet.
    """
    import datetime
    import inspect

    from torch.distributed import distributed_c10d as c10d

    timeout = datetime.timedelta(seconds=timeout_s)
    store, rank, world_size = next(c10d.rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = c10d.PrefixStore(group_name, store)
    params = inspect.signature(c10d._new_process_group_helper).parameters
    options = {"backend_options": None} if "backend_options" in params else {"pg_options": None}
    group, _ = c10d._new_process_group_helper(world_size, rank, [], c10d.Backend(backend), store,
                                              group_name=group_name, timeout=timeout, **options)
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group
