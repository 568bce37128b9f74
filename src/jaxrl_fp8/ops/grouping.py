"""Ragged (expert-sorted) row groups as a static-length list of (group, row-tile) work items.

The grouped GEMMs never compute every expert on every row (which is what `lax.ragged_dot` lowers to on
CPU: a masked dense product over all groups). Rows are sorted by group, so row tile t of size T meets at
most a few groups; the work list holds one item per (group, tile) pair that shares a row. Its length is
bounded statically by ceil(M / T) + E (each group boundary splits at most one tile), so it jits.

Reference math like `xla_gemm` (which it builds on): XLA only, no backend choice; the FP8 paths take the block
product `block_dot` from `ops.block_scaled`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from jaxrl_fp8.ops.xla_gemm import F32, block_scaled_matmul, dot_nt_f32, dot_tn_f32, xla_block_dot


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class WorkItems:
    group: jax.Array  # int32 [P]
    tile: jax.Array  # int32 [P]
    valid: jax.Array  # bool [P]
    starts: jax.Array  # int32 [E] first row of each group
    ends: jax.Array  # int32 [E] one past the last row (clipped to M)
    tile_rows: int = dataclasses.field(metadata=dict(static=True))
    num_tiles: int = dataclasses.field(metadata=dict(static=True))

    def row_mask(self, i) -> jax.Array:
        """bool [T]: which rows of item i's tile belong to item i's group."""
        rows = self.tile[i] * self.tile_rows + jnp.arange(self.tile_rows, dtype=jnp.int32)
        g = self.group[i]
        return self.valid[i] & (rows >= self.starts[g]) & (rows < self.ends[g])


def check_group_sizes(group_sizes, num_groups: int, what: str = "group_sizes") -> jax.Array:
    group_sizes = jnp.asarray(group_sizes)
    if group_sizes.shape != (num_groups,):
        raise ValueError(f"{what} must have shape ({num_groups},) (one size per expert); got {group_sizes.shape}")
    if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(f"{what} must be an integer array; got {group_sizes.dtype}")
    return group_sizes.astype(jnp.int32)


def work_items(group_sizes: jax.Array, m: int, tile_rows: int) -> WorkItems:
    e = group_sizes.shape[0]
    num_tiles = max(1, -(-m // tile_rows))
    sizes = jnp.maximum(group_sizes.astype(jnp.int32), 0)
    ends = jnp.minimum(jnp.cumsum(sizes), m)
    starts = jnp.minimum(ends - sizes, ends)
    starts = jnp.maximum(starts, 0)
    first = starts // tile_rows
    last = (ends + tile_rows - 1) // tile_rows
    n_items = jnp.where(ends > starts, last - first, 0)
    cum = jnp.cumsum(n_items)
    offsets = cum - n_items
    p = num_tiles + e
    i = jnp.arange(p, dtype=jnp.int32)
    g = jnp.minimum(jnp.searchsorted(cum, i, side="right", method="compare_all").astype(jnp.int32), e - 1)  # no while loop
    valid = i < cum[-1]
    tile = jnp.clip(first[g] + i - offsets[g], 0, num_tiles - 1)
    return WorkItems(g, tile.astype(jnp.int32), valid, starts, ends, tile_rows, num_tiles)


def xla_row_tile(m: int, num_groups: int) -> int:
    """Rows per tile of the XLA grouped path: about the mean group size, 8..128 (>= 2 keeps rows invariant)."""
    mean = max(1, -(-m // max(num_groups, 1)))
    t = 8
    while t < mean and t < 128:
        t *= 2
    return t


def _pad_rows(x: jax.Array, rows: int) -> jax.Array:
    return jnp.pad(x, [(0, rows - x.shape[0])] + [(0, 0)] * (x.ndim - 1)) if rows > x.shape[0] else x


def grouped_rows_apply(rows_fn, row_operands, group_sizes, m: int, n: int, num_groups: int, tile_rows: int, out_dtype):
    """out[r] = rows_fn(tile operands, group)[r] for each row r of a group; rows past the groups are 0.

    `row_operands` is a tuple of arrays whose leading axis is the row axis (x, its scales, ...).
    """
    items = work_items(group_sizes, m, tile_rows)
    mp = items.num_tiles * tile_rows
    ops = tuple(_pad_rows(o, mp) for o in row_operands)

    def step(out, i):
        start = items.tile[i] * tile_rows
        tiles = tuple(lax.dynamic_slice_in_dim(o, start, tile_rows, 0) for o in ops)
        y = rows_fn(tiles, items.group[i])
        cur = lax.dynamic_slice_in_dim(out, start, tile_rows, 0)
        new = jnp.where(items.row_mask(i)[:, None], y.astype(out.dtype), cur)
        return lax.dynamic_update_slice_in_dim(out, new, start, 0), None

    out, _ = lax.scan(step, jnp.zeros((mp, n), F32), jnp.arange(items.group.shape[0]))
    return out[:m].astype(out_dtype)


def grouped_dot(x, w, group_sizes, *, out_dtype=F32, compute_dtype=jnp.bfloat16):
    """y[r] = x[r] . w[g(r)]^T, float32 accumulation, in `compute_dtype` operands. x [M, K], w [E, N, K]."""
    m = x.shape[0]
    e, n, _ = w.shape
    wc = w.astype(compute_dtype)

    def rows_fn(tiles, g):
        return dot_nt_f32(tiles[0], wc[g])

    return grouped_rows_apply(rows_fn, (x.astype(compute_dtype),), group_sizes, m, n, e, xla_row_tile(m, e), out_dtype)


def grouped_block_scaled_matmul(a_q, a_scale, b_q, b_scale, group_sizes, *, out_dtype=F32, block_dot=xla_block_dot):
    """Grouped block math: rows of group g use b_q[g] [N, K] with 128x128 scales b_scale[g] (`block_dot`: as in
    `xla_gemm.block_scaled_matmul`)."""
    m = a_q.shape[0]
    e, n, _ = b_q.shape

    def rows_fn(tiles, g):
        return block_scaled_matmul(tiles[0], tiles[1], b_q[g], b_scale[g], block_dot=block_dot)

    return grouped_rows_apply(rows_fn, (a_q, a_scale), group_sizes, m, n, e, xla_row_tile(m, e), out_dtype)


def grouped_wgrad(dy, x, group_sizes, num_groups: int, *, compute_dtype=jnp.bfloat16):
    """dw[g] = dy[rows of g]^T . x[rows of g]  -> [E, N, K] float32 (tiles accumulated in row order)."""
    m, n = dy.shape
    k = x.shape[1]
    tile_rows = xla_row_tile(m, num_groups)
    items = work_items(group_sizes, m, tile_rows)
    mp = items.num_tiles * tile_rows
    dyp = _pad_rows(dy.astype(compute_dtype), mp)
    xp = _pad_rows(x.astype(compute_dtype), mp)

    def step(dw, i):
        start = items.tile[i] * tile_rows
        d = lax.dynamic_slice_in_dim(dyp, start, tile_rows, 0)
        d = jnp.where(items.row_mask(i)[:, None], d, jnp.zeros_like(d))
        xt = lax.dynamic_slice_in_dim(xp, start, tile_rows, 0)
        g = items.group[i]
        return dw.at[g].add(dot_tn_f32(d, xt)), None

    dw, _ = lax.scan(step, jnp.zeros((num_groups, n, k), F32), jnp.arange(items.group.shape[0]))
    return dw


def grouped_wgrad_fp8(dyt_q, dyt_scale, xt_q, xt_scale, group_sizes, num_groups: int, *, block_dot=xla_block_dot):
    """FP8 grouped wgrad: operands quantized 1x128 along M (the contraction axis), in 128-row tiles.

    dyt_q [N, M] e4m3 with dyt_scale [N, ceil(M/128)]; xt_q [K, M] with xt_scale [K, ceil(M/128)].
    A 128-row quantization group may straddle two experts: each item zeroes the other expert's rows.
    """
    n, m = dyt_q.shape
    k = xt_q.shape[0]
    tile_rows = 128
    items = work_items(group_sizes, m, tile_rows)
    mp = items.num_tiles * tile_rows
    a = jnp.pad(dyt_q, [(0, 0), (0, mp - m)])
    b = jnp.pad(xt_q, [(0, 0), (0, mp - m)])

    def step(dw, i):
        t = items.tile[i]
        at = lax.dynamic_slice_in_dim(a, t * tile_rows, tile_rows, 1)
        at = jnp.where(items.row_mask(i)[None, :], at, jnp.zeros_like(at))
        bt = lax.dynamic_slice_in_dim(b, t * tile_rows, tile_rows, 1)
        sa = lax.dynamic_slice_in_dim(dyt_scale, t, 1, 1)
        sb = lax.dynamic_slice_in_dim(xt_scale, t, 1, 1)
        part = block_scaled_matmul(at, sa, bt, sb, b_rows_per_scale=1, block_dot=block_dot)
        g = items.group[i]
        return dw.at[g].add(part), None

    dw, _ = lax.scan(step, jnp.zeros((num_groups, n, k), F32), jnp.arange(items.group.shape[0]))
    return dw
