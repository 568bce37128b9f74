"""Batch-invariant causal GQA flash attention for Hopper (Mosaic GPU): training forward and backward, and
attention over a paged KV cache (prefill and decode).

One kernel family, one arithmetic. Every query row runs the same sequence of operations over the same key
blocks whichever kernel computes it, so a token gets the same bits in the trainer's full forward (any batch,
any T), in prefill and in a decode step (any batch, any cache length):

  * key blocks are BLOCK_KV keys aligned to absolute positions (block j holds keys j*BLOCK_KV ...), visited
    in index order; the paged cache's page is exactly one key block;
  * per block: scores = wgmma(q rows, k block^T) (a row's scores depend on that row only), then
    `online_softmax_step` — the single update rule — then acc = wgmma(acc, p as bf16, v block);
  * a key is visible to a query iff  start <= key position <= query position  (start = the first position of
    the query's segment; 0 in a cache row). A block with no visible key for a row is an exact no-op for that
    row (the rule keeps alpha = 1 and adds exact zeros), so it does not matter that a 64-row tile may visit a
    block that some of its rows do not need;
  * no split-KV: one program owns a row from its first to its last key block.
The decision record docs/decisions/0012-flash-attention.md argues each step.

Layouts: q [B, T, H, D], k/v [B, T, Hkv, D] (bf16), head_dim D a multiple of 64 (64 and 128 tested); the
log-sum-exp is kept in base 2 with the softmax scale folded in: lse2 = log2(sum_s 2^(c * q.k_s)),
c = scale * log2(e).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels.attention_bwd import backward
from pallas_kernels.attention_common import BLOCK_KV, BLOCK_Q, F32, fully_visible_blocks
from pallas_kernels.attention_fwd import forward
from pallas_kernels.attention_paged import paged_rows_attention

__all__ = [
    "BLOCK_KV", "BLOCK_Q", "FlashConfig", "flash_attention", "paged_attention", "reference_attention",
    "reference_paged_attention", "segment_starts", "supports",
]


@dataclasses.dataclass(frozen=True)
class FlashConfig:
    """Pipeline depth of each kernel; tiles are fixed (BLOCK_Q x BLOCK_KV), since they define the bits."""

    fwd_stages: int = 2
    bwd_stages: int = 2
    paged_stages: int = 3
    bwd_dq_keys: int = 128  # keys per step of the backward's dq kernel (128, or 64: 1-2 % slower on an H100; the gradients' bits depend on it)
    # warpgroups dequantizing FP8 pages: 1 (both operands), or 2 (keys / values; same bits, not yet timed on a GPU)
    paged_fp8_converters: int = 1


def supports(head_dim: int, dtype) -> str | None:
    """None when the kernels take this shape, else the reason (callers fall back loudly or raise it)."""
    if head_dim % 64 or head_dim > 256:
        return f"head_dim {head_dim} is not a multiple of 64 up to 256"
    if jnp.dtype(dtype) != jnp.bfloat16:
        return f"dtype {jnp.dtype(dtype).name} is not bfloat16"
    return None



# ------------------------------------------------------------------------------------------ training



def segment_starts(segment_ids: jax.Array | None, batch: int, length: int) -> jax.Array:
    """int32 [B, T]: the first position of each token's segment (segments are contiguous runs of one id, as a
    packer lays them out; then `start <= s <= t` is exactly `causal_segment_mask`)."""
    idx = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
    if segment_ids is None:
        return jnp.zeros((batch, length), jnp.int32)
    seg = jnp.asarray(segment_ids, jnp.int32)
    change = jnp.concatenate([jnp.ones((batch, 1), bool), seg[:, 1:] != seg[:, :-1]], axis=1)
    return lax.cummax(jnp.where(change, idx, 0), axis=1)


def _pad_rows(x, length, axis=1):
    pad = length - x.shape[axis]
    if not pad:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths)


def _padded_length(t: int) -> int:
    tile = math.lcm(2 * BLOCK_Q, BLOCK_KV)
    return -(-t // tile) * tile


def _check(q, k, v, where: str):
    if q.ndim != 4 or k.shape != v.shape or k.ndim != 4 or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"{where}: q {q.shape}, k {k.shape}, v {v.shape} are not [B, T, H, D] / [B, S, Hkv, D]")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"{where}: {q.shape[2]} query heads do not divide into {k.shape[2]} key/value heads")
    reason = supports(q.shape[3], q.dtype)
    if reason:
        raise ValueError(f"{where}: {reason}")


def flash_attention(q, k, v, segment_ids=None, *, scale: float, config: FlashConfig = FlashConfig(),
                    interpret: bool = False):
    """Causal GQA attention over packed rows: q [B, T, H, D], k/v [B, T, Hkv, D] bf16, segment_ids int32 [B, T]
    (contiguous runs; None = one sequence per row). Differentiable (fused causal backward)."""
    _check(q, k, v, "flash_attention")
    if k.shape[1] != q.shape[1]:
        raise ValueError(f"flash_attention: k/v hold {k.shape[1]} tokens, q {q.shape[1]} (training attention is square)")
    starts = segment_starts(segment_ids, q.shape[0], q.shape[1])
    return _flash(q, k, v, starts, float(scale), config, interpret)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _flash(q, k, v, starts, scale, config, interpret):
    return _flash_fwd(q, k, v, starts, scale, config, interpret)[0]


def _flash_fwd(q, k, v, starts, scale, config, interpret):
    t = q.shape[1]
    tp = _padded_length(t)
    # padded rows start at themselves: they see only their own (zero) key and never a real row's
    pad_starts = jnp.concatenate(
        [starts, jnp.broadcast_to(jnp.arange(t, tp, dtype=jnp.int32), (q.shape[0], tp - t))], axis=1)
    qp, kp, vp = (_pad_rows(x, tp) for x in (q, k, v))
    out, lse2 = forward(qp, kp, vp, pad_starts, scale=scale, stages=config.fwd_stages, interpret=interpret)
    return out[:, :t], (qp, kp, vp, pad_starts, out, lse2)


def _flash_bwd(scale, config, interpret, res, dout):
    qp, kp, vp, starts, out, lse2 = res
    t = dout.shape[1]
    dop = _pad_rows(dout.astype(qp.dtype), qp.shape[1])
    dq, dk, dv = backward(qp, kp, vp, starts, out, dop, lse2, scale=scale, stages=config.bwd_stages,
                          dq_keys=config.bwd_dq_keys, interpret=interpret)
    return dq[:, :t], dk[:, :t], dv[:, :t], None


_flash.defvjp(_flash_fwd, _flash_bwd)


# ------------------------------------------------------------------------------------------ paged cache


def paged_attention(q, k_pages, v_pages, page_table, positions, *, scale: float, starts=None, k_scales=None,
                    v_scales=None, config: FlashConfig = FlashConfig(), interpret: bool = False):
    """Attention of new tokens over a paged cache that already holds them (prefill: many tokens, decode: one).

    q [B, Tq, H, D] bf16; k/v_pages [P, BLOCK_KV, Hkv, D] (page = one key block); page_table int32
    [B, max_pages] (entry i = the pool page holding the row's keys i*BLOCK_KV ...; entries past the row's
    length are never read); positions int32 [B, Tq]: each query's cache slot (it sees slots start .. position);
    starts int32 [B, Tq] (default 0). Pages hold finite values (a fresh pool is zeros): a masked key's
    probability is exactly 0, and 0 * v is 0 only for finite v. Forward only (rollout needs no gradient).
    k/v_scales float32 [P, Hkv, BLOCK_KV]: the pages are float8_e4m3fn and key j of page p, head h is
    pages[p, j, h] x scales[p, h, j] (`jaxrl_fp8.precision.kv`), dequantized in the kernel to q's dtype."""
    b, tq, h, d = q.shape
    if k_pages.ndim != 4 or k_pages.shape != v_pages.shape or k_pages.shape[1] != BLOCK_KV or k_pages.shape[3] != d:
        raise ValueError(f"paged_attention: k/v pages {k_pages.shape}, {v_pages.shape} are not [P, {BLOCK_KV}, Hkv, {d}]")
    reason = supports(d, q.dtype)
    if reason:
        raise ValueError(f"paged_attention: {reason}")
    hkv = k_pages.shape[2]
    if (k_scales is None) != (v_scales is None):
        raise ValueError("paged_attention: give both k_scales and v_scales (FP8 pages) or neither")
    if k_scales is not None:
        want = (k_pages.shape[0], hkv, BLOCK_KV)
        if k_scales.shape != want or v_scales.shape != want:
            raise ValueError(f"paged_attention: k/v scales {k_scales.shape}, {v_scales.shape} are not [P, Hkv, "
                             f"{BLOCK_KV}] = {list(want)}")
        if not k_pages.dtype == v_pages.dtype == jnp.float8_e4m3fn:
            raise ValueError(f"paged_attention: scaled pages must be float8_e4m3fn, got {k_pages.dtype} / {v_pages.dtype}")
        k_scales, v_scales = (jnp.asarray(x, jnp.float32) for x in (k_scales, v_scales))
    if config.paged_fp8_converters not in (1, 2):
        raise ValueError(f"paged_attention: FlashConfig.paged_fp8_converters={config.paged_fp8_converters} "
                         "is not 1 or 2")
    if h % hkv:
        raise ValueError(f"paged_attention: {h} query heads do not divide into {hkv} key/value heads")
    if positions.shape != (b, tq) or page_table.ndim != 2 or page_table.shape[0] != b:
        raise ValueError(f"paged_attention: positions {positions.shape} / page_table {page_table.shape} do not match q {q.shape}")
    g = h // hkv
    rows = tq * g
    r = -(-rows // BLOCK_Q) * BLOCK_Q
    q_rows = q.reshape(b, tq, hkv, g, d).transpose(0, 2, 1, 3, 4).reshape(b, hkv, rows, d)
    if rows > BLOCK_Q:
        q_rows = _pad_rows(q_rows, r, axis=2)
    else:  # a decode step's G heads fill part of one tile, in whole 8-row groups of its shared-memory tiling (no
        # padding to BLOCK_Q in HBM: 5-20 % faster at 256 rows on an H100, same bits; results/attention_h100.json)
        q_rows = _pad_rows(q_rows, -(-rows // 8) * 8, axis=2)
    positions = jnp.asarray(positions, jnp.int32)
    starts = jnp.zeros_like(positions) if starts is None else jnp.asarray(starts, jnp.int32)
    # row r is token r // g; padding rows repeat the last token (their output is dropped)
    token = jnp.minimum(jnp.arange(r) // g, tq - 1)
    row_pos, row_start = positions[:, token], starts[:, token]
    tile_pos, tile_start = (x.reshape(b, r // BLOCK_Q, BLOCK_Q) for x in (row_pos, row_start))
    n_blocks = (tile_pos.max(axis=2) // BLOCK_KV + 1).astype(jnp.int32)
    full_blocks = jnp.stack(fully_visible_blocks(tile_start.max(axis=2), tile_pos.min(axis=2)), axis=-1)
    out = paged_rows_attention(q_rows, row_pos, row_start, n_blocks, full_blocks, k_pages, v_pages,
                               jnp.asarray(page_table, jnp.int32), k_scales, v_scales, scale=float(scale),
                               stages=config.paged_stages, interpret=interpret,
                               converters=config.paged_fp8_converters)
    return out[:, :, :rows].reshape(b, hkv, tq, g, d).transpose(0, 2, 1, 3, 4).reshape(b, tq, h, d)


# ------------------------------------------------------------------------------------------- reference



def reference_attention(q, k, v, starts, positions=None, *, scale: float) -> np.ndarray:
    """float64 softmax attention (numpy) with the kernels' visibility rule: q [B, Tq, H, D], k/v [B, S, Hkv, D],
    starts / positions int [B, Tq] (positions default 0..Tq-1); key s visible iff start <= s <= position."""
    q, k, v = (np.asarray(jnp.asarray(x, F32), np.float64) for x in (q, k, v))
    b, tq, h, d = q.shape
    s_len, hkv = k.shape[1], k.shape[2]
    starts = np.asarray(starts)
    positions = np.broadcast_to(np.arange(tq), (b, tq)) if positions is None else np.asarray(positions)
    qg = q.reshape(b, tq, hkv, h // hkv, d)
    scores = np.einsum("btkgd,bskd->btkgs", qg, k) * scale
    key = np.arange(s_len)[None, None, :]
    vis = ((key <= positions[:, :, None]) & (key >= starts[:, :, None]))[:, :, None, None, :]
    scores = np.where(vis, scores, -np.inf)
    p = np.exp(scores - scores.max(axis=-1, keepdims=True))
    p = np.where(vis, p, 0.0)
    p /= p.sum(axis=-1, keepdims=True)
    return np.einsum("btkgs,bskd->btkgd", p, v).reshape(b, tq, h, d)


def reference_paged_attention(q, k_pages, v_pages, page_table, positions, *, scale: float, starts=None) -> np.ndarray:
    """float64 reference of `paged_attention`: the row's pages gathered into a dense key axis."""
    k = np.asarray(jnp.asarray(k_pages, F32))[np.asarray(page_table)]  # [B, pages, BLOCK_KV, Hkv, D]
    v = np.asarray(jnp.asarray(v_pages, F32))[np.asarray(page_table)]
    b, n, blk, hkv, d = k.shape
    positions = np.asarray(positions)
    starts = np.zeros_like(positions) if starts is None else np.asarray(starts)
    return reference_attention(q, k.reshape(b, n * blk, hkv, d), v.reshape(b, n * blk, hkv, d), starts, positions,
                               scale=scale)
