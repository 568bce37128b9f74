"""Expert parallelism for the MoE layers: each device holds E / ep experts; tokens travel to them and back.

Inside one `shard_map` over the whole mesh, per device (its n tokens, its E_l = E / ep experts):

1. The n*k (token, slot) pairs are stably sorted by global expert id, exactly as `model.moe.dispatch`, so
   pairs bound for the same device are contiguous; each is written into a fixed-capacity send buffer
   [ep, C, H] with C = n*k (the worst case: every pair to one device; nothing is ever dropped).
2. `all_to_all` over the `expert` axis delivers the rows (and their local expert ids) to their experts.
3. The received rows are sorted by local expert and multiplied with `ops.grouped_linear` (through
   `model.matmul`, the same call the single-device layer makes); empty capacity slots sort last and are
   padding rows of the grouped GEMM. With a `tensor` axis the expert intermediate dimension is split too
   (gate/up by rows, down by columns) and the down projection's partial sums are `psum`-ed over `tensor`.
4. A second `all_to_all` returns the rows to where they came from; the combine is `model.moe.combine`
   (float32, slot order), so a token's output is computed by the same operations as without the mesh.

Routing (router GEMM, top-k, R3 replay) stays outside, in the auto-sharded program: it is token-local.
The backward pass is JAX's transpose of the same program (all_to_all transposes to all_to_all), so the
expert weight gradients are produced on the device that owns the expert.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from jaxrl_fp8.model import matmul, moe as moe_lib
from jaxrl_fp8.model.numerics import silu
from jaxrl_fp8.sharding.mesh import BATCH_AXES

__all__ = ["expert_parallel_moe", "make_moe_impl"]


def _spec_axes(mesh: Mesh, axes):
    live = tuple(a for a in axes if mesh.shape[a] > 1)
    return None if not live else live[0] if len(live) == 1 else live


def expert_parallel_moe(x, experts, weights, gate_w, up_w, down_w, *, mesh: Mesh, fmts=(None, None, None),
                        backward: str = "high_precision", expert_axis: str = "expert", tensor_axis: str = "tensor"):
    """Sum over slots of weights * expert_MLP(x) with the experts split over `expert_axis`.

    x [N, H] (N = tokens, split over the batch axes), experts int32 [N, k] (global ids), weights f32 [N, k],
    gate_w / up_w [E, I, H], down_w [E, H, I]; fmts: the three projections' formats (None: param dtype).
    Returns float32 [N, H].
    """
    ep = mesh.shape[expert_axis]
    tp = mesh.shape[tensor_axis]
    num_experts = gate_w.shape[0]
    if num_experts % ep:
        raise ValueError(f"expert parallelism: num_experts={num_experts} is not a multiple of mesh {expert_axis}={ep}")
    inter = gate_w.shape[1]
    if inter % tp:
        raise ValueError(f"expert parallelism: moe_intermediate_size={inter} is not a multiple of mesh {tensor_axis}={tp}")
    rows = _spec_axes(mesh, BATCH_AXES)
    ex = expert_axis if ep > 1 else None
    tn = tensor_axis if tp > 1 else None
    body = functools.partial(_local_moe, ep=ep, tp=tp, fmts=tuple(fmts), backward=backward, expert_axis=expert_axis,
                             tensor_axis=tensor_axis)
    fn = jax.shard_map(body, mesh=mesh,
                       in_specs=(P(rows, None), P(rows, None), P(rows, None), P(ex, tn, None), P(ex, tn, None), P(ex, None, tn)),
                       out_specs=P(rows, None), check_vma=False)
    return fn(x, experts.astype(jnp.int32), weights, gate_w, up_w, down_w)


def _local_moe(x, experts, weights, gate_w, up_w, down_w, *, ep, tp, fmts, backward, expert_axis, tensor_axis):
    n, k = experts.shape
    e_local = gate_w.shape[0]
    cap = n * k  # per destination: no pair is ever dropped
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)
    sorted_experts = flat[order]
    dest = sorted_experts // e_local
    count = jnp.zeros((ep,), jnp.int32).at[dest].add(1)
    start = jnp.cumsum(count) - count
    slot = dest * cap + jnp.arange(n * k, dtype=jnp.int32) - start[dest]
    send_x = jnp.zeros((ep * cap, x.shape[1]), x.dtype).at[slot].set(x[order // k])
    send_e = jnp.full((ep * cap,), e_local, jnp.int32).at[slot].set(sorted_experts - dest * e_local)
    if ep > 1:
        recv_x = jax.lax.all_to_all(send_x, expert_axis, 0, 0, tiled=True)
        recv_e = jax.lax.all_to_all(send_e, expert_axis, 0, 0, tiled=True)
    else:
        recv_x, recv_e = send_x, send_e
    local_order = jnp.argsort(recv_e, stable=True).astype(jnp.int32)
    group_sizes = jnp.zeros((e_local,), jnp.int32).at[recv_e].add(1, mode="drop")
    xs = recv_x[local_order]
    h = silu(matmul.grouped_linear(xs, gate_w, group_sizes, fmts[0], backward)) * matmul.grouped_linear(
        xs, up_w, group_sizes, fmts[1], backward)
    y = matmul.grouped_linear(h, down_w, group_sizes, fmts[2], backward)
    if tp > 1:
        y = jax.lax.psum(y, tensor_axis)
    y_recv = jnp.zeros_like(y).at[local_order].set(y)
    back = jax.lax.all_to_all(y_recv, expert_axis, 0, 0, tiled=True) if ep > 1 else y_recv
    rows_sorted = back[slot]
    d = moe_lib.Dispatch(order, jnp.zeros((0,), jnp.int32), order // k, moe_lib.inverse_permutation(order))
    return moe_lib.combine(rows_sorted, d, weights)


def make_moe_impl(mesh: Mesh, **kw):
    """The callable the model's MoE layer takes (`moe_impl`): (x, routing, gate_w, up_w, down_w, fmts, backward)."""

    def moe_impl(x, routing, gate_w, up_w, down_w, fmts, backward):
        return expert_parallel_moe(x, routing.experts, routing.weights, gate_w, up_w, down_w, mesh=mesh, fmts=fmts,
                                   backward=backward, **kw)

    return moe_impl
