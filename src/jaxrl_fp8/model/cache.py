"""Fixed-size KV cache for the embedded rollout engine (a pytree; jit-friendly, no shape changes)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxrl_fp8.model.config import ModelConfig

__all__ = ["KVCache", "init_cache"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """k/v per layer [B, S, Hkv, D] (after k-norm and RoPE, as attention consumes them); lengths int32 [B].

    Slot s of row b holds the token at position s of that row's sequence; `lengths[b]` is the slot the
    next token is written to. Writes past S are dropped: the engine must stop a row at S tokens.
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    lengths: jax.Array

    @property
    def max_len(self) -> int:
        return self.k[0].shape[1]

    def write(self, layer: int, k_new: jax.Array, v_new: jax.Array, slots: jax.Array) -> "KVCache":
        """Store k/v [B, T, Hkv, D] of tokens at slots [B, T] of layer `layer`."""
        rows = jnp.arange(k_new.shape[0])[:, None]
        k = list(self.k)
        v = list(self.v)
        k[layer] = k[layer].at[rows, slots].set(k_new.astype(k[layer].dtype), mode="drop")
        v[layer] = v[layer].at[rows, slots].set(v_new.astype(v[layer].dtype), mode="drop")
        return dataclasses.replace(self, k=tuple(k), v=tuple(v))


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=jnp.bfloat16) -> KVCache:
    shape = (batch, max_len, cfg.num_key_value_heads, cfg.head_dim)
    zeros = tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_hidden_layers))
    return KVCache(zeros, tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_hidden_layers)), jnp.zeros((batch,), jnp.int32))
