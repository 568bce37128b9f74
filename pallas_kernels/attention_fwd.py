"""Training / prefill forward of the flash-attention family: out and the base-2 log-sum-exp of every row.

Grid (query head, 128-row query tile, batch); two compute warpgroups own 64 rows each and walk the key blocks
0 .. ceil(tile end / BLOCK_KV) in order through a warp-specialized TMA pipeline (a third warpgroup loads K and V).
The causal bound is the tile's, not the row's: blocks past a row's own position are exact no-ops for it.
The two warpgroups take turns (`take_turn`: one's softmax while the other's wgmmas run), and a key block visible to
every row of a warpgroup's tile skips the mask (`masked_unless`); neither changes a bit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.attention_common import (
    BLOCK_KV, BLOCK_Q, F32, LOG2E, a_operand, a_staging, block_pipeline, finish_rows, fully_visible_blocks,
    initial_softmax_state, kernel_call, masked_unless, online_softmax_step, row_vector, swizzled, take_turn,
    turn_barrier, visible_keys, wgmma_fresh)
from pallas_kernels.interpret import launch
from pallas_kernels.kernel_cache import traced_once

@traced_once("scale", "stages", "interpret", "mask_all_blocks")
def forward(q, k, v, starts, *, scale: float, stages: int, interpret: bool, mask_all_blocks: bool = False):
    """q [B, T, H, D], k/v [B, T, Hkv, D], starts int32 [B, T]; T a multiple of 2*BLOCK_Q and BLOCK_KV.
    mask_all_blocks: no unmasked path (the bits it must equal; tests).

    Returns (out [B, T, H, D], lse2 [B, H, T] float32)."""
    b, t, h, d = q.shape
    hkv = k.shape[2]
    group = h // hkv
    dtype = q.dtype
    c = float(scale * LOG2E)
    transforms = swizzled(dtype)
    cta_rows = 2 * BLOCK_Q

    allocations = [
        plgpu.SMEM((2, BLOCK_Q, d), dtype, transforms=transforms),
        plgpu.SMEM((2, BLOCK_Q), F32),
        plgpu.Barrier(num_barriers=2),
        a_staging((2, BLOCK_Q, BLOCK_KV), dtype, interpret),
        turn_barrier(),
    ]

    def scoped(q_ref, k_ref, v_ref, start_ref, o_ref, lse_ref, qo_smem2, lse_smem2, q_barriers, p_smem2, turn):
        bi, hi, qt = lax.axis_index("batch"), lax.axis_index("heads"), lax.axis_index("q_seq")
        wg = lax.axis_index("wg")
        kvh = lax.div(hi, jnp.int32(group))
        kv_steps = pl.cdiv((qt + 1) * cta_rows, jnp.int32(BLOCK_KV))
        turns = (lambda: None) if interpret else (lambda: take_turn(turn))

        def compute_thread(pipeline):
            row0 = qt * cta_rows + wg * BLOCK_Q
            qo_smem = qo_smem2.at[wg]
            plgpu.copy_gmem_to_smem(q_ref.at[bi, pl.ds(row0, BLOCK_Q), hi], qo_smem, q_barriers.at[wg])
            row_start = row_vector(start_ref.at[bi, pl.ds(row0, BLOCK_Q)])
            row_pos = plgpu.broadcasted_iota(jnp.int32, (BLOCK_Q,), 0, layout=plgpu.Layout.WGMMA.reduce(1)) + row0
            # starts are non-decreasing along a row (`segment_starts`; padding rows start at themselves)
            bounds = fully_visible_blocks(start_ref[bi, row0 + BLOCK_Q - 1], row0)
            if mask_all_blocks:
                bounds = (jnp.int32(0), jnp.int32(0))
            plgpu.barrier_wait(q_barriers.at[wg])
            acc, m_i, l_i = initial_softmax_state(BLOCK_Q, d)
            pl.when(wg == 1)(turns)
            acc, m_i, l_i = pipeline((acc, m_i, l_i, row_pos, row_start, bounds))[:3]
            pl.when(wg == 0)(turns)
            out, lse2 = finish_rows(acc, m_i, l_i)
            qo_smem[...] = out.astype(dtype)
            lse_smem2.at[wg][...] = lse2
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(qo_smem, o_ref.at[bi, pl.ds(row0, BLOCK_Q), hi])
            plgpu.copy_smem_to_gmem(lse_smem2.at[wg], lse_ref.at[bi, hi, pl.ds(row0, BLOCK_Q)])
            plgpu.wait_smem_to_gmem(0)

        def body(idx, k_smem, v_smem, k_consumed, v_consumed, carry):
            (step,) = idx
            acc, m_i, l_i, row_pos, row_start, (lo, hi) = carry
            qo_smem = qo_smem2.at[wg]

            qk = wgmma_fresh(qo_smem, k_smem.transpose((1, 0)), (BLOCK_Q, BLOCK_KV), issued=turns)
            plgpu.barrier_arrive(k_consumed)

            def update(visible):
                return online_softmax_step(qk, visible, m_i, l_i, acc, c)

            masked = lambda: visible_keys(BLOCK_Q, step * BLOCK_KV, row_pos, row_start)
            p, m_i, l_i, acc = masked_unless((step >= lo) & (step < hi), update, masked)
            p16 = p.astype(dtype)
            turns()  # softmax done: the other warpgroup may issue its wgmmas
            pv = wgmma_fresh(a_operand(p16, p_smem2, wg, interpret), v_smem, (BLOCK_Q, d))
            acc = acc + pv
            plgpu.barrier_arrive(v_consumed)
            return acc, m_i, l_i, row_pos, row_start, (lo, hi)

        kv_spec = plgpu.BlockSpec((BLOCK_KV, d), lambda s: (s, 0), transforms=transforms)
        pipeline = block_pipeline(body, kv_steps, [kv_spec, kv_spec], stages=stages, compute_wgs=2,
                                  compute_thread=compute_thread)
        pipeline(k_ref.at[bi, :, kvh, :], v_ref.at[bi, :, kvh, :])

    out_type = (jax.ShapeDtypeStruct(q.shape, dtype), jax.ShapeDtypeStruct((b, h, t), F32))
    call = kernel_call(scoped, allocations, out_type, (h, t // cta_rows, b), ("heads", "q_seq", "batch"), 2,
                       name="attention_fwd")
    return launch(call, q, k, v, starts, interpret=interpret)
