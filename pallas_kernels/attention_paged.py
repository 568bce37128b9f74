"""Attention over a paged KV cache (prefill and decode) with the training forward's exact arithmetic.

A cache row is a sequence; its keys live in pages of BLOCK_KV tokens (page p of the row = key block p), found
through the row's page table. The query rows of one (batch row, key/value head) are its new tokens times the
GQA group's query heads, packed into 64-row wgmma tiles (row r = token r // G, head r % G): a decode step's
8 query heads of a token share one tile and one read of each page. Per key block every row runs the
training forward's operations (`attention_common.online_softmax_step` between two fresh wgmmas), over
the same absolute blocks, so a token's output has the forward's bits whatever the batch, the cache length,
the page order in the pool or the number of tokens decoded at once.

FP8 pages (the `kv_cache="fp8"` contract, `jaxrl_fp8.precision.kv`): e4m3 values with one power-of-two scale
per (token, key/value head). The memory warpgroup reads half the bytes; a converter warpgroup (or two: one for the
keys, one for the values, `FlashConfig.paged_fp8_converters`) dequantizes each block into a BF16 shared-memory tile
(value x scale: exact, the scales keep every product a normal BF16 number) one block ahead of the compute
warpgroup's wgmmas, so the products see the very BF16 keys and values the trainer's forward sees. Separate
warpgroups, because conversion inside the compute warpgroup sits serially with its wgmmas and softmax (slower at
5 of 6 measured points, decision record 0014).

Grid (key/value head, 64-row query tile, batch); one compute warpgroup (plus the converters over FP8 pages) and one
TMA warpgroup that reads the pages in table order. A tile visits the blocks up to its last row's position (`n_blocks`,
from the wrapper); the blocks visible to every row of the tile (`full_blocks`: all of a decode step's blocks but its
last) skip the mask's integer work, as the training forward's do (`masked_unless`, the same bits).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.attention_common import (
    BLOCK_KV, BLOCK_Q, LOG2E, MEMORY_REGISTERS, a_operand, a_staging, block_pipeline, finish_rows,
    initial_softmax_state, kernel_call, masked_unless, online_softmax_step, row_vector, swizzled, visible_keys,
    wgmma_fresh)
from pallas_kernels.interpret import launch
from pallas_kernels.kernel_cache import traced_once

__all__ = ["paged_rows_attention"]

# Two converter warpgroups (FP8 pages, `converters=2`): the pipeline would split the registers evenly over the
# three non-memory warpgroups (152 each: the compute warpgroup spilled, decision record 0014); instead the compute
# warpgroup keeps what it has beside one converter (232) and the converters share the rest (120 each). A thread slot
# of each warpgroup together holds 512 (the register file's 64K over 128-thread warpgroups); counts are multiples of 8.
_REGISTER_SLOTS = 512
COMPUTE_REGISTERS = (_REGISTER_SLOTS - MEMORY_REGISTERS) // 2 // 8 * 8
CONVERTER_REGISTERS = (_REGISTER_SLOTS - MEMORY_REGISTERS - COMPUTE_REGISTERS) // 2 // 8 * 8


def _dequantize_block(values_smem, scales_smem, out_smem, dtype):
    """out = values x scale of their key (rows of BLOCK_KV keys), in 64-key halves to bound the registers; then
    a proxy fence, so the wgmmas (async proxy) see the stores."""
    half = BLOCK_KV // 2
    for h in range(BLOCK_KV // half):
        keys = pl.ds(h * half, half)
        # e4m3 -> f16 is the one hardware conversion from FP8 (exact: e4m3 fits f16), then float32 for the scale
        x = plgpu.load(values_smem.at[keys], layout=plgpu.Layout.WGMMA).astype(jnp.float16).astype(jnp.float32)
        s = plgpu.load(scales_smem.at[keys], layout=plgpu.Layout.WGMMA.reduce(1), optimized=False)
        out_smem[keys] = (x * lax.broadcast_in_dim(s, x.shape, [0])).astype(dtype)
    plgpu.commit_smem()


@traced_once("scale", "stages", "interpret", "converters")
def paged_rows_attention(q_rows, row_pos, row_start, n_blocks, full_blocks, k_pages, v_pages, page_table, k_scales=None,
                         v_scales=None, *, scale: float, stages: int, interpret: bool, converters: int = 1):
    """q_rows [B, Hkv, R, D], row_pos / row_start int32 [B, Rt], n_blocks int32 [B, Rt / BLOCK_Q], full_blocks int32
    [B, Rt / BLOCK_Q, 2] (lo, hi: key blocks lo <= j < hi are visible to every row of the tile), k/v_pages
    [P, BLOCK_KV, Hkv, D], page_table int32 [B, max_pages] -> out [B, Hkv, R, D]; Rt = R rounded up to BLOCK_Q.
    k/v_scales: None (pages in q's dtype) or float32 [P, Hkv, BLOCK_KV] (float8_e4m3fn pages, power-of-two
    scales). FP8 pages: `converters` warpgroups (1: one for both operands, keys first; 2: one for the keys, one
    for the values, at once) dequantize block j + 1 into the other of two BF16 tiles while the compute warpgroup
    runs block j (handshake: a `ready` barrier per tile and operand, so the q.k product starts as soon as the keys
    are ready; a `free` barrier per tile), at most 2 FP8 stages (shared memory). Same bits either way.

    R is a multiple of BLOCK_Q, or smaller: then the one tile loads and stores only its R rows (a decode step's G
    query heads), and its other rows, left as they were in shared memory, are computed and dropped (rows of a
    wgmma tile never mix), so the wrapper pads no query and slices no output."""
    b, hkv, r, d = q_rows.shape
    if (r > BLOCK_Q and r % BLOCK_Q) or r % 8:
        raise ValueError(f"paged_rows_attention: {r} query rows are neither a multiple of {BLOCK_Q} nor one partial tile "
                         "of whole 8-row groups")
    tile_rows = min(r, BLOCK_Q)
    tiles = -(-r // BLOCK_Q)
    dtype = q_rows.dtype
    c = float(scale * LOG2E)
    transforms = swizzled(dtype)
    fp8 = k_scales is not None  # (`attention.paged_attention` checks the pages' dtype and both scales' shapes)

    if fp8:  # two BF16 tiles of dequantized (k, v) leave shared memory for 2 FP8 stages
        stages = min(stages, 2)
    compute_wgs = 1 + converters if fp8 else 1
    allocations = [
        plgpu.SMEM((1, BLOCK_Q, d), dtype, transforms=transforms),
        plgpu.Barrier(num_barriers=1),
        a_staging((1, BLOCK_Q, BLOCK_KV), dtype, interpret),
        plgpu.SMEM((2, 2, BLOCK_KV, d), dtype, transforms=transforms) if fp8 else None,
        plgpu.Barrier(num_barriers=4) if fp8 else None,  # ready 2t + i: tile t holds the block's keys (i = 0) / values
        plgpu.Barrier(num_barriers=2) if fp8 else None,  # free: the compute warpgroup is done with tile t
    ]

    def scoped(*refs):
        if fp8:
            (q_ref, pos_ref, start_ref, nblk_ref, full_ref, k_ref, v_ref, pt_ref, ks_ref, vs_ref, o_ref,
             qo_smem2, q_bar, p_smem2, kv16, ready, free) = refs
        else:
            q_ref, pos_ref, start_ref, nblk_ref, full_ref, k_ref, v_ref, pt_ref, o_ref, qo_smem2, q_bar, p_smem2, *_ = refs
        bi, kvh, rt = lax.axis_index("batch"), lax.axis_index("kv_heads"), lax.axis_index("rows")
        wg = lax.axis_index("wg")
        rows = pl.ds(rt * BLOCK_Q, BLOCK_Q)
        q_rows_here = pl.ds(rt * BLOCK_Q, tile_rows)
        steps = nblk_ref[bi, rt]

        def compute_thread(pipeline):
            qo_smem = qo_smem2.at[0]
            qo_held = qo_smem if tile_rows == BLOCK_Q else qo_smem.at[pl.ds(0, tile_rows)]
            computes = wg == 0  # over FP8 pages, warpgroup 1 (keys, and values with one converter) and 2 (values)
            if fp8 and converters == 2:  # the pipeline split the registers evenly: rebalance (COMPUTE_REGISTERS)
                @pl.when(computes)
                def _():
                    plgpu.set_max_registers(COMPUTE_REGISTERS, action="increase")

                @pl.when(~computes)
                def _():
                    plgpu.set_max_registers(CONVERTER_REGISTERS, action="decrease")

            @pl.when(computes)
            def _():
                plgpu.copy_gmem_to_smem(q_ref.at[bi, kvh, q_rows_here], qo_held, q_bar.at[0])
                plgpu.barrier_wait(q_bar.at[0])

            row_pos = row_vector(pos_ref.at[bi, rows])
            row_start = row_vector(start_ref.at[bi, rows])
            bounds = (full_ref[bi, rt, 0], full_ref[bi, rt, 1])
            acc, m_i, l_i = initial_softmax_state(BLOCK_Q, d)
            acc, m_i, l_i = pipeline((acc, m_i, l_i, row_pos, row_start, bounds))[:3]
            if fp8:  # the converters observe the compute warpgroup's last releases (at most two)
                for back in (2, 1):
                    @pl.when((wg >= 1) & (steps >= back))
                    def _():
                        plgpu.barrier_wait(free.at[lax.rem(steps - back, 2)])

            @pl.when(computes)
            def _():
                out, _ = finish_rows(acc, m_i, l_i)
                qo_smem[...] = out.astype(dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(qo_held, o_ref.at[bi, kvh, q_rows_here])
                plgpu.wait_smem_to_gmem(0)

        def attend(step, k_smem, v_smem, carry, k_consumed=None, v_consumed=None, before_pv=lambda: None):
            acc, m_i, l_i, row_pos, row_start, (lo, hi) = carry
            qk = wgmma_fresh(qo_smem2.at[0], k_smem.transpose((1, 0)), (BLOCK_Q, BLOCK_KV))
            if k_consumed is not None:
                plgpu.barrier_arrive(k_consumed)

            def update(visible):
                return online_softmax_step(qk, visible, m_i, l_i, acc, c)

            masked = lambda: visible_keys(BLOCK_Q, step * BLOCK_KV, row_pos, row_start)
            p, m_i, l_i, acc = masked_unless((step >= lo) & (step < hi), update, masked)
            before_pv()
            acc = acc + wgmma_fresh(a_operand(p.astype(dtype), p_smem2, 0, interpret), v_smem, (BLOCK_Q, d))
            if v_consumed is not None:
                plgpu.barrier_arrive(v_consumed)
            return acc, m_i, l_i, row_pos, row_start, (lo, hi)

        def converter_body(idx, k_smem, v_smem, ks_smem, vs_smem, *rest):
            (step,) = idx
            *consumed, carry = rest
            tile = lax.rem(step, 2)

            for converter in range(1, converters + 1):
                @pl.when(wg == converter)
                def _():
                    @pl.when(step >= 2)
                    def _():
                        plgpu.barrier_wait(free.at[tile])  # the compute warpgroup is done with block step - 2

                    parts = (0, 1) if converters == 1 else (converter - 1,)  # (keys, values) or its one operand
                    operands = ((k_smem, ks_smem), (v_smem, vs_smem))
                    for part in parts:
                        _dequantize_block(*operands[part], kv16.at[tile, part], dtype)
                        plgpu.barrier_arrive(ready.at[2 * tile + part])
                    for part in parts:  # its own arrivals complete them: every phase observed by it
                        plgpu.barrier_wait(ready.at[2 * tile + part])

            # the compute warpgroup never reads the FP8 slots: it arrives at once, the converters once they converted
            for barrier in consumed:
                plgpu.barrier_arrive(barrier)

            def compute(carry):
                plgpu.barrier_wait(ready.at[2 * tile])
                carry = attend(step, kv16.at[tile, 0], kv16.at[tile, 1], carry,
                               before_pv=lambda: plgpu.barrier_wait(ready.at[2 * tile + 1]))
                plgpu.barrier_arrive(free.at[tile])
                plgpu.barrier_wait(free.at[tile])  # (completed by that arrival)
                return carry

            return lax.cond(wg == 0, compute, lambda carry: carry, carry)

        def body(idx, k_smem, v_smem, k_consumed, v_consumed, carry):
            (step,) = idx
            return attend(step, k_smem, v_smem, carry, k_consumed, v_consumed)

        page_dtype = k_ref.dtype
        page_spec = plgpu.BlockSpec((None, BLOCK_KV, d), lambda s: (pt_ref[bi, s], 0, 0),
                                    transforms=swizzled(page_dtype, d))
        specs, operands = [page_spec, page_spec], [k_ref.at[:, :, kvh, :], v_ref.at[:, :, kvh, :]]
        if fp8:
            scale_spec = plgpu.BlockSpec((None, BLOCK_KV), lambda s: (pt_ref[bi, s], 0))
            specs += [scale_spec, scale_spec]
            operands += [ks_ref.at[:, kvh, :], vs_ref.at[:, kvh, :]]
        pipeline = block_pipeline(converter_body if fp8 else body, steps, specs, stages=stages,
                                  compute_wgs=compute_wgs, compute_thread=compute_thread)
        pipeline(*operands)

    call = kernel_call(scoped, allocations, jax.ShapeDtypeStruct(q_rows.shape, dtype), (hkv, tiles, b),
                       ("kv_heads", "rows", "batch"), compute_wgs,
                       name="attention_paged_fp8" if fp8 else "attention_paged")
    scales = (k_scales, v_scales) if fp8 else ()
    return launch(call, q_rows, row_pos, row_start, n_blocks, full_blocks, k_pages, v_pages, page_table, *scales,
                  interpret=interpret)
