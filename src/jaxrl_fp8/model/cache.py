"""KV caches for decoding (pytrees; jit-friendly, no shape changes) and the host-side page allocator.

Two layouts hold the same thing — the k/v of every layer after k-norm and RoPE, as attention consumes them:

- `KVCache` (dense): [B, S, Hkv, D] per layer. Rows cost `S` slots whatever they hold; it stays for the
  collocated (sharded) engine, whose rows are split over devices, and for `Policy.prefill` / `decode_step`.
- `PagedKVCache`: one pool of fixed-size pages [P, page, Hkv, D] per layer and a page table per row. Memory
  grows with the tokens the rows hold (rounded up to a page), not with `batch x max_seq_len`; rows may share
  pages (a prompt prefilled once for a GRPO group). The page is the attention kernel's key block (128 keys),
  so the paged decode kernel reads whole pages through the table (pallas_kernels/attention.py).

Both give attention two views: `dense(layer)` (k/v [B, S, Hkv, D]; the "exact" / "xla" paths mask what a
row has not written) and `pages(layer)` (pool, table; the flash kernel). Slot s of row b holds the token at
position s of that row's sequence; `lengths[b]` is the slot the next token is written to.

Unwritten slots must hold finite values (a fresh pool is zeros; pages only ever receive finite k/v): a masked
key contributes an exact 0 to the softmax sums only if 0 * v is 0.

Under a recipe with `kv_cache="fp8"` the model writes `precision.kv.QuantizedKV` (e4m3 values, a power-of-two
scale per token and head). A paged pool made for it (`init_paged_cache(kv_cache="fp8")`) stores them as they
are, half the bytes, with the scales beside the pages ([P, Hkv, page]: one key block's scales of one head are
contiguous, one TMA copy for the kernel); its `dense` view dequantizes (exact). A BF16 pool or the dense cache
stores the dequantized values: the same numbers, without the saving.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_fp8.model.config import ModelConfig
from jaxrl_fp8.precision.kv import QuantizedKV, check_kv_cache

__all__ = ["KVCache", "PAGE_SIZE", "PagePool", "PagedKVCache", "init_cache", "init_paged_cache", "pages_for"]

PAGE_SIZE = 128  # the flash kernels' key block (pallas_kernels.attention.BLOCK_KV); other attention takes any size


def pages_for(tokens: int, page_size: int) -> int:
    return -(-int(tokens) // int(page_size))


def _stored(x, dtype) -> jax.Array:
    """New k or v as a cache of `dtype` stores it: FP8 pairs dequantized (exact), plain arrays cast."""
    return x.dequantize(dtype) if isinstance(x, QuantizedKV) else x.astype(dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """k/v per layer [B, S, Hkv, D]; lengths int32 [B]. Writes past S are dropped: the engine stops a row at S."""

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    lengths: jax.Array

    @property
    def max_len(self) -> int:
        return self.k[0].shape[1]

    def write(self, layer: int, k_new: jax.Array, v_new: jax.Array, slots: jax.Array) -> "KVCache":
        """Store k/v [B, T, Hkv, D] of tokens at slots [B, T] of layer `layer`."""
        rows = jnp.arange(k_new.shape[0])[:, None]
        k, v = list(self.k), list(self.v)
        k[layer] = k[layer].at[rows, slots].set(_stored(k_new, k[layer].dtype), mode="drop")
        v[layer] = v[layer].at[rows, slots].set(_stored(v_new, v[layer].dtype), mode="drop")
        return dataclasses.replace(self, k=tuple(k), v=tuple(v))

    def with_lengths(self, lengths) -> "KVCache":
        return dataclasses.replace(self, lengths=jnp.asarray(lengths, jnp.int32))

    def dense(self, layer: int) -> tuple[jax.Array, jax.Array]:
        return self.k[layer], self.v[layer]

    def pages(self, layer: int, page_size: int = PAGE_SIZE) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The rows as consecutive pages of `page_size` slots (a reshape, no copy): (k, v [B*S/page, page, Hkv,
        D], page table [B, S/page])."""
        b, s, hkv, d = self.k[layer].shape
        if s % page_size:
            raise ValueError(f"KVCache: {s} slots per row are not whole pages of {page_size} (the paged kernel's key block)")
        n = s // page_size
        table = jnp.arange(b * n, dtype=jnp.int32).reshape(b, n)
        return (self.k[layer].reshape(b * n, page_size, hkv, d), self.v[layer].reshape(b * n, page_size, hkv, d), table)

    def scales(self, layer: int) -> tuple[None, None]:
        """The pages' FP8 scales: none (a dense cache stores plain values)."""
        return None, None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedKVCache:
    """k/v per layer [P, page, Hkv, D] (a pool shared by the rows); page_table int32 [B, max_pages] (entry i: the
    pool page holding the row's slots i*page ... (i+1)*page - 1, or -1: none); lengths int32 [B]. An FP8 pool
    (`kv_cache="fp8"`): k/v are float8_e4m3fn and k/v_scales float32 [P, Hkv, page] per layer; else those are ().

    A write to a slot whose page entry is -1 (or past the table) is dropped, so right-padding tokens of a
    prefill never touch another row's page; a row must own a page for every slot it will hold."""

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    page_table: jax.Array
    lengths: jax.Array
    k_scales: tuple[jax.Array, ...] = ()
    v_scales: tuple[jax.Array, ...] = ()

    @property
    def fp8(self) -> bool:
        return bool(self.k_scales)

    @property
    def page_size(self) -> int:
        return self.k[0].shape[1]

    @property
    def num_pages(self) -> int:
        return self.k[0].shape[0]

    @property
    def max_len(self) -> int:
        return self.page_table.shape[1] * self.page_size

    def _pool_index(self, slots: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(pool page, offset) of slots [B, T]; the page is out of range (a dropped write) where none is owned."""
        ps, width = self.page_size, self.page_table.shape[1]
        which = slots // ps
        entry = jnp.take_along_axis(self.page_table, jnp.clip(which, 0, width - 1), axis=1)
        page = jnp.where((which < width) & (entry >= 0), entry, self.num_pages)
        return page, slots % ps

    def write(self, layer: int, k_new, v_new, slots: jax.Array) -> "PagedKVCache":
        """Store k/v [B, T, Hkv, D] (arrays, or `QuantizedKV` pairs) of tokens at slots [B, T] of layer `layer`."""
        page, offset = self._pool_index(slots)
        k, v = list(self.k), list(self.v)
        if not self.fp8:
            k[layer] = k[layer].at[page, offset].set(_stored(k_new, k[layer].dtype), mode="drop")
            v[layer] = v[layer].at[page, offset].set(_stored(v_new, v[layer].dtype), mode="drop")
            return dataclasses.replace(self, k=tuple(k), v=tuple(v))
        if not (isinstance(k_new, QuantizedKV) and isinstance(v_new, QuantizedKV)):
            raise ValueError("PagedKVCache: this pool holds FP8 keys and values (kv_cache='fp8') but the model wrote "
                             "plain ones: the precision policy's kv_cache must be 'fp8' to decode into it")
        ks, vs = list(self.k_scales), list(self.v_scales)
        k[layer] = k[layer].at[page, offset].set(k_new.values, mode="drop")
        v[layer] = v[layer].at[page, offset].set(v_new.values, mode="drop")
        ks[layer] = ks[layer].at[page, :, offset].set(k_new.scales, mode="drop")
        vs[layer] = vs[layer].at[page, :, offset].set(v_new.scales, mode="drop")
        return dataclasses.replace(self, k=tuple(k), v=tuple(v), k_scales=tuple(ks), v_scales=tuple(vs))

    def map_pages(self, fn) -> "PagedKVCache":
        """fn applied to every per-page array (k, v and their scales, page axis first), e.g. a page copy."""
        return dataclasses.replace(self, k=tuple(map(fn, self.k)), v=tuple(map(fn, self.v)),
                                   k_scales=tuple(map(fn, self.k_scales)), v_scales=tuple(map(fn, self.v_scales)))

    def with_lengths(self, lengths) -> "PagedKVCache":
        return dataclasses.replace(self, lengths=jnp.asarray(lengths, jnp.int32))

    def _table(self) -> jax.Array:
        return jnp.maximum(self.page_table, 0)  # unowned entries read page 0: finite values, masked by position

    def dense(self, layer: int) -> tuple[jax.Array, jax.Array]:
        """k/v [B, max_len, Hkv, D] gathered through the table (slots past a row's pages hold page 0's values)."""
        b, n = self.page_table.shape
        _, ps, hkv, d = self.k[layer].shape
        table = self._table()
        if not self.fp8:
            return tuple(x[table].reshape(b, n * ps, hkv, d) for x in (self.k[layer], self.v[layer]))
        return tuple(QuantizedKV(x[table].reshape(b, n * ps, hkv, d),
                                 s[table].transpose(0, 1, 3, 2).reshape(b, n * ps, hkv)).dequantize(jnp.float32)
                     for x, s in ((self.k[layer], self.k_scales[layer]), (self.v[layer], self.v_scales[layer])))

    def pages(self, layer: int, page_size: int = PAGE_SIZE) -> tuple[jax.Array, jax.Array, jax.Array]:
        if self.page_size != page_size:
            raise ValueError(f"PagedKVCache: pages of {self.page_size} slots; the paged kernel reads pages of {page_size}")
        return self.k[layer], self.v[layer], self._table()

    def scales(self, layer: int) -> tuple[jax.Array | None, jax.Array | None]:
        """The FP8 pages' scales [P, Hkv, page] (None, None for a plain pool)."""
        return (self.k_scales[layer], self.v_scales[layer]) if self.fp8 else (None, None)


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=jnp.bfloat16) -> KVCache:
    shape = (batch, max_len, cfg.num_key_value_heads, cfg.head_dim)
    layers = range(cfg.num_hidden_layers)
    return KVCache(tuple(jnp.zeros(shape, dtype) for _ in layers), tuple(jnp.zeros(shape, dtype) for _ in layers),
                   jnp.zeros((batch,), jnp.int32))


def init_paged_cache(cfg: ModelConfig, page_table, num_pages: int, page_size: int = PAGE_SIZE,
                     dtype=jnp.bfloat16, kv_cache: str = "bf16") -> PagedKVCache:
    """A zeroed pool of `num_pages` pages and the rows' page table [B, max_pages] (-1: no page); kv_cache "fp8":
    e4m3 pages and their scales (zeros: finite), `dtype` is then unused."""
    table = jnp.asarray(page_table, jnp.int32)
    shape = (int(num_pages), int(page_size), cfg.num_key_value_heads, cfg.head_dim)
    layers = range(cfg.num_hidden_layers)
    lengths = jnp.zeros((table.shape[0],), jnp.int32)
    if check_kv_cache(kv_cache) == "bf16":
        return PagedKVCache(tuple(jnp.zeros(shape, dtype) for _ in layers),
                            tuple(jnp.zeros(shape, dtype) for _ in layers), table, lengths)
    fp8 = jnp.float8_e4m3fn
    scales = (int(num_pages), cfg.num_key_value_heads, int(page_size))
    return PagedKVCache(tuple(jnp.zeros(shape, fp8) for _ in layers), tuple(jnp.zeros(shape, fp8) for _ in layers),
                        table, lengths, tuple(jnp.zeros(scales, jnp.float32) for _ in layers),
                        tuple(jnp.zeros(scales, jnp.float32) for _ in layers))


class PagePool:
    """Host-side allocator of a pool's pages: a free list and a reference count per page (shared prompt pages
    are freed when their last row lets go). Raises MemoryError naming the shortfall when the pool is short;
    callers that can wait (the engine) check `can_allocate` first."""

    def __init__(self, num_pages: int):
        if int(num_pages) < 1:
            raise ValueError(f"PagePool: num_pages must be >= 1, got {num_pages}")
        self.num_pages = int(num_pages)
        self._refs = np.zeros((self.num_pages,), np.int32)
        self._free = list(range(self.num_pages - 1, -1, -1))  # pop() hands out low page ids first

    @property
    def free_pages(self) -> int:
        return len(self._free)

    def can_allocate(self, n: int) -> bool:
        return int(n) <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        n = int(n)
        if n > len(self._free):
            raise MemoryError(f"PagePool: {n} pages asked, {len(self._free)} of {self.num_pages} free")
        pages = [self._free.pop() for _ in range(n)]
        self._refs[pages] = 1
        return pages

    def share(self, pages) -> None:
        """One more row holds `pages` (a shared prompt prefix)."""
        pages = list(pages)
        if any(self._refs[p] <= 0 for p in pages):
            raise ValueError(f"PagePool.share: pages {[p for p in pages if self._refs[p] <= 0]} are not allocated")
        self._refs[pages] += 1

    def release(self, pages) -> None:
        for p in pages:
            if self._refs[p] <= 0:
                raise ValueError(f"PagePool.release: page {p} is not allocated")
            self._refs[p] -= 1
            if self._refs[p] == 0:
                self._free.append(p)

    def table(self, rows: list[list[int]], width: int) -> np.ndarray:
        """int32 [len(rows), width]: each row's pages, -1 after them."""
        out = np.full((len(rows), int(width)), -1, np.int32)
        for i, pages in enumerate(rows):
            if len(pages) > width:
                raise ValueError(f"PagePool.table: row {i} holds {len(pages)} pages, the table is {width} wide")
            out[i, : len(pages)] = pages
        return out
