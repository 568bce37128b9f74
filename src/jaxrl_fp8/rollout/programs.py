"""The embedded engine's jitted programs (device side; the host-side scheduling lives in `embedded` and
`scheduler`).

Static chunks (`EngineConfig.scheduler="static"`, and the collocated placement): `_generate_while` prefills a
chunk and decodes it in a `lax.while_loop` until its last row stops; `_prefill_jit` + `_decode_jit` are the
same two halves driven from Python (decode_loop="python").

Continuous batching (`scheduler="continuous"`): a fixed set of decode slots over one paged pool that lives
for a whole `generate` call (`SlotState`). `decode_slots` runs many decode steps in a `lax.while_loop`;
`prefill_prompts` writes new prompts into the pool and keeps their last-position logits; `place_rows` copies
the prompts' last pages (copy-on-write of a shared prefix), draws response token 0 and installs rows into
free slots; `take_rows` reads finished slots back. Shapes are fixed per call, so nothing recompiles between
refills. Every function computes a row from its own inputs only (the model and `sampling` are row
invariant), so a sample's bits do not depend on its slot, its neighbours or when it was admitted.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from jaxrl_fp8.model import fused
from jaxrl_fp8.model.cache import KVCache, PagedKVCache, init_cache, init_paged_cache
from jaxrl_fp8.ops.backends import prepare_fp8_weight
from jaxrl_fp8.precision import QuantizedWeight, formats as F
from jaxrl_fp8.precision.kv import kv_cache_of
from jaxrl_fp8.rollout import sampling

# ---------------------------------------------------------------------------------------------------------
# Static chunks


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _Rows:
    """Per-row sampling parameters of one chunk (all [B])."""

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    seeds: jax.Array
    max_new: jax.Array
    stop_ids: jax.Array  # [B, M], -1 padded


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _Carry:
    t: jax.Array  # the response index drawn next
    cache: KVCache | PagedKVCache
    tokens: jax.Array  # int32 [B, N]
    logprobs: jax.Array  # f32 [B, N]
    routed: jax.Array  # int32 [B, N, layers, k]: routing of response token t (fed at step t + 1)
    done: jax.Array  # bool [B]
    count: jax.Array  # int32 [B] response tokens produced


def _draw(logits, rows: _Rows, t, done, count, tokens, logprobs):
    """Sample response token t for every row from its logits [B, V]; update buffers and stop state."""
    steps = jnp.full(done.shape, t, jnp.int32)
    tok, lp = sampling.sample_with_logprobs(logits, rows.temperature, rows.top_k, rows.top_p, rows.seeds, steps)
    active = ~done
    tokens = tokens.at[:, t].set(jnp.where(active, tok, 0))
    logprobs = logprobs.at[:, t].set(jnp.where(active, lp, 0.0))
    count = count + active.astype(jnp.int32)
    stop = jnp.any(tok[:, None] == rows.stop_ids, axis=-1)
    done = done | (active & (stop | (count >= rows.max_new)))
    return done, count, tokens, logprobs


def _on_mesh(placement, state, *row_arrays):
    """Collocated placement: weights in the compute layout, row arrays split over the batch axes (jit only)."""
    if placement is None:
        return state, row_arrays
    return placement.constrain_weights(state), tuple(jax.tree.map(placement.constrain_rows, a) for a in row_arrays)


def loop_operands(state, rows: int | None = None, fuse: bool | None = None):
    """`state` with its fp8-block rollout weights as `ops.operands.PreparedWeight`s (operands only), made once before
    a decode loop. On the Mosaic backend each carries its scales in the GEMM kernel's layout, which every kernel call
    would otherwise lay out again in every step: XLA does not hoist that broadcast out of the loop (7 XLA kernels a
    layer a decode step). The same e4m3 data and scales, so the same bits.

    rows: the loop's batch (one token a row), whose GEMM tiling the scales are laid out for.
    fuse: stack the projections that share an input into one product (`model.fused`; None: where the GEMM kernels
    run, which keep each column's bits)."""

    def prepared(v):
        return prepare_fp8_weight(v, rows=rows) if isinstance(v, QuantizedWeight) and v.fmt == F.FP8_BLOCK else v

    if fused.enabled_here() if fuse is None else fuse:
        state = fused.fuse_shared_inputs(state)
    return jax.tree.map(prepared, state, is_leaf=lambda v: isinstance(v, QuantizedWeight))


def _moe_impl(placement):
    return None if placement is None else placement.moe_impl


@dataclasses.dataclass(frozen=True)
class _Pages:
    """Static shape of a chunk's paged cache: pool pages and slots per page (the page table is an argument)."""

    num_pages: int
    page_size: int


def _prefill(graphdef, state, precision, prompt_ids, prompt_lens, rows: _Rows, cache_len, max_new, dtype, placement=None,
             pages: _Pages | None = None, page_table=None):
    """Right-padded prompts [B, P] into a fresh cache, then draw response token 0.

    Returns (carry for the decode loop, routed experts of the prompt positions [B, P, layers, k]).
    placement: None (the arrays' own devices) or a `sharding.CollocatedPlacement` (the training mesh; a dense
    cache of `cache_len` slots, split over the rows' devices). pages / page_table: a paged cache instead.
    """
    state, (prompt_ids, prompt_lens, rows) = _on_mesh(placement, state, prompt_ids, prompt_lens, rows)
    model = nnx.merge(graphdef, state)
    b = prompt_ids.shape[0]
    cfg = model.cfg
    if pages is not None:
        cache = init_paged_cache(cfg, page_table, pages.num_pages, pages.page_size, dtype, kv_cache_of(precision))
    else:
        cache = init_cache(cfg, b, cache_len, dtype)
        if placement is not None:
            cache = placement.constrain_cache(cache)
    out = model(prompt_ids, cache=cache, policy=precision, moe_impl=_moe_impl(placement), logits_at=prompt_lens - 1)
    cache = out.cache.with_lengths(prompt_lens)
    last = out.logits[:, 0]
    k = out.routed_experts.shape[-1]
    tokens = jnp.zeros((b, max_new), jnp.int32)
    logprobs = jnp.zeros((b, max_new), jnp.float32)
    routed = jnp.zeros((b, max_new, cfg.num_hidden_layers, k), jnp.int32)
    done = rows.max_new <= 0
    done, count, tokens, logprobs = _draw(last, rows, 0, done, jnp.zeros((b,), jnp.int32), tokens, logprobs)
    carry = _Carry(jnp.int32(1), cache, tokens, logprobs, routed, done, count)
    return carry, out.routed_experts


def _decode_step(model, precision, rows: _Rows, c: _Carry, placement=None) -> _Carry:
    """Feed response token t-1 of every row, draw token t."""
    feed = c.tokens[:, c.t - 1]
    out = model(feed[:, None], cache=c.cache, policy=precision, moe_impl=_moe_impl(placement))
    routed = c.routed.at[:, c.t - 1].set(out.routed_experts[:, 0])
    done, count, tokens, logprobs = _draw(out.logits[:, 0], rows, c.t, c.done, c.count, c.tokens, c.logprobs)
    cache = out.cache if placement is None else placement.constrain_cache(out.cache)
    return _Carry(c.t + 1, cache, tokens, logprobs, routed, done, count)


def _running(c: _Carry) -> jax.Array:
    return (c.t < c.tokens.shape[1]) & ~jnp.all(c.done)


@functools.partial(jax.jit, static_argnames=("graphdef", "precision", "cache_len", "max_new", "dtype", "placement", "pages"))
def _generate_while(graphdef, state, prompt_ids, prompt_lens, rows, page_table=None, *, precision, cache_len, max_new, dtype,
                    placement=None, pages=None):
    state, (rows,) = _on_mesh(placement, state, rows)  # gathered once per call, used by prefill and every step
    carry, prompt_routed = _prefill(graphdef, state, precision, prompt_ids, prompt_lens, rows, cache_len, max_new, dtype,
                                    placement, pages, page_table)
    model = nnx.merge(graphdef, state if placement is not None else loop_operands(state, prompt_ids.shape[0]))
    carry = lax.while_loop(_running, lambda c: _decode_step(model, precision, rows, c, placement), carry)
    return carry, prompt_routed


_prefill_jit = jax.jit(_prefill, static_argnums=(0, 2, 6, 7, 8, 9, 10))


@functools.partial(jax.jit, static_argnames=("graphdef", "precision", "placement"), donate_argnames=("carry",))
def _decode_jit(graphdef, state, rows, carry, *, precision, placement=None):
    state, (rows,) = _on_mesh(placement, state, rows)
    return _decode_step(nnx.merge(graphdef, state), precision, rows, carry, placement)


# ---------------------------------------------------------------------------------------------------------
# Continuous batching: decode slots over one paged pool


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SlotState:
    """Everything the device holds for one `generate` call of the continuous scheduler (shapes fixed per call).

    cache: the pool (k/v [P, page, Hkv, D] per layer), the slots' page tables [S, W] (-1: none) and lengths [S]
    (the cache slot the next token is written to). tokens / logprobs [S, N] and routed [S, N, layers, k] hold
    each slot's response so far (routed[t]: the routing of response token t, recorded when it is fed);
    count [S] the tokens drawn (= the response index drawn next); done [S]: finished or empty; rows: the
    slots' sampling parameters. prompt_logits [Q, V]: the last-position logits of each prompt in the pool
    (indexed by the host's prompt entry), from which a prompt's samples draw response token 0.
    """

    cache: PagedKVCache
    tokens: jax.Array
    logprobs: jax.Array
    routed: jax.Array
    count: jax.Array
    done: jax.Array
    rows: _Rows
    prompt_logits: jax.Array


def init_slots(cfg, *, slots: int, table_width: int, num_pages: int, page_size: int, max_new: int, stop_width: int,
               prompts: int, dtype, kv_cache: str = "bf16") -> SlotState:
    """Empty slots (all done, no pages) over a zeroed pool (`kv_cache` "fp8": FP8 pages, precision.kv)."""
    s, n = int(slots), int(max_new)
    k = max(cfg.num_experts_per_tok, 1)
    cache = init_paged_cache(cfg, jnp.full((s, int(table_width)), -1, jnp.int32), num_pages, page_size, dtype, kv_cache)
    rows = _Rows(jnp.zeros((s,), jnp.float32), jnp.full((s,), -1, jnp.int32), jnp.ones((s,), jnp.float32),
                 jnp.zeros((s,), jnp.uint32), jnp.zeros((s,), jnp.int32), jnp.full((s, int(stop_width)), -1, jnp.int32))
    return SlotState(cache, jnp.zeros((s, n), jnp.int32), jnp.zeros((s, n), jnp.float32),
                     jnp.zeros((s, n, cfg.num_hidden_layers, k), jnp.int32), jnp.zeros((s,), jnp.int32),
                     jnp.ones((s,), bool), rows, jnp.zeros((int(prompts), cfg.vocab_size), jnp.float32))


def _slot_step(model, precision, s: SlotState, plain: bool | None = None) -> SlotState:
    """One decode step of every active slot: feed its last drawn token, draw the next one (index = count).

    Inactive slots (finished or empty) run through the model with no page (their writes are dropped, so a
    finished row never touches a page another row shares) and change nothing."""
    n = s.tokens.shape[1]
    idx = jnp.arange(s.tokens.shape[0])
    active = ~s.done
    feed = s.tokens[idx, jnp.maximum(s.count - 1, 0)]
    c = s.cache
    cache_in = dataclasses.replace(c, page_table=jnp.where(active[:, None], c.page_table, -1),
                                   lengths=jnp.where(active, c.lengths, 0))
    out = model(feed[:, None], cache=cache_in, policy=precision)
    cache = dataclasses.replace(out.cache, page_table=c.page_table, lengths=jnp.where(active, c.lengths + 1, c.lengths))
    routed = s.routed.at[idx, jnp.where(active, s.count - 1, n)].set(out.routed_experts[:, 0], mode="drop")
    logits = out.logits[:, 0]
    r = s.rows
    tok, lp = sampling.sample_with_logprobs(logits, r.temperature, r.top_k, r.top_p, r.seeds, s.count, plain=plain)
    col = jnp.where(active, s.count, n)
    tokens = s.tokens.at[idx, col].set(tok, mode="drop")
    logprobs = s.logprobs.at[idx, col].set(lp, mode="drop")
    count = s.count + active.astype(jnp.int32)
    stop = jnp.any(tok[:, None] == r.stop_ids, axis=-1)
    done = s.done | (active & (stop | (count >= r.max_new)))
    return dataclasses.replace(s, cache=cache, tokens=tokens, logprobs=logprobs, routed=routed, count=count, done=done)


@functools.partial(jax.jit, static_argnames=("graphdef", "precision", "plain"), donate_argnames=("s",))
def decode_slots(graphdef, state, s: SlotState, max_steps, need_finished, *, precision, plain: bool | None = None):
    """Decode on device until every slot is done, `max_steps` steps ran, or (need_finished > 0) that many slots
    finished during this call (rows wait for them). Returns (state, steps run, sum over steps of active slots).
    plain: every row of the call samples at temperature 1 (or greedy) without filters (`sampling.plain_sampling`):
    the step then has no conditional (`sample_with_logprobs(plain=...)`)."""
    model = nnx.merge(graphdef, loop_operands(state, s.tokens.shape[0]))
    done0 = s.done

    def running(c):
        i, _, s = c
        finished = jnp.sum((s.done & ~done0).astype(jnp.int32))
        return (i < max_steps) & ~jnp.all(s.done) & ~((need_finished > 0) & (finished >= need_finished))

    def step(c):
        i, busy, s = c
        return i + 1, busy + jnp.sum((~s.done).astype(jnp.int32)), _slot_step(model, precision, s, plain)

    steps, busy, s = lax.while_loop(running, step, (jnp.int32(0), jnp.int32(0), s))
    return s, steps, busy


@functools.partial(jax.jit, static_argnames=("graphdef", "precision"), donate_argnames=("s",))
def prefill_prompts(graphdef, state, s: SlotState, prompt_ids, prompt_lens, page_table, entries, *, precision):
    """Right-padded prompts [U, Pb] written into the pool through their page-table rows [U, W] (all the pages of
    one of the prompt's samples: the shared prefix and that sample's own pages); their last-position logits go to
    prompt_logits[entries] (padding rows: no pages, entry out of range, nothing written).

    Returns (state, routed experts of the prompt positions [U, Pb, layers, k])."""
    model = nnx.merge(graphdef, state)
    u = prompt_ids.shape[0]
    cache = dataclasses.replace(s.cache, page_table=page_table, lengths=jnp.zeros((u,), jnp.int32))
    out = model(prompt_ids, cache=cache, policy=precision, logits_at=prompt_lens - 1)
    pool = dataclasses.replace(out.cache, page_table=s.cache.page_table, lengths=s.cache.lengths)
    logits = s.prompt_logits.at[entries].set(out.logits[:, 0], mode="drop")
    return dataclasses.replace(s, cache=pool, prompt_logits=logits), out.routed_experts


@functools.partial(jax.jit, static_argnames=("plain",), donate_argnames=("s",))
def place_rows(s: SlotState, slots, entries, page_table, prompt_lens, rows: _Rows, copy_src, copy_dst, *,
               plain: bool | None = None) -> SlotState:
    """Install rows into slots [A] (padding: S, dropped): first copy pool pages copy_src -> copy_dst [C] (a
    sample's own copy of its prompt's last page; padding dst: P, dropped), then draw response token 0 of each
    row from prompt_logits[entries] and set the slots' page tables [A, W], lengths (= prompt lengths), buffers
    and sampling parameters. plain: as `decode_slots`' (the host knows every row's parameters, so the draw needs
    no conditional, whose predicate a GPU reads back on the host)."""
    pool = s.cache.map_pages(lambda x: x.at[copy_dst].set(x[copy_src], mode="drop"))
    a, n = slots.shape[0], s.tokens.shape[1]
    logits = s.prompt_logits[entries]
    done = rows.max_new <= 0
    zeros = jnp.zeros((a,), jnp.int32)
    tok, lp = sampling.sample_with_logprobs(logits, rows.temperature, rows.top_k, rows.top_p, rows.seeds, zeros,
                                            plain=plain)
    active = ~done
    tokens = jnp.zeros((a, n), jnp.int32).at[:, 0].set(jnp.where(active, tok, 0))
    logprobs = jnp.zeros((a, n), jnp.float32).at[:, 0].set(jnp.where(active, lp, 0.0))
    count = active.astype(jnp.int32)
    stop = jnp.any(tok[:, None] == rows.stop_ids, axis=-1)
    done = done | (active & (stop | (count >= rows.max_new)))

    def put(full, new):
        return full.at[slots].set(new.astype(full.dtype), mode="drop")

    cache = dataclasses.replace(pool, page_table=put(pool.page_table, page_table),
                                lengths=put(pool.lengths, prompt_lens))
    return dataclasses.replace(
        s, cache=cache, tokens=put(s.tokens, tokens), logprobs=put(s.logprobs, logprobs),
        routed=put(s.routed, jnp.zeros((a,) + s.routed.shape[1:], jnp.int32)), count=put(s.count, count),
        done=put(s.done, done), rows=jax.tree.map(put, s.rows, rows),
    )


@functools.partial(jax.jit, static_argnames=("with_routed",))
def take_rows(s: SlotState, slots, *, with_routed: bool):
    """(tokens, logprobs, routed or None) of slots [F] (a gather; the host reads only the finished slots)."""
    return s.tokens[slots], s.logprobs[slots], (s.routed[slots] if with_routed else None)
