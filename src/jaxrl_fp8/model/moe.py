"""MoE routing, routing replay (R3) and the sorted-token dispatch around the grouped GEMM. Pure functions.

Routing is HF Qwen3-MoE's: float32 softmax over all experts, top-k, renormalized over the k picks when
`norm_topk_prob`. Replay (R3) keeps the *selection* given by the rollout and takes the gate weights from this
model's own router probabilities (softmax over all experts, gather the replayed experts, renormalize exactly
as HF when `norm_topk_prob`); a row holding any negative index falls back to the computed routing.

Dispatch: the N*k (token, expert) pairs are stably sorted by expert, so each expert's rows are contiguous
for `ops.grouped_linear` (group_sizes = tokens per expert); nothing is dropped and no expert sees a token it
was not routed. The results are gathered back to (token, slot) order and combined in float32 in slot order
(a fixed order, so a token's output does not depend on the other tokens). Rows move by gathers in both directions
(the derivatives too: `_permute_rows`, `_rows_of_tokens`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from jaxrl_fp8.model.numerics import rounded_product, row_sum, softmax
from jaxrl_fp8.precision.arith import ieee_div

F32 = jnp.float32

__all__ = ["Routing", "route", "dispatch", "sorted_rows", "combine", "inverse_permutation", "load_balancing_stats", "load_balancing_loss"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Routing:
    probs: jax.Array  # f32 [N, E] softmax over all experts
    experts: jax.Array  # int32 [N, k] the experts used
    weights: jax.Array  # f32 [N, k] their gate weights


def route(router_logits: jax.Array, k: int, norm_topk_prob: bool, replay: jax.Array | None = None) -> Routing:
    """router_logits f32 [N, E]; replay int [N, k] or None."""
    probs = softmax(router_logits.astype(F32))
    _, top = lax.top_k(probs, k)
    experts = top.astype(jnp.int32)
    if replay is not None:
        replay = replay.astype(jnp.int32)
        use = jnp.all(replay >= 0, axis=-1, keepdims=True)
        experts = jnp.where(use, replay, experts)
    weights = jnp.take_along_axis(probs, experts, axis=-1)
    if norm_topk_prob:
        weights = ieee_div(weights, row_sum(weights, keepdims=True))
    return Routing(probs, experts, weights)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Dispatch:
    order: jax.Array  # int32 [N*k]: position p of the sorted rows holds pair order[p]
    group_sizes: jax.Array  # int32 [E]
    token_of_row: jax.Array  # int32 [N*k]
    inverse: jax.Array  # int32 [N*k]: pair q sits at sorted position inverse[q] (inverse[order[p]] == p)


def inverse_permutation(order: jax.Array) -> jax.Array:
    """inverse[order[p]] = p for a permutation `order` (an integer scatter of N*k indices)."""
    return jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype), unique_indices=True)


# Up to this many (token, expert) pairs, `dispatch` ranks pairs by counting instead of sorting: a decode step of 256
# rows x top-8 (2,048 pairs) spent 15 us a layer in XLA:GPU's sort (H100, results/step_profile_decode256_h100.json)
# for what one [n, n] compare-and-count fusion gives; the count's work grows as n^2, so long batches keep the sort.
COUNTING_DISPATCH_MAX_PAIRS = 4096


def sorted_positions_by_counting(flat: jax.Array) -> jax.Array:
    """int32 [n]: where pair q lands in the stable sort of `flat` by value, = #{p : (flat[p], p) < (flat[q], q)}.
    Integer counts, so exact and the same permutation as `argsort(stable=True)`'s inverse."""
    n = flat.shape[0]
    idx = jnp.arange(n, dtype=jnp.int32)
    before = (flat[None, :] < flat[:, None]) | ((flat[None, :] == flat[:, None]) & (idx[None, :] < idx[:, None]))
    return jnp.sum(before, axis=1, dtype=jnp.int32)


def dispatch(experts: jax.Array, num_experts: int, counting: bool | None = None) -> Dispatch:
    """Pairs stably sorted by expert. counting: rank by counting (None: when at most COUNTING_DISPATCH_MAX_PAIRS
    pairs) or by XLA's sort; both give the same permutation."""
    flat = experts.reshape(-1)
    if counting if counting is not None else flat.shape[0] <= COUNTING_DISPATCH_MAX_PAIRS:
        inverse = sorted_positions_by_counting(flat)
        order = inverse_permutation(inverse)
    else:
        order = jnp.argsort(flat, stable=True).astype(jnp.int32)
        inverse = inverse_permutation(order)
    group_sizes = jnp.zeros((num_experts,), jnp.int32).at[flat].add(1, mode="drop")
    return Dispatch(order, group_sizes, order // experts.shape[-1], inverse)


# Row movement as gathers both ways. Why not `x[rows]` / `.at[order].set`: their derivatives are scatters over
# [N*k, H] (JAX's scatter JVP also scatters u32 ids to find the winning update), which on the H200 cost ~1.4 ms a
# layer per 5,120-token micro-batch of an update, and the decode step's combine was a 37 us scatter per layer.
@jax.custom_vjp
def _permute_rows(x, perm, perm_inverse):
    """x[perm] for a permutation `perm` [R] of x's rows; the derivative is the inverse gather."""
    return x[perm]


def _permute_rows_fwd(x, perm, perm_inverse):
    return x[perm], perm_inverse


def _permute_rows_bwd(perm_inverse, g):
    return g[perm_inverse], None, None


_permute_rows.defvjp(_permute_rows_fwd, _permute_rows_bwd)


@jax.custom_vjp
def _rows_of_tokens(x, token_of_row, inverse):
    return x[token_of_row]


def _rows_of_tokens_fwd(x, token_of_row, inverse):
    return x[token_of_row], (inverse, jnp.zeros((x.shape[0], 0), x.dtype))  # (x's rows and dtype, no data)


def _rows_of_tokens_bwd(res, g):
    inverse, like = res
    n, dtype = like.shape[0], like.dtype
    # token t's k rows sit at inverse[t * k + j]: gathered back to (token, slot) order, summed over the slots in
    # slot order in float32 (deterministic; a scatter-add's order on a GPU is not)
    per_slot = g[inverse].reshape(n, -1, g.shape[-1]).astype(F32)
    return jnp.sum(per_slot, axis=1).astype(dtype), None, None


_rows_of_tokens.defvjp(_rows_of_tokens_fwd, _rows_of_tokens_bwd)


def sorted_rows(x: jax.Array, d: Dispatch) -> jax.Array:
    """x [N, H] -> its rows in expert order [N*k, H] (token_of_row), differentiable by gathers."""
    return _rows_of_tokens(x, d.token_of_row, d.inverse)


def combine(rows_sorted: jax.Array, d: Dispatch, weights: jax.Array) -> jax.Array:
    """rows_sorted [N*k, H] (expert order) -> sum_j weights[:, j] * row(token, j), float32 [N, H]."""
    n, k = weights.shape
    unsorted = _permute_rows(rows_sorted, d.inverse, d.order)  # back to (token, slot) order
    # every slot's product rounded (no FMA with the sum), all k in one op: one kernel, not one per slot (a decode
    # step's layer ran 8 product kernels here); then the sum in slot order, the same roundings and order as k
    # separate rounded products added one by one
    products = rounded_product(weights[:, :, None], unsorted.reshape(n, k, -1).astype(F32))
    out = products[:, 0]
    for j in range(1, k):
        out = out + products[:, j]
    return out


def load_balancing_stats(routing: Routing, num_experts: int, token_mask: jax.Array | None = None):
    """Per-layer sums for HF's load-balancing loss: (tokens per expert, router prob per expert, rows)."""
    n = routing.probs.shape[0]
    mask = jnp.ones((n,), F32) if token_mask is None else token_mask.reshape(-1).astype(F32)
    counts = jnp.zeros((num_experts,), F32).at[routing.experts].add(mask[:, None], mode="drop")
    prob_sum = jnp.sum(routing.probs * mask[:, None], axis=0)
    return counts, prob_sum, jnp.sum(mask)


def load_balancing_loss(stats, num_experts: int) -> jax.Array:
    """HF `load_balancing_loss_func`: E * sum_e (mean count_e) * (mean prob_e), means over all MoE layers' rows."""
    if not stats:
        return jnp.zeros((), F32)
    counts = sum(s[0] for s in stats)
    probs = sum(s[1] for s in stats)
    rows = sum(s[2] for s in stats)
    rows = jnp.maximum(rows, 1.0)
    return jnp.sum((counts / rows) * (probs / rows)) * num_experts
