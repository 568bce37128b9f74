"""Attention over a paged KV cache (prefill and decode) with the training forward's exact arithmetic.

A cache row is a sequence; its keys live in pages of BLOCK_KV tokens (page p of the row = key block p), found
through the row's page table. The query rows of one (batch row, key/value head) are its new tokens times the
GQA group's query heads, packed into 64-row wgmma tiles (row r = token r // G, head r % G): a decode step's
8 query heads of a token share one tile and one read of each page. Per key block every row runs the
training forward's operations (`attention_common.online_softmax_step` between two fresh wgmmas), over
the same absolute blocks, so a token's output has the forward's bits whatever the batch, the cache length,
the page order in the pool or the number of tokens decoded at once.

Two schedules of the same per-tile work (a tile visits the blocks up to its last row's position, `n_blocks` from the
wrapper; one compute warpgroup and one TMA warpgroup that reads the pages in table order):
  * `paged_rows_attention`: grid (key/value head, 64-row query tile, batch), a pipeline per tile;
  * `paged_rows_attention_persistent`: one program per SM walks its tiles, its TMA ring of page buffers running on
    from tile to tile (the next tile's q and first pages load while a tile finishes), so a decode step's short
    tiles (8 pages at a 1k cache) do not each pay the pipeline's fill and drain. Same operations per row in the same
    order: the same bits.
"""

from __future__ import annotations

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

import jax.numpy as jnp

from pallas_kernels import interpret as interpret_mode
from pallas_kernels.attention_common import (
    BLOCK_KV, BLOCK_Q, LOG2E, a_operand, a_staging, block_pipeline, finish_rows, initial_softmax_state,
    kernel_call, online_softmax_step, row_vector, swizzled, visible_keys, wgmma_fresh)
from pallas_kernels.interpret import launch
from pallas_kernels.kernel_cache import traced_once

__all__ = ["paged_rows_attention", "paged_rows_attention_persistent"]


@traced_once("scale", "stages", "interpret")
def paged_rows_attention(q_rows, row_pos, row_start, n_blocks, k_pages, v_pages, page_table, *, scale: float,
                         stages: int, interpret: bool):
    """q_rows [B, Hkv, R, D] (R a multiple of BLOCK_Q), row_pos / row_start int32 [B, R], n_blocks int32
    [B, R / BLOCK_Q], k/v_pages [P, BLOCK_KV, Hkv, D], page_table int32 [B, max_pages] -> out [B, Hkv, R, D]."""
    b, hkv, r, d = q_rows.shape
    dtype = q_rows.dtype
    c = float(scale * LOG2E)
    transforms = swizzled(dtype)

    allocations = [
        plgpu.SMEM((1, BLOCK_Q, d), dtype, transforms=transforms),
        plgpu.Barrier(num_barriers=1),
        a_staging((1, BLOCK_Q, BLOCK_KV), dtype, interpret),
    ]

    def scoped(q_ref, pos_ref, start_ref, nblk_ref, k_ref, v_ref, pt_ref, o_ref, qo_smem2, q_bar, p_smem2):
        bi, kvh, rt = lax.axis_index("batch"), lax.axis_index("kv_heads"), lax.axis_index("rows")
        wg = lax.axis_index("wg")
        rows = pl.ds(rt * BLOCK_Q, BLOCK_Q)
        steps = nblk_ref[bi, rt]

        def compute_thread(pipeline):
            qo_smem = qo_smem2.at[0]
            plgpu.copy_gmem_to_smem(q_ref.at[bi, kvh, rows], qo_smem, q_bar.at[0])
            row_pos = row_vector(pos_ref.at[bi, rows])
            row_start = row_vector(start_ref.at[bi, rows])
            plgpu.barrier_wait(q_bar.at[0])
            acc, m_i, l_i = initial_softmax_state(BLOCK_Q, d)
            acc, m_i, l_i = pipeline((acc, m_i, l_i, row_pos, row_start))[:3]
            out, _ = finish_rows(acc, m_i, l_i)
            qo_smem[...] = out.astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(qo_smem, o_ref.at[bi, kvh, rows])
            plgpu.wait_smem_to_gmem(0)

        def body(idx, k_smem, v_smem, k_consumed, v_consumed, carry):
            (step,) = idx
            acc, m_i, l_i, row_pos, row_start = carry
            qk = wgmma_fresh(qo_smem2.at[0], k_smem.transpose((1, 0)), (BLOCK_Q, BLOCK_KV))
            plgpu.barrier_arrive(k_consumed)
            visible = visible_keys(BLOCK_Q, step * BLOCK_KV, row_pos, row_start)
            p, m_i, l_i, acc = online_softmax_step(qk, visible, m_i, l_i, acc, c)
            acc = acc + wgmma_fresh(a_operand(p.astype(dtype), p_smem2, wg, interpret), v_smem, (BLOCK_Q, d))
            plgpu.barrier_arrive(v_consumed)
            return acc, m_i, l_i, row_pos, row_start

        page_spec = plgpu.BlockSpec((None, BLOCK_KV, d), lambda s: (pt_ref[bi, s], 0, 0), transforms=transforms)
        pipeline = block_pipeline(body, steps, [page_spec, page_spec], stages=stages, compute_wgs=1,
                                  compute_thread=compute_thread)
        pipeline(k_ref.at[:, :, kvh, :], v_ref.at[:, :, kvh, :])

    call = kernel_call(scoped, allocations, jax.ShapeDtypeStruct(q_rows.shape, dtype), (hkv, r // BLOCK_Q, b),
                       ("kv_heads", "rows", "batch"), 1, name="attention_paged")
    return launch(call, q_rows, row_pos, row_start, n_blocks, k_pages, v_pages, page_table, interpret=interpret)


@traced_once("scale", "stages", "interpret")
def paged_rows_attention_persistent(q_rows, row_pos, row_start, n_blocks, k_pages, v_pages, page_table, *,
                                    scale: float, stages: int, interpret: bool):
    """`paged_rows_attention` (same arguments, same bits) on a persistent grid: program i takes tiles i, i + #SMs, ...
    (tile = (batch row, key/value head, 64-row query tile), row-major). Warpgroup 1 loads each tile's q rows into
    one of two q buffers, then its pages into a ring of `stages` (k, v) buffers; warpgroup 0 loads the tile's row
    positions / starts from global memory (in flight while it waits for q), consumes the buffers in the same order,
    frees a page buffer after its p.v wgmma and a q buffer once the tile's output (written over its q) is stored.
    Shared memory at d = 128: stages x 64 KB of pages + 2 x 16 KB of q; 3 stages fit (227 KB), with ~0 bytes to
    spare: the row positions stay in global memory."""
    b, hkv, r, d = q_rows.shape
    dtype = q_rows.dtype
    c = float(scale * LOG2E)
    transforms = swizzled(dtype)
    q_tiles = r // BLOCK_Q
    num_tiles = b * hkv * q_tiles

    def coords(t):
        return lax.div(t, hkv * q_tiles), lax.rem(lax.div(t, q_tiles), hkv), lax.rem(t, q_tiles)

    allocations = [
        plgpu.SMEM((2, BLOCK_Q, d), dtype, transforms=transforms),  # q rows, then the tile's output
        plgpu.SMEM((stages, BLOCK_KV, d), dtype, transforms=transforms),
        plgpu.SMEM((stages, BLOCK_KV, d), dtype, transforms=transforms),
        plgpu.Barrier(num_arrivals=1, num_barriers=2),  # q buffer loaded
        plgpu.Barrier(num_arrivals=1, num_barriers=2),  # q buffer free
        plgpu.Barrier(num_arrivals=2, num_barriers=stages),  # page buffer loaded (k, v)
        plgpu.Barrier(num_arrivals=1, num_barriers=stages),  # page buffer free
        a_staging((1, BLOCK_Q, BLOCK_KV), dtype, interpret),
    ]

    def scoped(q_ref, pos_ref, start_ref, nblk_ref, k_ref, v_ref, pt_ref, o_ref, q_smem, k_smem, v_smem, q_full,
               q_empty, full, empty, p_smem2):
        wg = lax.axis_index("wg")

        @pl.when(wg == 1)
        def _memory():
            plgpu.set_max_registers(40, action="decrease")

            @plgpu.nd_loop((num_tiles,), collective_axes="sm", init_carry=(jnp.int32(0), jnp.int32(0)))
            def issued(info, carry):
                it, j = carry  # page ring position, this program's tile count
                bi, kvh, rt = coords(info.index[0])
                qs, rows = lax.rem(j, 2), pl.ds(rt * BLOCK_Q, BLOCK_Q)

                @pl.when(j >= 2)
                def _():
                    plgpu.barrier_wait(q_empty.at[qs])

                plgpu.copy_gmem_to_smem(q_ref.at[bi, kvh, rows], q_smem.at[qs], q_full.at[qs])

                def page(step, it):
                    slot = lax.rem(it, stages)

                    @pl.when(it >= stages)
                    def _():
                        plgpu.barrier_wait(empty.at[slot])

                    pg = pt_ref[bi, step]
                    plgpu.copy_gmem_to_smem(k_ref.at[pg, :, kvh, :], k_smem.at[slot], full.at[slot])
                    plgpu.copy_gmem_to_smem(v_ref.at[pg, :, kvh, :], v_smem.at[slot], full.at[slot])
                    return it + 1

                return lax.fori_loop(0, nblk_ref[bi, rt], page, it), j + 1

            it_end, j_end = issued

            @pl.loop(jnp.maximum(it_end - stages, 0), it_end)  # no arrival left pending at exit
            def _(it):
                plgpu.barrier_wait(empty.at[lax.rem(it, stages)])

            @pl.loop(jnp.maximum(j_end - 2, 0), j_end)
            def _(j):
                plgpu.barrier_wait(q_empty.at[lax.rem(j, 2)])

        @pl.when(wg == 0)
        def _compute():
            plgpu.set_max_registers(232, action="increase")

            @plgpu.nd_loop((num_tiles,), collective_axes="sm", init_carry=(jnp.int32(0), jnp.int32(0)))
            def _tiles(info, carry):
                it, j = carry
                bi, kvh, rt = coords(info.index[0])
                qs = lax.rem(j, 2)
                qo, rows = q_smem.at[qs], pl.ds(rt * BLOCK_Q, BLOCK_Q)
                row_pos = row_vector(pos_ref.at[bi, rows])  # loads in flight while the q buffer fills
                row_start = row_vector(start_ref.at[bi, rows])
                plgpu.barrier_wait(q_full.at[qs])

                def block(step, state):
                    acc, m_i, l_i, it = state
                    slot = lax.rem(it, stages)
                    plgpu.barrier_wait(full.at[slot])
                    qk = wgmma_fresh(qo, k_smem.at[slot].transpose((1, 0)), (BLOCK_Q, BLOCK_KV))
                    visible = visible_keys(BLOCK_Q, step * BLOCK_KV, row_pos, row_start)
                    p, m_i, l_i, acc = online_softmax_step(qk, visible, m_i, l_i, acc, c)
                    acc = acc + wgmma_fresh(a_operand(p.astype(dtype), p_smem2, 0, interpret), v_smem.at[slot],
                                            (BLOCK_Q, d))
                    plgpu.barrier_arrive(empty.at[slot])
                    return acc, m_i, l_i, it + 1

                acc, m_i, l_i = initial_softmax_state(BLOCK_Q, d)
                acc, m_i, l_i, it = lax.fori_loop(0, nblk_ref[bi, rt], block, (acc, m_i, l_i, it))
                out, _ = finish_rows(acc, m_i, l_i)
                qo[...] = out.astype(dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(qo, o_ref.at[bi, kvh, rows])
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the store has read the buffer: free it
                plgpu.barrier_arrive(q_empty.at[qs])
                return it, j + 1

            plgpu.wait_smem_to_gmem(0)

    call = kernel_call(scoped, allocations, jax.ShapeDtypeStruct(q_rows.shape, dtype),
                       (interpret_mode.num_sms(interpret),), ("sm",), 1, name="attention_paged_persistent")
    return launch(call, q_rows, row_pos, row_start, n_blocks, k_pages, v_pages, page_table, interpret=interpret)
