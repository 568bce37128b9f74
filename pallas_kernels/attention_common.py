"""What every kernel of the flash-attention family shares: the tile sizes that define the bits, the one
online-softmax update rule, the visibility rule, and the wgmma / operand helpers (see pallas_kernels/attention.py)."""

from __future__ import annotations

import functools
import math

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

F32 = jnp.float32
LOG2E = math.log2(math.e)
BLOCK_Q = 64  # query rows per compute warpgroup (one wgmma M tile)
BLOCK_KV = 128  # keys per block = tokens per KV-cache page
MEMORY_REGISTERS = 40  # a thread of the TMA (memory) warpgroup: it only issues copies

# ------------------------------------------------------------------------------------------ the math rule


def online_softmax_step(qk, visible, m_i, l_i, acc, c):
    """One key block of the online softmax, for rows of qk [rows, BLOCK_KV] (float32 q.k).

    The mask applies to the raw scores (a masked score is -inf), so the masked and the unmasked block run the
    same arithmetic after it: m = max(m_prev, max(qk) * c), which equals the max of the scaled scores (c > 0:
    rounding is monotone), and p = 2^(qk * c - m), one product feeding one difference, which a compiler may
    contract into an fma the same way in every kernel. visible None: every key of the block is visible to every
    row (the bits of an all-true mask, without computing it).

    Returns (p, m, l, acc): p the block's unnormalised probabilities, m the running max of c*q.k (base-2
    units), l the running sum, acc rescaled (the caller adds p.v). With no visible key in the block a row's
    m stays, alpha is exactly 1 and p is exactly 0: the block changes nothing for that row. A row that has
    seen no visible key yet keeps m = -inf and l = 0 (m_use = 0 avoids -inf - -inf).
    """
    s = qk if visible is None else jnp.where(visible, qk, -jnp.inf)
    m_new = jnp.maximum(m_i, s.max(axis=1) * c)
    m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = jnp.where(m_new == m_i, 1.0, jnp.exp2(m_i - m_use))
    p = jnp.exp2(s * c - lax.broadcast_in_dim(m_use, s.shape, [0]))
    l_i = l_i * alpha + p.sum(axis=1)
    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
    return p, m_new, l_i, acc


def visible_keys(rows: int, kv_base, row_pos, row_start):
    """bool [rows, BLOCK_KV] in the wgmma layout: key kv_base + j visible to row r iff start[r] <= key <= pos[r]."""
    kv = plgpu.broadcasted_iota(jnp.int32, (rows, BLOCK_KV), 1, layout=plgpu.Layout.WGMMA) + kv_base
    pos = lax.broadcast_in_dim(row_pos, (rows, BLOCK_KV), [0])
    start = lax.broadcast_in_dim(row_start, (rows, BLOCK_KV), [0])
    return (kv <= pos) & (kv >= start)


def fully_visible_blocks(last_start, first_pos, block: int = BLOCK_KV):
    """(lo, hi): key blocks (of `block` keys) lo <= j < hi are visible to every row of a tile whose largest
    segment start is `last_start` and whose smallest position is `first_pos` (int32 scalars): their mask is all
    true."""
    lo = lax.div(last_start + (block - 1), jnp.int32(block))
    hi = lax.div(first_pos + 1, jnp.int32(block))
    return lo, hi


def masked_unless(full, fn, visible):
    """fn(None) on a block visible to every row (`full`, from `fully_visible_blocks`), else fn(visible()): a uniform
    branch, so the common block skips the mask's integer work."""
    return lax.cond(full, lambda: fn(None), lambda: fn(visible()))


def finish_rows(acc, m_i, l_i):
    """Normalised output and the base-2 log-sum-exp of the rows."""
    out = acc / lax.broadcast_in_dim(l_i, acc.shape, [0])
    return out, m_i + jnp.log2(l_i)


def swizzled(dtype, cols: int | None = None):
    """Shared-memory transforms of a tile whose rows are `cols` wide (None: at least 128 bytes): the widest swizzle
    a row fills (an FP8 page of head_dim 64 has 64-byte rows)."""
    itemsize = jnp.dtype(dtype).itemsize
    swizzle = 128 if cols is None else min(128, cols * itemsize)
    return (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))


def wgmma_fresh(a, b, shape, issued=None):
    """a . b into a fresh float32 accumulator (its bits depend on a and b only). issued(): run between issuing
    the wgmma and waiting for it."""

    def run(acc_ref):
        plgpu.wgmma(acc_ref, a, b)
        if issued is not None:
            issued()
        plgpu.wgmma_wait(0)
        return acc_ref[...]

    return pl.run_scoped(run, plgpu.ACC(shape, F32))


def a_staging(shape, dtype, interpret: bool):
    """Shared memory for register-computed wgmma A operands (p, ds) in interpret mode only: Mosaic GPU's
    interpreter takes wgmma operands from shared memory alone; on the GPU they stay in registers. The
    operand's values, hence the product's bits, are the same either way."""
    return plgpu.SMEM(shape, dtype, transforms=swizzled(dtype)) if interpret else None


def a_operand(x, staging, wg, interpret: bool):
    if not interpret:
        return x
    ref = staging.at[wg]
    ref[...] = x
    plgpu.commit_smem()
    return ref


def row_vector(ref):
    """A [BLOCK_Q] float32 / int32 GMEM slice as a per-row vector of the wgmma layout."""
    return plgpu.load(ref, layout=plgpu.Layout.WGMMA.reduce(1), optimized=False)


def initial_softmax_state(rows: int, d: int):
    """(acc, m, l) of rows that have seen no key: acc = 0, m = -inf, l = 0, in the wgmma layouts."""
    m_i = plgpu.layout_cast(jnp.full((rows,), -jnp.inf, F32), plgpu.Layout.WGMMA.reduce(1))
    l_i = plgpu.layout_cast(jnp.full((rows,), 0.0, F32), plgpu.Layout.WGMMA.reduce(1))
    acc = plgpu.layout_cast(jnp.full((rows, d), 0.0, F32), plgpu.Layout.WGMMA)
    return acc, m_i, l_i


def turn_barrier():
    """The barrier two compute warpgroups take turns on (`take_turn`)."""
    return plgpu.Barrier(num_arrivals=2)


def take_turn(turn):
    """FA3's ping-pong: both compute warpgroups arrive and wait, so with one warpgroup a turn ahead (it takes an
    extra turn before its loop, the other after) one's elementwise work runs while the other's wgmmas hold the
    tensor cores. It orders independent work only, never a row's arithmetic; both must take equally many turns.
    Not taken in interpret mode: there each warpgroup is a host thread whose barrier waits hold one of the CPU
    client's few callback threads, and two waiting on each other's turn can starve the warpgroup they wait for
    (a 2-core host deadlocked in the model's forward); the GPU tests run the turns."""
    plgpu.barrier_arrive(turn)
    plgpu.barrier_wait(turn)


def block_pipeline(body, steps, in_specs, *, stages: int, compute_wgs: int, compute_thread):
    """The family's warp-specialized TMA pipeline: one memory warpgroup (MEMORY_REGISTERS) feeding `compute_wgs`
    compute warpgroups, which arrive on the consumed barriers themselves (as soon as a block is read)."""
    return plgpu.emit_pipeline_warp_specialized(
        body, grid=(steps,), memory_registers=MEMORY_REGISTERS, in_specs=in_specs, wg_axis="wg",
        num_compute_wgs=compute_wgs, max_concurrent_steps=stages, manual_consumed_barriers=True,
        compute_context=compute_thread)


def kernel_call(scoped, allocations, out_type, grid, grid_names, compute_wgs: int, *, name: str):
    """plgpu.kernel with the family's settings (warpgroup semantics, approximate exp2 / log2: deterministic) whose
    body is scoped(*kernel refs, *allocations), the allocations shared by all warpgroups; `name` names the CUDA
    kernel (`<name>_mosaic_gpu_kernel` in a profile)."""

    def kernel(*refs):
        pl.run_scoped(functools.partial(scoped, *refs), *allocations, collective_axes="wg")

    return plgpu.kernel(
        kernel, out_type=out_type, grid=grid, grid_names=grid_names, num_threads=compute_wgs + 1, thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True, lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        kernel_name=name)
