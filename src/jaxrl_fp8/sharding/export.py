"""Weight export from sharded parameters, one tensor (or one expert) at a time.

`converters.export.export_weights` walks the parameters in HF-name order and touches one HF tensor at a time:
`flat[path]` for a plain weight, `flat[path][e]` for expert e of a stack. `gathered_params` hands it lazy
stand-ins instead of arrays, so each access gathers exactly that tensor (or that one expert) from the mesh to
the host — never the whole model, never a whole expert stack — and the converter path is the very same code
the single-device export runs (bitwise equal, tested). The latest full gather is kept in a one-slot cache
(the converter reads a tensor twice: finiteness check, then quantization), so host memory stays within the
converter's bucket plus about two tensors; `peak_host_bytes` measures it.

Multi-host: the gathers are collectives (a jitted slice with a replicated output), so every process must
iterate the export; processes other than the writer simply drop the buckets.
"""

from __future__ import annotations

import functools
import tracemalloc
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

__all__ = ["LazyParam", "gathered_params", "export_weights_sharded", "peak_host_bytes"]


class _Slot:
    key = None
    value = None


@functools.lru_cache(maxsize=None)
def _slicer(sharding):
    return jax.jit(lambda a, i: jax.lax.dynamic_index_in_dim(a, i, axis=0, keepdims=False), out_shardings=sharding)


@functools.lru_cache(maxsize=None)
def _gatherer(sharding):
    return jax.jit(lambda a: a, out_shardings=sharding)


def _to_host(x: jax.Array) -> np.ndarray:
    return np.asarray(x.addressable_data(0)) if isinstance(x, jax.Array) else np.asarray(x)


class LazyParam:
    """A sharded parameter that is gathered to host only when read: whole (`np.asarray`) or one expert (`[e]`)."""

    def __init__(self, name: str, array: jax.Array, slot: _Slot):
        self.name, self._array, self._slot = name, array, slot
        self.shape, self.dtype, self.ndim = tuple(array.shape), np.dtype(array.dtype), array.ndim
        mesh = getattr(array.sharding, "mesh", None)
        self._replicated = NamedSharding(mesh, P()) if mesh is not None else None

    def _gather(self) -> np.ndarray:
        if self._slot.key is not self:
            self._slot.key, self._slot.value = None, None  # drop the previous tensor before fetching this one
            a = self._array if self._replicated is None else _gatherer(self._replicated)(self._array)
            self._slot.key, self._slot.value = self, _to_host(a)
        return self._slot.value

    def __array__(self, dtype=None, copy=None):
        a = self._gather()
        return a if dtype is None else a.astype(dtype)

    def __getitem__(self, index):
        if isinstance(index, (int, np.integer)) and self._replicated is not None:
            if not 0 <= index < self.shape[0]:
                raise IndexError(f"{self.name}: index {index} out of range for dimension 0 of size {self.shape[0]}")
            return _to_host(_slicer(self._replicated)(self._array, jnp.int32(index)))
        return self._gather()[index]

    def __repr__(self):
        return f"LazyParam({self.name}, shape={self.shape}, dtype={self.dtype})"


def gathered_params(params) -> dict[str, LazyParam]:
    """{trainer path: LazyParam} for an nnx.State / nested mapping of (possibly sharded) arrays."""
    from converters.export import flatten_params

    slot = _Slot()
    return {name: LazyParam(name, jnp.asarray(v) if not isinstance(v, jax.Array) else v, slot)
            for name, v in flatten_params(params).items()}


def export_weights_sharded(params, recipe_or_fmt, policy, *, bucket_bytes: int, cast: Callable | None = None,
                           **kw) -> Iterator[list[tuple[str, np.ndarray]]]:
    """`converters.export.export_weights` over sharded params, gathering tensor by tensor (see module doc).

    cast: optional jitted fn applied to the whole sharded params first (e.g. masters -> compute dtype); it
    keeps the shardings, so no device holds more than its shard plus one gathered tensor.
    """
    from converters.export import export_weights

    if cast is not None:
        params = cast(params)
    return export_weights(gathered_params(params), recipe_or_fmt, policy, bucket_bytes=bucket_bytes, **kw)


def peak_host_bytes(fn: Callable[[], object]) -> tuple[object, int]:
    """(fn(), peak bytes of Python/numpy host allocations while it ran), measured with tracemalloc."""
    was = tracemalloc.is_tracing()
    if not was:
        tracemalloc.start()
    tracemalloc.reset_peak()
    base = tracemalloc.get_traced_memory()[0]
    try:
        out = fn()
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        if not was:
            tracemalloc.stop()
    return out, peak
