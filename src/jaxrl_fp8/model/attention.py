"""Causal GQA attention over a key axis of any length, with masks for packed sequences and KV caches.

Two implementations of the same math (softmax(q.k^T * scale + mask) . v, float32 softmax):

- "exact" (default): row invariant. A query's output depends only on its own q and on the valid keys, in
  order, never on the number of queries, the batch, the key-axis length or where the sequence starts in a
  packed row. That is what makes a decode step (1 query, keys = the whole cache) give the same bits as the
  full forward (T queries, keys = the T tokens). How:
    * scores q.k: elementwise products and a fixed pairwise tree over head_dim (`numerics.row_sum`);
    * the max over keys is exact in any order;
    * sum_s p_s and sum_s p_s v_s: a sequential scan over the keys in index order. A masked key adds an
      exact 0, so trailing padding, cache slots beyond the current length and the tokens of earlier
      segments in a packed row (leading zeros) change nothing;
    * one division at the end (IEEE, `precision.arith.ieee_div`);
    * every product that feeds an add is rounded first (`numerics.rounded_product`): XLA:CPU contracts
      a*b+c into an FMA when both sit in one fusion, and fusion depends on the graph (measured: the same
      attention differed in the last bit between a 17-key and a 33-key call until the score scaling was
      rounded before the max subtraction).
  The backward pass is the standard attention gradient in XLA (gradients need no row invariance).
- "xla": einsum + softmax (not row invariant; kept as the fast non-bitwise baseline).
- "flash": the Mosaic GPU flash kernels (pallas_kernels/attention.py): row invariant by construction (key
  blocks aligned to absolute positions, one online-softmax rule, no split-KV), so the trainer's forward, a
  prefill and a decode step give a token the same bits, at tensor-core speed and O(T) memory. Training uses
  the fused kernel over segments; a KV cache is read page by page through its page table. BF16, head_dim a
  multiple of 64. Off a GPU it runs in the Mosaic GPU interpreter (tests).
- "auto" (ModelConfig's default): "flash" on a Hopper GPU when the model fits the kernel, else "exact" (with a
  warning on a Hopper GPU, so a slow fallback is never silent). On CPU "auto" is "exact": bits unchanged.
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
from jax import lax

from jaxrl_fp8.model.numerics import exp, rounded_product, row_sum
from jaxrl_fp8.precision.arith import ieee_div

F32 = jnp.float32
KEY_BLOCK = 8  # keys per scan step of the exact path (unrolled inside a step)

__all__ = ["attention", "cache_attention", "causal_segment_mask", "cache_mask", "resolve_impl", "sequence_attention"]


# ------------------------------------------------------------------------------------------- choice


@functools.cache
def _warn_fallback(reason: str) -> None:
    logging.warning("model.attention_impl='auto': the flash attention kernel does not take this model (%s); "
                    "using the 'exact' scan (row invariant, but slow and O(T^2) memory in its backward)", reason)


def resolve_impl(impl: str, head_dim: int, dtype) -> str:
    """The attention that runs for ModelConfig.attention_impl `impl` on this process's default device."""
    if impl not in ("auto", "flash"):
        return impl
    from jaxrl_fp8.ops.backends import default_device_is_hopper
    from pallas_kernels.attention import supports

    reason = supports(head_dim, dtype)
    if impl == "flash":
        if reason:
            raise ValueError(f"model.attention_impl='flash': {reason}; use 'auto' or 'exact' for this model")
        return impl
    if not default_device_is_hopper():
        return "exact"
    if reason:
        _warn_fallback(reason)
        return "exact"
    return "flash"


def _interpret() -> bool:
    """The kernels run compiled where the ops run theirs (`ops.backends.default_device_is_hopper`, which a tool
    lowering for CUDA on a CPU host overrides), else in the Mosaic GPU interpreter."""
    from jaxrl_fp8.ops import backends

    return not backends.default_device_is_hopper()


def sequence_attention(q, k, v, segment_ids, *, scale: float, impl: str):
    """Causal attention of whole (packed) rows: q [B, T, H, D], k/v [B, T, Hkv, D], segment_ids [B, T] or None."""
    if impl == "flash":
        from pallas_kernels.attention import flash_attention

        return flash_attention(q, k, v, segment_ids, scale=scale, interpret=_interpret())
    b, t = q.shape[:2]
    seg = jnp.zeros((b, t), jnp.int32) if segment_ids is None else segment_ids
    return attention(q, k, v, causal_segment_mask(seg), scale=scale, impl=impl)


def cache_attention(q, cache, layer: int, slots, *, scale: float, impl: str):
    """New tokens' attention over a KV cache (dense or paged) that already holds them: q [B, Tq, H, D] at cache
    slots [B, Tq]; a token sees slots 0 .. its own."""
    if impl == "flash":
        from pallas_kernels.attention import BLOCK_KV, paged_attention

        k_pages, v_pages, table = cache.pages(layer, BLOCK_KV)
        k_scales, v_scales = cache.scales(layer)
        return paged_attention(q, k_pages, v_pages, table, slots, scale=scale, k_scales=k_scales, v_scales=v_scales,
                               interpret=_interpret())
    k, v = cache.dense(layer)
    return attention(q, k, v, cache_mask(slots, k.shape[1]), scale=scale, impl=impl)


def causal_segment_mask(segment_ids: jax.Array) -> jax.Array:
    """bool [B, T, T]: key s is visible to query t iff s <= t and both are in the same segment."""
    t = segment_ids.shape[1]
    idx = jnp.arange(t)
    causal = idx[None, :, None] >= idx[None, None, :]
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    return causal & same


def cache_mask(query_slots: jax.Array, cache_len: int) -> jax.Array:
    """bool [B, Tq, S]: cache slot s is visible to the query written at slot query_slots[b, t] iff s <= it."""
    return jnp.arange(cache_len)[None, None, :] <= query_slots[:, :, None]


def attention(q, k, v, mask, *, scale: float, impl: str = "exact"):
    """q [B, Tq, H, D], k/v [B, S, Hkv, D], mask bool [B, Tq, S] -> [B, Tq, H, D] in q's dtype.

    Every query must see at least one key (its own slot), which both mask builders above guarantee.
    """
    b, tq, h, d = q.shape
    hkv = k.shape[2]
    if h % hkv:
        raise ValueError(f"attention: {h} query heads do not divide into {hkv} key/value heads")
    qg = q.reshape(b, tq, hkv, h // hkv, d)
    if impl == "exact":
        out = _exact(qg, k, v, mask, float(scale))
    elif impl == "xla":
        out = _xla(qg, k, v, mask, float(scale))
    else:
        raise ValueError(f"attention impl {impl!r} is unknown; expected 'exact' or 'xla'")
    return out.reshape(b, tq, h, d).astype(q.dtype)


# ----------------------------------------------------------------------------------------------- xla


def _scores_einsum(qg, k, scale):
    return jnp.einsum("btkgd,bskd->btkgs", qg.astype(F32), k.astype(F32)) * F32(scale)


def _xla(qg, k, v, mask, scale):
    s = _scores_einsum(qg, k, scale)
    m = mask[:, :, None, None, :]
    s = jnp.where(m, s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    p = jnp.where(m, p, 0.0)
    return jnp.einsum("btkgs,bskd->btkgd", p, v.astype(F32))


# --------------------------------------------------------------------------------------------- exact


def _pad_keys(x, multiple, axis):
    pad = (-x.shape[axis]) % multiple
    if not pad:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths)


def _exact_forward(qg, k, v, mask, scale):
    """Returns (out f32 [B,Tq,Hkv,G,D], m, l) with m/l the row max and softmax denominator [B,Tq,Hkv,G]."""
    b, tq, hkv, g, d = qg.shape
    qf = qg.astype(F32)
    kp = _pad_keys(k.astype(F32), KEY_BLOCK, 1)
    vp = _pad_keys(v.astype(F32), KEY_BLOCK, 1)
    mp = _pad_keys(mask, KEY_BLOCK, 2)
    nblk = kp.shape[1] // KEY_BLOCK
    k_blocks = kp.reshape(b, nblk, KEY_BLOCK, hkv, d).swapaxes(0, 1)  # [n, B, c, Hkv, D]
    v_blocks = vp.reshape(b, nblk, KEY_BLOCK, hkv, d).swapaxes(0, 1)
    m_blocks = mp.reshape(b, tq, nblk, KEY_BLOCK).transpose(2, 0, 1, 3)  # [n, B, Tq, c]

    def block_scores(kb):  # [B, c, Hkv, D] -> [B, Tq, c, Hkv, G]
        prod = rounded_product(qf[:, :, None, :, :, :], kb[:, None, :, :, None, :])
        return rounded_product(row_sum(prod), F32(scale))

    scores = lax.map(block_scores, k_blocks)  # [n, B, Tq, c, Hkv, G]
    valid = m_blocks[..., None, None]
    scores = jnp.where(valid, scores, -jnp.inf)
    row_max = jnp.max(scores, axis=(0, 3))  # [B, Tq, Hkv, G]; exact in any order
    probs = jnp.where(valid, exp(scores - row_max[None, :, :, None]), F32(0))

    def step(carry, xs):
        l, acc = carry
        pb, vb = xs  # [B, Tq, c, Hkv, G], [B, c, Hkv, D]
        for j in range(KEY_BLOCK):  # keys in index order, one at a time
            pj = pb[:, :, j]
            l = l + pj
            acc = acc + rounded_product(pj[..., None], vb[:, None, j, :, None, :])
        return (l, acc), None

    init = (jnp.zeros((b, tq, hkv, g), F32), jnp.zeros((b, tq, hkv, g, d), F32))
    (l, acc), _ = lax.scan(step, init, (probs, v_blocks))
    out = ieee_div(acc, l[..., None])
    return out, row_max, l


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _exact(qg, k, v, mask, scale):
    return _exact_forward(qg, k, v, mask, scale)[0]


def _exact_fwd(qg, k, v, mask, scale):
    out, row_max, l = _exact_forward(qg, k, v, mask, scale)
    return out, (qg, k, v, mask, out, row_max, l)


def _exact_bwd(scale, res, dout):
    """Standard softmax-attention gradient (probabilities recomputed from the saved max and denominator)."""
    qg, k, v, mask, out, row_max, l = res
    qf, kf, vf = qg.astype(F32), k.astype(F32), v.astype(F32)
    m = mask[:, :, None, None, :]
    s = _scores_einsum(qg, k, scale)
    p = jnp.where(m, jnp.exp(s - row_max[..., None]) / l[..., None], F32(0))
    dout = dout.astype(F32)
    dv = jnp.einsum("btkgs,btkgd->bskd", p, dout)
    dp = jnp.einsum("btkgd,bskd->btkgs", dout, vf)
    delta = jnp.sum(dout * out, axis=-1, keepdims=True)
    ds = p * (dp - delta) * F32(scale)
    dq = jnp.einsum("btkgs,bskd->btkgd", ds, kf)
    dk = jnp.einsum("btkgs,btkgd->bskd", ds, qf)
    return dq.astype(qg.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


_exact.defvjp(_exact_fwd, _exact_bwd)
