"""The warp-specialized TMA ring of the persistent GEMM kernels (grouped FP8 / BF16 forward, FP8 weight gradient).

One program per SM, three warpgroups: warpgroup 2 (40 registers) walks the program's tiles and issues each tile's
TMA loads into a ring of `stages` buffers; warpgroups 0 and 1 (232 registers) walk the same tiles and consume the
buffers in the same order. Buffer i is guarded by `full[i % stages]` (the loads of a step complete on it) and
`empty[i % stages]` (both compute warpgroups arrive once they have read it). The ring's position runs on from
tile to tile, so the next tile's loads stream while a tile's epilogue stores: no pipeline fill or drain per tile.
The compute side consumes a tile's steps with `chained_steps` (16-bit operands: every step's wgmma into one
accumulator) or `promoted_blocks` (block-scaled FP8: a fresh wgmma per block, promoted into a float32 sum in order).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

__all__ = ["CHAIN_LENGTHS", "barriers", "chained_steps", "produce", "promoted_blocks", "slot", "warp_specialized"]


def barriers(stages: int, loads_per_step: int):
    """The ring's (full, empty) barrier allocations: `loads_per_step` TMA copies complete a step's buffer, two
    compute warpgroups free it."""
    return (plgpu.Barrier(num_arrivals=loads_per_step, num_barriers=stages),
            plgpu.Barrier(num_arrivals=2, num_barriers=stages))


def warp_specialized(memory, compute):
    """Run memory() on warpgroup 2 and compute(wg) on warpgroups 0 / 1, with the ring's register split."""
    wg = lax.axis_index("wg")

    @pl.when(wg == 2)
    def _memory():
        plgpu.set_max_registers(40, action="decrease")
        memory()

    @pl.when(wg < 2)
    def _compute():
        plgpu.set_max_registers(232, action="increase")
        compute(wg)


def slot(it, stages: int):
    return lax.rem(it, stages)


def produce(num_tiles: int, tile, *, stages: int, empty) -> None:
    """The memory warpgroup's walk over the persistent grid's tiles (`nd_loop` over "sm", as the compute side's).

    tile(index) -> (steps, load): the tile's number of ring steps and load(step, slot), which issues that step's
    TMA copies into buffer `slot` (completing on its `full` barrier). A buffer is refilled only once both compute
    warpgroups have freed it; at the end the last `stages` buffers' frees are awaited, so no arrival is pending."""

    @plgpu.nd_loop((num_tiles,), collective_axes="sm", init_carry=jnp.int32(0))
    def issued(info, carry):
        steps, load = tile(info.index[0])

        def step(j, it):
            s = slot(it, stages)

            @pl.when(it >= stages)
            def _():
                plgpu.barrier_wait(empty.at[s])

            load(j, s)
            return it + 1

        return lax.fori_loop(0, steps, step, carry)

    @pl.loop(jnp.maximum(issued - stages, 0), issued)
    def _(it):
        plgpu.barrier_wait(empty.at[slot(it, stages)])


def chained_steps(acc_ref, n, it, *, full, empty, stages: int, mma):
    """n ring steps from ring position `it`, each mma(acc_ref, slot) chained into one wgmma accumulator (no scales).
    One wgmma stays in flight: a step waits for its buffer, issues its wgmma, then waits only for the step before's
    and frees that one's buffer, so the tensor core never idles between steps (the buffer of the step in flight is
    still held, hence `stages` >= 2). Same wgmmas on the same accumulator in the same order: the same bits as waiting
    for each. Returns the ring position after them."""

    def step(j, it):
        s = slot(it, stages)
        plgpu.barrier_wait(full.at[s])
        mma(acc_ref, s)
        plgpu.wgmma_wait(1)

        @pl.when(j > 0)
        def _():
            plgpu.barrier_arrive(empty.at[slot(it - 1, stages)])

        return it + 1

    end = lax.fori_loop(0, n, step, it)
    plgpu.wgmma_wait(0)

    @pl.when(n > 0)
    def _():
        plgpu.barrier_arrive(empty.at[slot(end - 1, stages)])

    return end


def promoted_blocks(n, acc, it, *, full, stages: int, blocks_per_step: int, acc_shape, mma, promote):
    """n block-scaled K blocks from ring position `it` added to the float32 `acc` in order: per block mma(acc_ref,
    slot) into a fresh accumulator, then promote(acc, acc_ref, slot, wait_n) (waits for that wgmma, adds its scaled
    product, frees the slot). Returns (acc, ring position).

    The blocks run in chains of `blocks_per_step` (1 or 2): in a chain of 2 the second block's wgmma is issued
    before the first is promoted, so that promotion runs under the tensor core's work (a warpgroup holds two ring
    buffers at a time); an odd last block runs alone. Same wgmmas, promotions in block order: the same bits. (Chains
    of 4 and 8, the same code, measured 1.3-2.3x slower on an H100: results/gemm_chains_h100.json.)"""
    if blocks_per_step not in CHAIN_LENGTHS:
        raise ValueError(f"tma_ring.promoted_blocks: blocks_per_step must be one of {CHAIN_LENGTHS}; got {blocks_per_step}")

    def chain(length):
        def link(i, out, prev, it):
            """Block i of the chain into a fresh accumulator (nested scopes: an accumulator lives from its wgmma to
            its promotion, at most two at a time)."""
            def scope(cur):
                s = slot(it + i, stages)
                plgpu.barrier_wait(full.at[s])
                mma(cur, s)
                res = out if prev is None else promote(out, prev, slot(it + i - 1, stages), 1)
                if i == length - 1:
                    return promote(res, cur, s, 0)
                return link(i + 1, res, cur, it)

            return pl.run_scoped(scope, plgpu.ACC(acc_shape, jnp.float32))

        def body(_, carry):
            acc, it = carry
            return link(0, acc, None, it), it + length

        return body

    carry = lax.fori_loop(0, lax.div(n, blocks_per_step), chain(blocks_per_step), (acc, it))
    if blocks_per_step == 2:
        carry = lax.fori_loop(0, lax.rem(n, 2), chain(1), carry)  # an odd last block alone
    return carry


CHAIN_LENGTHS = (1, 2)
