"""Fused causal backward of the flash-attention family: dq, dk, dv from the saved base-2 log-sum-exp.

Two kernels, no atomics (so the gradients are deterministic, though they need no batch invariance):
  * dq: grid (query head, 128-row query tile, batch), like the forward; per key block (64 or 128 keys) it
    recomputes p = 2^(c q.k - lse2), dp = do.v^T, ds = p (dp - delta), and accumulates dq += ds.k;
  * dk/dv: grid (key/value head, 128-key tile, batch); each compute warpgroup owns 64 keys and walks every
    query head of its GQA group and every 64-row query block from its first visible one, accumulating
    dv += p^T.do and dk += ds^T.q in registers — the sum over a group's heads happens in the kernel, so dk/dv
    come out [B, T, Hkv, D] with no [B, T, H, D] intermediate.
delta = rowsum(do * out) is one XLA reduction. Visibility is the forward's rule (start <= key <= query).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.attention_common import (
    F32, LOG2E, a_operand, a_staging, block_pipeline, fully_visible_blocks, kernel_call, masked_unless, row_vector,
    swizzled, wgmma_fresh)
from pallas_kernels.interpret import launch
from pallas_kernels.kernel_cache import traced_once

BWD_BLOCK = 64  # keys per dq step (by default; `backward(dq_keys=)`), keys per dk/dv warpgroup, queries per dk/dv step
CTA_ROWS = 2 * BWD_BLOCK

__all__ = ["backward"]


def _probabilities(s, visible, lse2, c, lse_axis: int):
    """p = 2^(c s - lse2) where visible, else exactly 0 (lse2 broadcast along the query axis of s); visible None:
    the whole block is visible (no mask computed)."""
    lse = lax.broadcast_in_dim(lse2, s.shape, [lse_axis])
    p = jnp.exp2(s * c - lse)
    return p if visible is None else jnp.where(visible, p, 0.0)


def _iota(shape, axis):
    return plgpu.broadcasted_iota(jnp.int32, shape, axis, layout=plgpu.Layout.WGMMA)


def _tile_pair_scratch(d, dtype, interpret, steps: int = BWD_BLOCK):
    """Per compute warpgroup: two resident 64-row operand tiles (q and do, or k and v) with their load barriers,
    and the interpret-mode staging of the register operand (64 rows x `steps`, the pipeline's block)."""
    tile = plgpu.SMEM((2, BWD_BLOCK, d), dtype, transforms=swizzled(dtype))
    return [tile, tile, plgpu.Barrier(num_barriers=2), plgpu.Barrier(num_barriers=2),
            a_staging((2, BWD_BLOCK, steps), dtype, interpret)]


def _dq(q, k, v, starts, do, lse2, delta, *, scale, stages, keys, interpret):
    b, t, h, d = q.shape
    hkv = k.shape[2]
    group = h // hkv
    dtype = q.dtype
    c = float(scale * LOG2E)
    transforms = swizzled(dtype)
    rows = BWD_BLOCK

    allocations = _tile_pair_scratch(d, dtype, interpret, keys)

    def scoped(q_ref, k_ref, v_ref, start_ref, do_ref, lse_ref, delta_ref, dq_ref, q_smem2, do_smem2, q_bar, do_bar,
               ds_smem2):
        bi, hi, qt = lax.axis_index("batch"), lax.axis_index("heads"), lax.axis_index("q_seq")
        wg = lax.axis_index("wg")
        kvh = lax.div(hi, jnp.int32(group))
        kv_steps = pl.cdiv((qt + 1) * CTA_ROWS, jnp.int32(keys))

        def compute_thread(pipeline):
            row0 = qt * CTA_ROWS + wg * rows
            q_smem, do_smem = q_smem2.at[wg], do_smem2.at[wg]
            plgpu.copy_gmem_to_smem(q_ref.at[bi, pl.ds(row0, rows), hi], q_smem, q_bar.at[wg])
            plgpu.copy_gmem_to_smem(do_ref.at[bi, pl.ds(row0, rows), hi], do_smem, do_bar.at[wg])
            row_start = row_vector(start_ref.at[bi, pl.ds(row0, rows)])
            row_lse = row_vector(lse_ref.at[bi, hi, pl.ds(row0, rows)])
            row_delta = row_vector(delta_ref.at[bi, hi, pl.ds(row0, rows)])
            bounds = fully_visible_blocks(start_ref[bi, row0 + rows - 1], row0, keys)
            plgpu.barrier_wait(q_bar.at[wg])
            plgpu.barrier_wait(do_bar.at[wg])
            dq = plgpu.layout_cast(jnp.full((rows, d), 0.0, F32), plgpu.Layout.WGMMA)
            dq = pipeline((dq, row_start, row_lse, row_delta, bounds))[0]
            q_smem[...] = (dq * scale).astype(dtype)  # q is no longer read: its buffer stages dq
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(q_smem, dq_ref.at[bi, pl.ds(row0, rows), hi])
            plgpu.wait_smem_to_gmem(0)

        def body(idx, k_smem, v_smem, k_consumed, v_consumed, carry):
            (step,) = idx
            dq, row_start, row_lse, row_delta, (lo, hi) = carry
            q_smem, do_smem = q_smem2.at[wg], do_smem2.at[wg]
            row0 = qt * CTA_ROWS + wg * rows
            qk = wgmma_fresh(q_smem, k_smem.transpose((1, 0)), (rows, keys))

            def visible():
                key = _iota((rows, keys), 1) + step * keys
                query = _iota((rows, keys), 0) + row0
                start = lax.broadcast_in_dim(row_start, (rows, keys), [0])
                return (key <= query) & (key >= start)

            probabilities = lambda vis: _probabilities(qk, vis, row_lse, c, 0)
            p = masked_unless((step >= lo) & (step < hi), probabilities, visible)
            dp = wgmma_fresh(do_smem, v_smem.transpose((1, 0)), (rows, keys))
            plgpu.barrier_arrive(v_consumed)
            ds = p * (dp - lax.broadcast_in_dim(row_delta, dp.shape, [0]))
            dq = dq + wgmma_fresh(a_operand(ds.astype(dtype), ds_smem2, wg, interpret), k_smem, (rows, d))
            plgpu.barrier_arrive(k_consumed)
            return dq, row_start, row_lse, row_delta, (lo, hi)

        kv_spec = plgpu.BlockSpec((keys, d), lambda s: (s, 0), transforms=transforms)
        pipeline = block_pipeline(body, kv_steps, [kv_spec, kv_spec], stages=stages, compute_wgs=2,
                                  compute_thread=compute_thread)
        pipeline(k_ref.at[bi, :, kvh, :], v_ref.at[bi, :, kvh, :])

    call = kernel_call(scoped, allocations, jax.ShapeDtypeStruct(q.shape, dtype), (h, t // CTA_ROWS, b), ("heads", "q_seq", "batch"), 2,
                       name="attention_bwd_dq")
    return launch(call, q, k, v, starts, do, lse2, delta, interpret=interpret)


def _dkv(q, k, v, starts, do, lse2, delta, *, scale, stages, interpret):
    b, t, h, d = q.shape
    hkv = k.shape[2]
    group = h // hkv
    dtype = q.dtype
    c = float(scale * LOG2E)
    transforms = swizzled(dtype)
    keys = BWD_BLOCK
    q_blocks = t // BWD_BLOCK

    allocations = _tile_pair_scratch(d, dtype, interpret)

    def scoped(q_ref, k_ref, v_ref, start_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, k_smem2, v_smem2, k_bar,
               v_bar, a_smem2):
        bi, kvh, kt = lax.axis_index("batch"), lax.axis_index("kv_heads"), lax.axis_index("kv_seq")
        wg = lax.axis_index("wg")
        first_q_block = kt * (CTA_ROWS // BWD_BLOCK)  # queries before the tile see none of its keys
        steps_per_head = q_blocks - first_q_block

        def compute_thread(pipeline):
            key0 = kt * CTA_ROWS + wg * keys
            k_smem, v_smem = k_smem2.at[wg], v_smem2.at[wg]
            plgpu.copy_gmem_to_smem(k_ref.at[bi, pl.ds(key0, keys), kvh], k_smem, k_bar.at[wg])
            plgpu.copy_gmem_to_smem(v_ref.at[bi, pl.ds(key0, keys), kvh], v_smem, v_bar.at[wg])
            plgpu.barrier_wait(k_bar.at[wg])
            plgpu.barrier_wait(v_bar.at[wg])
            zeros = plgpu.layout_cast(jnp.full((keys, d), 0.0, F32), plgpu.Layout.WGMMA)
            dk, dv = pipeline((zeros, zeros))
            k_smem[...] = (dk * scale).astype(dtype)  # k and v are no longer read: their buffers stage dk, dv
            v_smem[...] = dv.astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(k_smem, dk_ref.at[bi, pl.ds(key0, keys), kvh])
            plgpu.copy_smem_to_gmem(v_smem, dv_ref.at[bi, pl.ds(key0, keys), kvh])
            plgpu.wait_smem_to_gmem(0)

        def body(idx, q_smem, do_smem, lse_smem, delta_smem, start_smem, *consumed_and_carry):
            (i,) = idx
            *consumed, (dk, dv) = consumed_and_carry
            q_block = first_q_block + lax.rem(i, steps_per_head)
            key0 = kt * CTA_ROWS + wg * keys
            k_smem, v_smem = k_smem2.at[wg], v_smem2.at[wg]
            shape = (keys, BWD_BLOCK)  # rows: this warpgroup's keys; columns: the step's queries
            s_t = wgmma_fresh(k_smem, q_smem.transpose((1, 0)), shape)
            col = lambda ref: plgpu.load(ref, layout=plgpu.Layout.WGMMA.reduce(0), optimized=False)

            def visible():
                key = _iota(shape, 0) + key0
                query = _iota(shape, 1) + q_block * BWD_BLOCK
                start = lax.broadcast_in_dim(col(start_smem), shape, [1])
                return (key <= query) & (key >= start)

            # every key of this warpgroup precedes every query of the block, and no query's segment starts after
            # the first key (starts are non-decreasing: the block's last query has the largest)
            full = (q_block * BWD_BLOCK >= key0 + keys - 1) & (start_smem[BWD_BLOCK - 1] <= key0)
            probabilities = lambda vis: _probabilities(s_t, vis, col(lse_smem), c, 1)
            p_t = masked_unless(full, probabilities, visible)
            dv = dv + wgmma_fresh(a_operand(p_t.astype(dtype), a_smem2, wg, interpret), do_smem, (keys, d))
            dp_t = wgmma_fresh(v_smem, do_smem.transpose((1, 0)), shape)
            ds_t = p_t * (dp_t - lax.broadcast_in_dim(col(delta_smem), shape, [1]))
            dk = dk + wgmma_fresh(a_operand(ds_t.astype(dtype), a_smem2, wg, interpret), q_smem, (keys, d))
            for barrier in consumed:
                plgpu.barrier_arrive(barrier)
            return dk, dv

        def head_and_block(i):
            return kvh * group + lax.div(i, steps_per_head), first_q_block + lax.rem(i, steps_per_head)

        def rows_spec():
            return plgpu.BlockSpec((BWD_BLOCK, None, d), lambda i: (head_and_block(i)[1], head_and_block(i)[0], 0),
                                   transforms=transforms)

        def stat_spec():
            return plgpu.BlockSpec((None, BWD_BLOCK), lambda i: head_and_block(i))

        start_spec = plgpu.BlockSpec((BWD_BLOCK,), lambda i: (head_and_block(i)[1],))
        specs = [rows_spec(), rows_spec(), stat_spec(), stat_spec(), start_spec]
        pipeline = block_pipeline(body, group * steps_per_head, specs, stages=stages, compute_wgs=2,
                                  compute_thread=compute_thread)
        pipeline(q_ref.at[bi], do_ref.at[bi], lse_ref.at[bi], delta_ref.at[bi], start_ref.at[bi])

    kv_type = jax.ShapeDtypeStruct(k.shape, dtype)
    call = kernel_call(scoped, allocations, (kv_type, kv_type), (hkv, t // CTA_ROWS, b), ("kv_heads", "kv_seq", "batch"), 2,
                       name="attention_bwd_dkv")
    return launch(call, q, k, v, starts, do, lse2, delta, interpret=interpret)


@traced_once("scale", "stages", "dq_keys", "interpret")
def backward(q, k, v, starts, out, do, lse2, *, scale: float, stages: int, dq_keys: int = BWD_BLOCK, interpret: bool):
    """Gradients of the forward (same padded shapes: T a multiple of 128): (dq, dk, dv) in q's dtype. dq_keys:
    keys per step of the dq kernel (64 or 128; 128 halves its steps and doubles its wgmmas' width). stages: the
    pipeline depth of both kernels (a third stage of the dk/dv kernel, whose steps load 32 KB, measured slower on an
    H100: 349 against 382 TFLOP/s fwd+bwd at T = 4k, results/attention_h100.json)."""
    if dq_keys not in (BWD_BLOCK, CTA_ROWS):
        raise ValueError(f"attention backward: dq_keys must be {BWD_BLOCK} or {CTA_ROWS}; got {dq_keys}")
    b, t, h, _ = q.shape
    delta = jnp.einsum("bthd,bthd->bht", do.astype(F32), out.astype(F32))
    args = (q, k, v, starts, do, lse2, delta)
    dq = _dq(*args, scale=scale, stages=stages, keys=dq_keys, interpret=interpret)
    dk, dv = _dkv(*args, scale=scale, stages=stages, interpret=interpret)
    return dq, dk, dv
