"""Attention over a paged KV cache (prefill and decode) with the training forward's exact arithmetic.

A cache row is a sequence; its keys live in pages of BLOCK_KV tokens (page p of the row = key block p), found
through the row's page table. The query rows of one (batch row, key/value head) are its new tokens times the
GQA group's query heads, packed into 64-row wgmma tiles (row r = token r // G, head r % G): a decode step's
8 query heads of a token share one tile and one read of each page. Per key block every row runs the
training forward's operations (`attention_common.online_softmax_step` between two fresh wgmmas), over
the same absolute blocks, so a token's output has the forward's bits whatever the batch, the cache length,
the page order in the pool or the number of tokens decoded at once.

Persistent: one program per SM walks its items (item = one 64-row tile of one (batch row, key/value head);
program c takes items c, c + C, c + 2C, ...) as ONE pipeline over all their pages, so the TMA warpgroup already
streams the next item's pages while the compute warpgroup finishes an item (a program per item paid its launch,
its q load and its pipeline's fill and drain every ~8 pages: a decode step over 1k-token caches ran at ~60 % of
the KV-bytes roofline). The step -> page table is made by XLA beside the call (`schedule`); a tile visits the
blocks up to its last row's position (`n_blocks`, from the wrapper), at least one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.attention_common import (
    BLOCK_KV, BLOCK_Q, LOG2E, a_operand, a_staging, block_pipeline, finish_rows, initial_softmax_state,
    kernel_call, online_softmax_step, row_vector, swizzled, visible_keys, wgmma_fresh)
from pallas_kernels import interpret as interpret_mode
from pallas_kernels.interpret import launch
from pallas_kernels.kernel_cache import traced_once

__all__ = ["paged_rows_attention", "schedule"]


def schedule(n_blocks, page_table, hkv: int, programs: int):
    """The persistent walk: (codes int32 [C, S], steps int32 [C]).

    Item i = (batch row b, key/value head h, row tile t) with i = (b * Hkv + h) * RT + t, n_blocks [B, RT] (>= 1)
    pages each; program c runs items c, c + C, ... in that order, its step s reading page `codes[c, s] // Hkv` of
    the pool for head `codes[c, s] % Hkv`; `steps[c]` is its number of steps. S = items per program x the page
    table's width (a static bound)."""
    b, rt = n_blocks.shape
    n_items = b * hkv * rt
    per = -(-n_items // programs)
    ids = jnp.arange(programs, dtype=jnp.int32)[:, None] + programs * jnp.arange(per, dtype=jnp.int32)[None, :]
    clipped = jnp.minimum(ids, n_items - 1)
    rows, heads, tiles = clipped // (hkv * rt), (clipped // rt) % hkv, clipped % rt
    pages = jnp.where(ids < n_items, n_blocks[rows, tiles], 0)  # [C, per]
    ends = jnp.cumsum(pages, axis=1)
    s = jnp.arange(per * page_table.shape[1], dtype=jnp.int32)
    k = jnp.minimum(jax.vmap(lambda e: jnp.searchsorted(e, s, side="right", method="scan_unrolled"))(ends), per - 1)
    block = jnp.clip(s[None, :] - jnp.take_along_axis(ends - pages, k, axis=1), 0, page_table.shape[1] - 1)
    page = page_table[jnp.take_along_axis(rows, k, axis=1), block]
    codes = page * hkv + jnp.take_along_axis(heads, k, axis=1)
    return codes.astype(jnp.int32), ends[:, -1].astype(jnp.int32)


@traced_once("scale", "stages", "interpret")
def paged_rows_attention(q_rows, row_pos, row_start, n_blocks, k_pages, v_pages, page_table, *, scale: float,
                         stages: int, interpret: bool):
    """q_rows [B, Hkv, R, D] (R a multiple of BLOCK_Q), row_pos / row_start int32 [B, R], n_blocks int32
    [B, R / BLOCK_Q], k/v_pages [P, BLOCK_KV, Hkv, D], page_table int32 [B, max_pages] -> out [B, Hkv, R, D]."""
    b, hkv, r, d = q_rows.shape
    rt = r // BLOCK_Q
    dtype = q_rows.dtype
    c = float(scale * LOG2E)
    transforms = swizzled(dtype)
    n_items = b * hkv * rt
    programs = min(interpret_mode.num_sms(interpret), n_items)
    # a tile whose rows see no key (no valid position) still visits block 0, so every item stores its output
    n_blocks = jnp.maximum(jnp.asarray(n_blocks, jnp.int32), 1)
    codes, steps = schedule(n_blocks, page_table, hkv, programs)

    allocations = [
        plgpu.SMEM((BLOCK_Q, d), dtype, transforms=transforms),  # the item's q tile, then its output
        plgpu.Barrier(num_barriers=1),
        a_staging((1, BLOCK_Q, BLOCK_KV), dtype, interpret),
    ]

    def scoped(q_ref, pos_ref, start_ref, nblk_ref, k_ref, v_ref, code_ref, steps_ref, o_ref, qo_smem, q_bar, p_smem2):
        prog, wg = lax.axis_index("sm"), lax.axis_index("wg")
        mine = lax.div(n_items - prog + (programs - 1), jnp.int32(programs))  # items of this program

        def coords(k):
            """(batch row, key/value head, row slice) of this program's k-th item."""
            item = prog + k * programs
            return lax.div(item, jnp.int32(hkv * rt)), lax.rem(lax.div(item, jnp.int32(rt)), jnp.int32(hkv)), \
                pl.ds(lax.rem(item, jnp.int32(rt)) * BLOCK_Q, BLOCK_Q)

        def pages_of(k):
            bi, _, rows = coords(k)
            return nblk_ref[bi, lax.div(rows.start, jnp.int32(BLOCK_Q))]

        def compute_thread(pipeline):
            acc, m_i, l_i = initial_softmax_state(BLOCK_Q, d)
            no_rows = plgpu.layout_cast(jnp.full((BLOCK_Q,), 0, jnp.int32), plgpu.Layout.WGMMA.reduce(1))
            pipeline((acc, m_i, l_i, no_rows, no_rows, jnp.int32(0), jnp.int32(0), pages_of(jnp.int32(0))))
            plgpu.wait_smem_to_gmem(0)

        def body(idx, k_smem, v_smem, k_consumed, v_consumed, carry):
            acc, m_i, l_i, row_pos, row_start, k, block, n_pages = carry
            bi, kvh, rows = coords(k)
            first = block == 0

            @pl.when(first)
            def _():
                plgpu.wait_smem_to_gmem(0)  # the previous item's output has left qo_smem
                plgpu.copy_gmem_to_smem(q_ref.at[bi, kvh, rows], qo_smem, q_bar.at[0])
                plgpu.barrier_wait(q_bar.at[0])

            def fresh():
                return (*initial_softmax_state(BLOCK_Q, d), row_vector(pos_ref.at[bi, rows]),
                        row_vector(start_ref.at[bi, rows]))

            acc, m_i, l_i, row_pos, row_start = lax.cond(first, fresh, lambda: (acc, m_i, l_i, row_pos, row_start))
            qk = wgmma_fresh(qo_smem, k_smem.transpose((1, 0)), (BLOCK_Q, BLOCK_KV))
            plgpu.barrier_arrive(k_consumed)
            visible = visible_keys(BLOCK_Q, block * BLOCK_KV, row_pos, row_start)
            p, m_i, l_i, acc = online_softmax_step(qk, visible, m_i, l_i, acc, c)
            acc = acc + wgmma_fresh(a_operand(p.astype(dtype), p_smem2, wg, interpret), v_smem, (BLOCK_Q, d))
            plgpu.barrier_arrive(v_consumed)
            last = block + 1 == n_pages

            @pl.when(last)
            def _():
                out, _ = finish_rows(acc, m_i, l_i)
                qo_smem[...] = out.astype(dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(qo_smem, o_ref.at[bi, kvh, rows])

            more = last & (k + 1 < mine)
            n_pages = lax.cond(more, lambda: pages_of(k + 1), lambda: n_pages)
            k = jnp.where(last, k + 1, k)
            block = jnp.where(last, 0, block + 1)
            return acc, m_i, l_i, row_pos, row_start, k, block, n_pages

        def page_of_step(s):
            code = code_ref[prog, s]
            return lax.div(code, jnp.int32(hkv)), 0, lax.rem(code, jnp.int32(hkv)), 0

        page_spec = plgpu.BlockSpec((None, BLOCK_KV, None, d), page_of_step, transforms=transforms)
        pipeline = block_pipeline(body, steps_ref[prog], [page_spec, page_spec], stages=stages, compute_wgs=1,
                                  compute_thread=compute_thread)
        pipeline(k_ref, v_ref)

    call = kernel_call(scoped, allocations, jax.ShapeDtypeStruct(q_rows.shape, dtype), (programs,), ("sm",), 1,
                       name="attention_paged")
    return launch(call, q_rows, row_pos, row_start, n_blocks, k_pages, v_pages, codes, steps, interpret=interpret)
