"""Fused causal backward: dk, dv and dq from one persistent kernel (FA3's five GEMMs a step, not seven).

The two-kernel backward (`attention_bwd`) recomputes q.k and do.v in its dq kernel. Here the dk/dv kernel's step also
multiplies its ds by its keys, and that partial dq of a 64-query block is added into a float32 accumulator in
global memory by a TMA reduce-add. Many CTAs add into one block, so the sum's bits would depend on which arrives
first; a fixed order makes them a function of the shapes only:

  * the schedule (`schedule`, host side, static per shape): work items (batch row, key/value head, 128-key tile),
    longest first, each to the SM with the least work so far (list scheduling); an item's start time is that
    SM's work before it. One persistent CTA per SM walks its list.
  * the order: the items adding into a query block add in the order of (start, -key tile). A CTA waits on a
    per-block counter (a global semaphore) until its rank, adds, and signals once the add has completed.
    Deadlock-free: every CTA walks its list in that order and waits only on items before it in it, so the first
    unfinished item in the order can always run (all CTAs are resident: one per SM). In time the order is the one
    the schedule predicts, so a CTA rarely waits: an item that starts earlier reaches a block earlier.
  * each compute warpgroup (64 of the tile's keys) adds into its own accumulator (dq = acc0 + acc1 in XLA), so the
    two never wait on each other; the first item of a block stores instead of adding (no zero fill).

Mosaic GPU's interpreter has no semaphores and no TMA reductions: interpret mode runs one CTA (the schedule of one SM
walks the items in rank order) and adds by load, add, store. The math of a step is `attention_bwd`'s dk/dv kernel's
(ds staged in shared memory, read by both its wgmmas: the same values, so dk and dv have that kernel's bits).
"""

from __future__ import annotations

import functools
import heapq

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import interpret as interpret_mode
from pallas_kernels.attention_bwd import BWD_BLOCK, CTA_ROWS, _iota, _probabilities
from pallas_kernels.attention_common import F32, LOG2E, a_staging, kernel_call, masked_unless, swizzled, wgmma_fresh
from pallas_kernels.interpret import launch

__all__ = ["backward_fused", "schedule"]

LOADS_PER_STEP = 5  # q, do, lse, delta, segment starts of a 64-query block


@functools.lru_cache(maxsize=64)
def schedule(batch: int, kv_heads: int, key_tiles: int, q_blocks: int, group: int, num_sms: int):
    """(items [num_sms, max_items], counts [num_sms], rank [batch * kv_heads * key_tiles, q_blocks]) as int32 numpy.

    Item id (b * kv_heads + h) * key_tiles + kt: key tile kt (128 keys) of row b, key/value head h; it walks the
    64-query blocks 2 kt .. q_blocks - 1 of each of the group's query heads (group * (q_blocks - 2 kt) steps).
    items[c, :counts[c]] is SM c's list; rank[item, qb] is the item's place among the items adding into query block qb
    (those with 2 kt <= qb) of its row and head, in (start, -kt) order."""
    work = lambda kt: group * (q_blocks - 2 * kt)  # noqa: E731
    heap = [(0, c) for c in range(num_sms)]
    lists: list[list[int]] = [[] for _ in range(num_sms)]
    start = np.zeros((batch, kv_heads, key_tiles), np.int64)
    for kt in range(key_tiles):  # longest first
        for b in range(batch):
            for h in range(kv_heads):
                load, c = heapq.heappop(heap)
                lists[c].append((b * kv_heads + h) * key_tiles + kt)
                start[b, h, kt] = load
                heapq.heappush(heap, (load + work(kt), c))
    counts = np.array([len(x) for x in lists], np.int32)
    items = np.full((num_sms, max(1, int(counts.max()))), -1, np.int32)
    for c, x in enumerate(lists):
        items[c, : len(x)] = x
    kts = np.arange(key_tiles)
    rank = np.zeros((batch * kv_heads * key_tiles, q_blocks), np.int32)
    for b in range(batch):
        for h in range(kv_heads):
            s = start[b, h]
            # before[kt, j]: item j adds before item kt (earlier start, or the same start and a later tile)
            before = (s[None, :] < s[:, None]) | ((s[None, :] == s[:, None]) & (kts[None, :] > kts[:, None]))
            ahead = np.cumsum(before, axis=1)  # ahead[kt, m]: items j <= m adding before kt
            m = np.minimum(np.arange(q_blocks) // 2, key_tiles - 1)
            base = (b * kv_heads + h) * key_tiles
            rank[base: base + key_tiles] = ahead[:, m]
    return items, counts, rank


def _dq_slot(dq_ref, wg, bi, qb, h, split_cols: bool):
    """Where a warpgroup's dq part goes: its half of the columns of [B, T, H, D] (split_cols), else its own
    accumulator of [2, B, T, H, D]."""
    block = pl.ds(qb * BWD_BLOCK, BWD_BLOCK)
    if split_cols:
        half = dq_ref.shape[-1] // 2
        return dq_ref.at[bi, block, h, pl.ds(pl.multiple_of(wg * half, half), half)]
    return dq_ref.at[wg, bi, block, h]


def _fused(q, k, v, starts, do, lse2, delta, items, counts, rank, *, scale, stages, num_sms, split_cols, interpret):
    b, t, h, d = q.shape
    hkv = k.shape[2]
    group = h // hkv
    key_tiles, q_blocks = t // CTA_ROWS, t // BWD_BLOCK
    dtype = q.dtype
    c = float(scale * LOG2E)
    transforms = swizzled(dtype)
    f32_transforms = swizzled(F32)
    rows = BWD_BLOCK

    tile = plgpu.SMEM((2, rows, d), dtype, transforms=transforms)
    allocations = [
        tile, tile,  # k, v of each compute warpgroup (its 64 keys); after an item they stage dk, dv
        plgpu.SMEM((stages, rows, d), dtype, transforms=transforms),  # q ring
        plgpu.SMEM((stages, rows, d), dtype, transforms=transforms),  # do ring
        plgpu.SMEM((stages, rows), F32), plgpu.SMEM((stages, rows), F32), plgpu.SMEM((stages, rows), jnp.int32),
        # ds^T of each warpgroup (A of dk and dq); split_cols: of both steps in flight (the other warpgroup reads it)
        plgpu.SMEM((2, 2, rows, rows) if split_cols else (2, rows, rows), dtype, transforms=transforms),
        # each warpgroup's dq part on its way to GMEM (split_cols: its half of the columns)
        plgpu.SMEM((2, rows, d // 2 if split_cols else d), F32, transforms=f32_transforms),
        plgpu.Barrier(num_barriers=2), plgpu.Barrier(num_barriers=2), plgpu.Barrier(num_barriers=2),
        plgpu.Barrier(num_arrivals=LOADS_PER_STEP, num_barriers=stages),
        plgpu.Barrier(num_arrivals=2, num_barriers=stages),
        plgpu.Barrier(num_arrivals=2, num_barriers=3),  # split_cols: both ds written (per step parity), item done
    ]
    if interpret:
        allocations.append(a_staging((2, rows, rows), dtype, interpret))

    def decode(item):
        kt = lax.rem(item, jnp.int32(key_tiles))
        bh = lax.div(item, jnp.int32(key_tiles))
        return lax.div(bh, jnp.int32(hkv)), lax.rem(bh, jnp.int32(hkv)), kt

    def step_coords(kt, kvh, i):
        per_head = q_blocks - 2 * kt
        g = lax.div(i, per_head)
        return kvh * group + g, 2 * kt + lax.rem(i, per_head)

    def scoped(q_ref, k_ref, v_ref, start_ref, do_ref, lse_ref, delta_ref, items_ref, counts_ref, rank_ref,
               dk_ref, dv_ref, dq_ref, k_smem2, v_smem2, q_ring, do_ring, lse_ring, delta_ring, start_ring, ds_smem2,
               dq_smem2, k_bar, v_bar, acc_bar, full, empty, pair, *staging):
        sems = None if interpret else pl.get_global(plgpu.SemaphoreType.REGULAR((2 * b * h * q_blocks,)))
        sm = lax.axis_index("sm")
        n_items = counts_ref[sm]
        wg = lax.axis_index("wg")
        slot = lambda it: lax.rem(it, jnp.int32(stages))  # noqa: E731

        @pl.when(wg == 2)
        def _memory():
            plgpu.set_max_registers(40, action="decrease")

            def item_loop(j, it):
                bi, kvh, kt = decode(items_ref[sm, j])

                def step(i, it):
                    s = slot(it)

                    @pl.when(it >= stages)
                    def _():
                        plgpu.barrier_wait(empty.at[s])

                    hi, qb = step_coords(kt, kvh, i)
                    block = pl.ds(qb * rows, rows)
                    plgpu.copy_gmem_to_smem(q_ref.at[bi, block, hi], q_ring.at[s], full.at[s])
                    plgpu.copy_gmem_to_smem(do_ref.at[bi, block, hi], do_ring.at[s], full.at[s])
                    plgpu.copy_gmem_to_smem(lse_ref.at[bi, hi, block], lse_ring.at[s], full.at[s])
                    plgpu.copy_gmem_to_smem(delta_ref.at[bi, hi, block], delta_ring.at[s], full.at[s])
                    plgpu.copy_gmem_to_smem(start_ref.at[bi, block], start_ring.at[s], full.at[s])
                    return it + 1

                return lax.fori_loop(0, group * (q_blocks - 2 * kt), step, it)

            issued = lax.fori_loop(0, n_items, item_loop, jnp.int32(0))

            @pl.loop(jnp.maximum(issued - stages, 0), issued)
            def _(it):
                plgpu.barrier_wait(empty.at[slot(it)])

        def add_part(part, item, bi, hi, qb, prev):
            """Add this warpgroup's dq part of query block qb in its rank order; returns the semaphore to signal
            once the add has completed (signalled before this warpgroup's next wait: no cycle of waits)."""
            dq_smem = dq_smem2.at[wg]
            dst = _dq_slot(dq_ref, wg, bi, qb, hi, split_cols)
            r = rank_ref[item, qb]
            plgpu.wait_smem_to_gmem(0)  # the previous add has completed (and read dq_smem)
            if interpret:  # one CTA walks the items in rank order: load, add, store
                plgpu.copy_gmem_to_smem(dst, dq_smem, acc_bar.at[wg])
                plgpu.barrier_wait(acc_bar.at[wg])
                dq_smem[...] = jnp.where(r == 0, part, dq_smem[...] + part)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(dq_smem, dst)
                return prev
            idx = ((wg * b + bi) * h + hi) * q_blocks + qb

            @pl.when(prev >= 0)
            def _():
                pl.semaphore_signal(sems.at[prev])

            plgpu.semaphore_wait(sems.at[idx], r, decrement=False, memory_scope="gpu")
            dq_smem[...] = part
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(dq_smem, dst, predicate=r == 0)
            plgpu.copy_smem_to_gmem(dq_smem, dst, predicate=r != 0, reduction_op="add")
            return idx

        @pl.when(wg < 2)
        def _compute():
            plgpu.set_max_registers(232, action="increase")
            k_smem, v_smem = k_smem2.at[wg], v_smem2.at[wg]
            ds_smem = None if split_cols else ds_smem2.at[wg]

            def both_halves_part(parity):
                """split_cols: this warpgroup's columns of ds^T . k over the tile's 128 keys (both warpgroups' ds and
                k, once both have written their ds of the step; the parity's buffers are not rewritten before the
                other warpgroup has passed the next step's meeting), one accumulator."""
                plgpu.barrier_arrive(pair.at[parity])
                plgpu.barrier_wait(pair.at[parity])
                half = d // 2
                cols = pl.ds(pl.multiple_of(wg * half, half), half)

                def run(acc):
                    for w in range(2):
                        plgpu.wgmma(acc, ds_smem2.at[parity, w].transpose((1, 0)), k_smem2.at[w, :, cols])
                    plgpu.wgmma_wait(0)
                    return acc[...]

                return pl.run_scoped(run, plgpu.ACC((rows, half), F32))
            col = lambda ref: plgpu.load(ref, layout=plgpu.Layout.WGMMA.reduce(0), optimized=False)  # noqa: E731
            shape = (rows, rows)  # rows: this warpgroup's keys; columns: the step's queries

            def item_loop(j, carry):
                it, prev = carry
                item = items_ref[sm, j]
                bi, kvh, kt = decode(item)
                key0 = kt * CTA_ROWS + wg * rows
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last item's dk / dv stores have read k / v
                plgpu.copy_gmem_to_smem(k_ref.at[bi, pl.ds(key0, rows), kvh], k_smem, k_bar.at[wg])
                plgpu.copy_gmem_to_smem(v_ref.at[bi, pl.ds(key0, rows), kvh], v_smem, v_bar.at[wg])
                plgpu.barrier_wait(k_bar.at[wg])
                plgpu.barrier_wait(v_bar.at[wg])

                def step(i, carry):
                    it, prev, dk, dv = carry
                    s = slot(it)
                    hi, qb = step_coords(kt, kvh, i)
                    q_smem, do_smem = q_ring.at[s], do_ring.at[s]
                    lse_smem, delta_smem, start_smem = lse_ring.at[s], delta_ring.at[s], start_ring.at[s]
                    plgpu.barrier_wait(full.at[s])
                    s_t = wgmma_fresh(k_smem, q_smem.transpose((1, 0)), shape)

                    def visible():
                        key = _iota(shape, 0) + key0
                        query = _iota(shape, 1) + qb * rows
                        start = lax.broadcast_in_dim(col(start_smem), shape, [1])
                        return (key <= query) & (key >= start)

                    full_block = (qb * rows >= key0 + rows - 1) & (start_smem[rows - 1] <= key0)
                    probabilities = lambda vis: _probabilities(s_t, vis, col(lse_smem), c, 1)  # noqa: E731
                    p_t = masked_unless(full_block, probabilities, visible)
                    p_op = p_t.astype(dtype)
                    if interpret:
                        staging[0].at[wg][...] = p_op
                        plgpu.commit_smem()
                        p_op = staging[0].at[wg]
                    dv = dv + wgmma_fresh(p_op, do_smem, (rows, d))
                    dp_t = wgmma_fresh(v_smem, do_smem.transpose((1, 0)), shape)
                    ds_t = p_t * (dp_t - lax.broadcast_in_dim(col(delta_smem), shape, [1]))
                    mine = ds_smem2.at[lax.rem(it, 2), wg] if split_cols else ds_smem
                    mine[...] = ds_t.astype(dtype)
                    plgpu.commit_smem()
                    dk = dk + wgmma_fresh(mine, q_smem, (rows, d))
                    plgpu.barrier_arrive(empty.at[s])  # q / do of the slot are read (k, v, ds are ours)
                    if split_cols:
                        part = both_halves_part(lax.rem(it, 2))
                    else:
                        part = wgmma_fresh(ds_smem.transpose((1, 0)), k_smem, (rows, d))
                    prev = add_part(part, item, bi, hi, qb, prev)
                    return it + 1, prev, dk, dv

                zeros = plgpu.layout_cast(jnp.full((rows, d), 0.0, F32), plgpu.Layout.WGMMA)
                it, prev, dk, dv = lax.fori_loop(0, group * (q_blocks - 2 * kt), step, (it, prev, zeros, zeros))
                if split_cols:  # the other warpgroup has read this one's k (its last dq part) before dk lands there
                    plgpu.barrier_arrive(pair.at[2])
                    plgpu.barrier_wait(pair.at[2])
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                k_smem[...] = (dk * scale).astype(dtype)  # k and v are no longer read: their buffers stage dk, dv
                v_smem[...] = dv.astype(dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(k_smem, dk_ref.at[bi, pl.ds(key0, rows), kvh])
                plgpu.copy_smem_to_gmem(v_smem, dv_ref.at[bi, pl.ds(key0, rows), kvh])
                return it, prev

            _, prev = lax.fori_loop(0, n_items, item_loop, (jnp.int32(0), jnp.int32(-1)))
            plgpu.wait_smem_to_gmem(0)
            if not interpret:
                @pl.when(prev >= 0)
                def _():
                    pl.semaphore_signal(sems.at[prev])

    kv_type = jax.ShapeDtypeStruct(k.shape, dtype)
    out_type = (kv_type, kv_type, jax.ShapeDtypeStruct((b, t, h, d) if split_cols else (2, b, t, h, d), F32))

    def kernel(*refs):
        pl.run_scoped(functools.partial(scoped, *refs), *allocations, collective_axes="wg")

    call = plgpu.kernel(
        kernel, out_type=out_type, grid=(num_sms,), grid_names=("sm",), num_threads=3, thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True, lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        kernel_name="attention_bwd_fused")
    return launch(call, q, k, v, starts, do, lse2, delta, items, counts, rank, interpret=interpret)


def backward_fused(q, k, v, starts, out, do, lse2, *, scale: float, stages: int, interpret: bool,
                   num_sms: int | None = None, split_cols: bool = True):
    """(dq, dk, dv) in q's dtype, as `attention_bwd.backward` (same padded shapes); dk, dv have its bits, dq its
    accuracy with the fixed order above. num_sms: CTAs of the persistent grid (default: the device's SMs; 1 in
    interpret mode, whose CTAs run one after another)."""
    b, t, h, _ = q.shape
    hkv = k.shape[2]
    sms = 1 if interpret else (num_sms or interpret_mode.num_sms(False))
    items, counts, rank = schedule(b, hkv, t // CTA_ROWS, t // BWD_BLOCK, h // hkv, sms)
    delta = jnp.einsum("bthd,bthd->bht", do.astype(F32), out.astype(F32))
    dk, dv, acc = _fused(q, k, v, starts, do, lse2, delta, jnp.asarray(items), jnp.asarray(counts),
                         jnp.asarray(rank), scale=scale, stages=stages, num_sms=sms, split_cols=split_cols,
                         interpret=interpret)
    dq = ((acc if split_cols else acc[0] + acc[1]) * scale).astype(q.dtype)
    return dq, dk, dv
