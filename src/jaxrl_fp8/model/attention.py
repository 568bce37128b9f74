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
- "xla": einsum + softmax; the fast path for accelerators (not row invariant).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jaxrl_fp8.model.numerics import exp, rounded_product, row_sum
from jaxrl_fp8.precision.arith import ieee_div

F32 = jnp.float32
KEY_BLOCK = 8  # keys per scan step of the exact path (unrolled inside a step)

__all__ = ["attention", "causal_segment_mask", "cache_mask"]


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
