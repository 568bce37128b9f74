"""Continuous batching for the embedded engine, host side: which row runs in which decode slot, which KV pages
it holds, when the device stops for a refill. The device programs are `rollout.programs` (SlotState, ...).

One `generate` call = one `ContinuousScheduler.run()`:

- shapes are fixed for the call: S slots (`max_batch`), page tables W pages wide (the longest row), a pool of P
  pages (`kv_pages`; at most what the rows would need unshared), response buffers of N tokens; so each device
  program compiles once per call shape, never per refill;
- waiting rows are queued by prompt (a GRPO group's samples, and identical prompts of different requests, side
  by side), longest group first (long rows start early, so the tail is short);
- the device decodes in `programs.decode_slots` until `refill_batch` slots finished while rows wait (as many as
  wait, if fewer), or `refill_every` steps, or every slot is done; the host then reads which slots finished (two
  [S] arrays), gathers their buffers (`take_rows`), releases their pages, and admits waiting rows into the free
  slots;
- admission: the first row of a prompt not in the pool is its leader: it allocates every page its prompt +
  max_new_tokens need and its prompt is prefilled (`prefill_prompts`, bucketed rows x prompt length, at most
  `max_prefill_tokens` per call) into the pool through the leader's page table; the prompt's last-position
  logits are kept (`SlotState.prompt_logits`). Every other row of the prompt (now or while any holder lives)
  shares the prompt's full pages (`PagePool.share`: pages 0 .. (P-1)//page - 1, every slot of which holds
  a prompt token) and allocates the rest: its first own page receives a copy of a holder's page holding the
  prompt's last tokens (copy-on-write; slots past the prompt in the copy hold the holder's finite values,
  which the row overwrites before it ever reads them, and masks until then). `place_rows` does the copies, draws
  response token 0 from the prompt's logits with the row's own seed and sets the slots in place.
- rows wait when no slot or not enough free pages remain; a finished row releases its own pages and its
  reference to the shared ones (freed with the prompt's last holder). Every row fits the pool alone (checked
  when the request is validated), so an idle device always admits the next row.

Bits: a row's prefill, its decode steps and its draws compute from its own inputs only (the model and
`sampling` are row invariant; shared pages hold the very bits its own prefill would have written), so its
tokens and log-probs equal those of the static scheduler, of the row alone, and of the row without sharing.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Any

import jax
import numpy as np

from jaxrl_fp8.model.cache import PagePool, pages_for
from jaxrl_fp8.precision.kv import kv_cache_of
from jaxrl_fp8.rollout import programs
from jaxrl_fp8.rollout.sampling import plain_sampling
from jaxrl_fp8.rollout.types import Sample

__all__ = ["ContinuousScheduler"]


def _bucket(n: int, minimum: int, cap: int | None = None) -> int:
    b = max(minimum, 1 << max(0, (n - 1).bit_length()))
    return b if cap is None else min(b, cap)


@dataclasses.dataclass
class _Prompt:
    """A prompt whose KV is in the pool."""

    entry: int  # its row of SlotState.prompt_logits
    shared: list[int]  # its full pages, one reference per holder
    holders: dict[int, list[int]]  # row -> that row's own pages (the first: its copy of the prompt's last page)
    routed: np.ndarray | None = None  # routed experts of the prompt positions [P, layers, k] (when returned)


class ContinuousScheduler:
    """Runs `rows` (the engine's `_Row`s) to completion on one weight version; `run()` returns their Samples in
    row order and fills `stats`."""

    def __init__(self, engine, weights, rows: list, stops: list[tuple[int, ...]], want_routed: bool):
        ec = engine.config
        self.engine, self.weights, self.rows, self.stops, self.want_routed = engine, weights, rows, stops, want_routed
        self.ps = ps = engine._page_size
        self.sharing = ec.prefix_sharing
        plens = [len(r.prompt) for r in rows]
        tokens = [p + r.params.max_new_tokens for p, r in zip(plens, rows)]
        self.need = [pages_for(t, ps) for t in tokens]
        self.stats: dict[str, float] = {}
        if not rows:
            return
        if ec.static_shapes:  # one shape per engine: every call reuses the same programs
            self.slots, self.prompt_bucket, self.max_new = ec.max_batch, ec.max_seq_len, ec.max_seq_len
            width_tokens, self.num_pages = ec.max_seq_len, engine._kv_pages
        else:
            self.slots = _bucket(len(rows), 1, ec.max_batch)
            self.prompt_bucket = _bucket(max(plens), ec.min_prompt_bucket)
            self.max_new = _bucket(max(max(r.params.max_new_tokens for r in rows), 1), ec.min_new_bucket)
            width_tokens = _bucket(max(tokens), ec.min_cache_bucket)
            self.num_pages = min(_bucket(sum(self.need), 1), engine._kv_pages)
        # (the flash kernel reads the pages of every prefill position, padding included)
        self.width = max(pages_for(width_tokens, ps), pages_for(self.prompt_bucket, ps))
        self.stop_width = _bucket(max(1, max(len(s) for s in stops)), 1)  # (a power of two: fewer programs)
        vocab = engine.model_config.vocab_size
        self.plain = all(plain_sampling(r.params.temperature, r.params.top_k, r.params.top_p, vocab) for r in rows)
        self.key = [r.prompt if self.sharing else i for i, r in enumerate(rows)]
        groups: dict[Any, list[int]] = {}
        for i, k in enumerate(self.key):
            groups.setdefault(k, []).append(i)
        order = sorted(groups.values(), key=lambda g: (-max(tokens[i] for i in g), g[0]))
        self.waiting = collections.deque(i for g in order for i in g)
        self.pool = PagePool(self.num_pages)
        self.prompts: dict[Any, _Prompt] = {}
        self.free_entries = list(range(self.slots - 1, -1, -1))  # live prompts <= occupied slots <= S
        self.slot_row: list[int | None] = [None] * self.slots
        self.free_slots = list(range(self.slots - 1, -1, -1))
        self.results: list[Sample | None] = [None] * len(rows)

    # ------------------------------------------------------------------------------------------ run
    def run(self) -> list[Sample]:
        if not self.rows:
            return []
        ec, eng, w = self.engine.config, self.engine, self.weights
        st = collections.Counter()
        self.s = programs.init_slots(eng.model_config, slots=self.slots, table_width=self.width, num_pages=self.num_pages,
                                     page_size=self.ps, max_new=self.max_new, stop_width=self.stop_width,
                                     prompts=self.slots, dtype=w.dtype, kv_cache=kv_cache_of(eng.precision))
        bar = None
        if ec.progress:
            from tqdm import tqdm

            bar = tqdm(total=len(self.rows), unit="row", desc="rollout", dynamic_ncols=True)
        t0 = time.perf_counter()
        produced = 0
        try:
            while True:
                # where a pass's time outside the decode loops goes: waiting here for the prefills and placements
                # dispatched since the last look (device), collecting finished rows (one read of their tokens), and
                # the host's admission work (building and dispatching prefills and placements)
                t_sync = time.perf_counter()
                done, count = jax.device_get((self.s.done, self.s.count))  # both copies started, then one wait
                t_collect = time.perf_counter()
                st["sync_seconds"] += t_collect - t_sync
                finished = self._collect(done, count)
                st["collect_seconds"] += time.perf_counter() - t_collect
                produced += sum(self.results[r].response_ids.size for r in finished)
                if bar is not None and finished:
                    bar.update(len(finished))
                    busy = sum(r is not None for r in self.slot_row)
                    bar.set_postfix(tok_s=f"{produced / max(time.perf_counter() - t0, 1e-9):.0f}", active=busy, refresh=False)
                t_admit = time.perf_counter()
                admitted = self._admit(st)
                st["admit_seconds"] += time.perf_counter() - t_admit
                if admitted:
                    continue  # rows placed may be done already (0 or 1 token): look before decoding
                if all(r is None for r in self.slot_row):
                    if self.waiting:  # cannot happen: an empty pool holds any valid row
                        raise RuntimeError(f"continuous scheduler: {len(self.waiting)} rows wait on an idle engine")
                    break
                t_decode = time.perf_counter()
                self.s, steps, busy = programs.decode_slots(
                    w.graphdef, w.state, self.s, ec.refill_every, min(ec.effective_refill_batch, len(self.waiting)),
                    precision=eng.precision, plain=self.plain)
                st["decode_calls"] += 1
                st["decode_steps"] += int(steps)  # waits for the loop: prefills and placements before it were awaited
                st["active_slot_steps"] += int(busy)
                st["decode_seconds"] += time.perf_counter() - t_decode
        finally:
            if bar is not None:
                bar.close()
        st["slots"], st["pool_pages"], st["page_size"] = self.slots, self.num_pages, self.ps
        self.stats = {k: float(v) for k, v in st.items()}
        if st["decode_steps"]:
            self.stats["mean_active_slots"] = st["active_slot_steps"] / st["decode_steps"]
        # page accounting: every row ran once and gave back every page it held (shared ones with their last holder)
        if any(r is None for r in self.results) or self.prompts or self.pool.free_pages != self.num_pages:
            raise RuntimeError(f"continuous scheduler: {sum(r is None for r in self.results)} rows unserved, "
                               f"{len(self.prompts)} prompts and {self.num_pages - self.pool.free_pages} pages still held")
        return self.results

    # -------------------------------------------------------------------------------------- collect
    def _collect(self, done: np.ndarray, count: np.ndarray) -> list[int]:
        """Finished occupied slots -> Samples; their pages and slots become free. Returns the rows finished."""
        fin = [slot for slot, r in enumerate(self.slot_row) if r is not None and done[slot]]
        if not fin:
            return []
        n = self.slots if self.engine.config.static_shapes else _bucket(len(fin), min(8, self.slots), self.slots)
        idx = np.zeros((n,), np.int32)
        idx[: len(fin)] = fin
        # one device_get: the copies of all three start before the first is waited for (not one round trip each)
        tokens, logprobs, routed = jax.device_get(programs.take_rows(self.s, idx, with_routed=self.want_routed))
        rows_done = []
        for j, slot in enumerate(fin):
            r = self.slot_row[slot]
            row, t, stops = self.rows[r], int(count[slot]), self.stops[r]
            resp = tokens[j, :t]
            prompt = self.prompts[self.key[r]]
            experts = None
            if self.want_routed:
                plen = len(row.prompt)
                experts = np.concatenate([prompt.routed, routed[j, : max(t - 1, 0)]], axis=0)[: plen + t - 1]
            self.results[r] = Sample(
                prompt_ids=np.asarray(row.prompt, np.int32), response_ids=resp, rollout_logprobs=logprobs[j, :t],
                finish_reason="stop" if t > 0 and int(resp[-1]) in stops else "length",
                weight_version=self.weights.version, routed_experts=experts,
                prompt_index=row.prompt_index, sample_index=row.sample_index, seed=row.seed,
            )
            own = prompt.holders.pop(r)
            self.pool.release(prompt.shared + own)
            if not prompt.holders:  # the prompt's last holder: its shared pages are free now
                del self.prompts[self.key[r]]
                self.free_entries.append(prompt.entry)
            self.slot_row[slot] = None
            self.free_slots.append(slot)
            rows_done.append(r)
        return rows_done

    # ---------------------------------------------------------------------------------------- admit
    def _admit(self, st: collections.Counter) -> int:
        """Waiting rows into free slots while slots and pages last (a prefill + place call per batch)."""
        total = 0
        while self.waiting and self.free_slots:
            n = self._admit_batch(st)
            if not n:
                break
            total += n
        return total

    def _admit_batch(self, st: collections.Counter) -> int:
        ec, ps = self.engine.config, self.ps
        leaders: list[tuple[int, _Prompt, list[int]]] = []
        fresh: set[int] = set()  # entries of the prompts prefilled in this batch
        placed: list[tuple[int, _Prompt, tuple[int, int] | None]] = []
        prompt_bucket = 0
        while self.waiting and len(placed) < len(self.free_slots):
            r = self.waiting[0]
            plen = len(self.rows[r].prompt)
            prompt = self.prompts.get(self.key[r])
            copy = None
            if prompt is None:  # a leader: its prompt is prefilled in this batch
                pb = self.prompt_bucket if ec.static_shapes else max(prompt_bucket, _bucket(plen, ec.min_prompt_bucket))
                u = self.slots if ec.static_shapes else _bucket(len(leaders) + 1, 1, self.slots)
                if leaders and not ec.static_shapes and u * pb > ec.max_prefill_tokens:
                    break
                if not self.pool.can_allocate(self.need[r]):
                    break
                pages = self.pool.allocate(self.need[r])
                shared = (plen - 1) // ps if self.sharing else 0
                prompt = _Prompt(self.free_entries.pop(), pages[:shared], {})
                self.prompts[self.key[r]] = prompt
                own = pages[shared:]
                leaders.append((r, prompt, pages))
                fresh.add(prompt.entry)
                prompt_bucket = pb
            else:  # shares the prompt's full pages, copies its last page
                if not self.pool.can_allocate(self.need[r] - len(prompt.shared)):
                    break
                own = self.pool.allocate(self.need[r] - len(prompt.shared))
                self.pool.share(prompt.shared)
                copy = (next(iter(prompt.holders.values()))[0], own[0])
                st["shared_pages"] += len(prompt.shared)
                st["page_copies"] += 1
                st["late_shares"] += prompt.entry not in fresh  # its holders have been decoding
            prompt.holders[r] = own
            placed.append((r, prompt, copy))
            self.waiting.popleft()
        if not placed:
            return 0
        st["pages_in_use_max"] = max(st["pages_in_use_max"], self.num_pages - self.pool.free_pages)
        if leaders:
            self._prefill(leaders, prompt_bucket, st)
        self._place(placed, st)
        return len(placed)

    def _prefill(self, leaders, prompt_bucket: int, st: collections.Counter) -> None:
        eng, w = self.engine, self.weights
        u = self.slots if eng.config.static_shapes else _bucket(len(leaders), 1, self.slots)
        ids = np.zeros((u, prompt_bucket), np.int32)
        lens = np.ones((u,), np.int32)
        table = np.full((u, self.width), -1, np.int32)
        entries = np.full((u,), self.slots, np.int32)  # padding rows: out of range, nothing written
        for i, (r, prompt, pages) in enumerate(leaders):
            p = self.rows[r].prompt
            ids[i, : len(p)] = p
            lens[i] = len(p)
            table[i, : len(pages)] = pages
            entries[i] = prompt.entry
        self.s, routed = programs.prefill_prompts(w.graphdef, w.state, self.s, ids, lens, table, entries,
                                                  precision=eng.precision)
        if self.want_routed:
            routed = np.asarray(routed)
            for i, (r, prompt, _) in enumerate(leaders):
                prompt.routed = routed[i, : len(self.rows[r].prompt)]
        st["prefill_calls"] += 1
        st["prefill_tokens"] += int(lens[: len(leaders)].sum())
        st["prefill_padded_tokens"] += ids.size

    def _place(self, placed, st: collections.Counter) -> None:
        # (a floor of 8 rows: few programs; padding rows draw nothing anyone reads)
        a = self.slots if self.engine.config.static_shapes else _bucket(len(placed), min(8, self.slots), self.slots)
        m = self.stop_width
        slots = np.full((a,), self.slots, np.int32)  # padding: out of range, dropped
        entries = np.zeros((a,), np.int32)
        table = np.full((a, self.width), -1, np.int32)
        lens = np.zeros((a,), np.int32)
        temp, top_k, top_p = np.zeros((a,), np.float32), np.full((a,), -1, np.int32), np.ones((a,), np.float32)
        seeds, mnew, stop_ids = np.zeros((a,), np.uint32), np.zeros((a,), np.int32), np.full((a, m), -1, np.int32)
        src, dst = np.zeros((a,), np.int32), np.full((a,), self.num_pages, np.int32)
        for j, (r, prompt, copy) in enumerate(placed):
            row = self.rows[r]
            slot = self.free_slots.pop()
            self.slot_row[slot] = r
            slots[j], entries[j], lens[j] = slot, prompt.entry, len(row.prompt)
            pages = prompt.shared + prompt.holders[r]
            table[j, : len(pages)] = pages
            temp[j], top_k[j], top_p[j] = row.params.temperature, row.params.top_k, row.params.top_p
            seeds[j], mnew[j] = row.seed, row.params.max_new_tokens
            stop_ids[j, : len(self.stops[r])] = self.stops[r]
            if copy is not None:
                src[j], dst[j] = copy
        rows = programs._Rows(temp, top_k, top_p, seeds, mnew, stop_ids)
        self.s = programs.place_rows(self.s, slots, entries, table, lens, rows, src, dst, plain=self.plain)
        st["place_calls"] += 1
