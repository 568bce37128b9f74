"""The prompt pipeline: records → (shard, shuffle, repeat) → render + tokenize → batches, built on
`grain.MapDataset`, with an iterator whose state can be saved and restored exactly.

Why a MapDataset chain: every element is addressed by index (shard `i::n` of the equal-size prefix,
a seeded per-epoch shuffle, repeat), so the iterator's whole state is one integer (`next_index`) and a resume
produces the same batches as an uninterrupted run, on every process. Reading runs in the caller's thread
(`num_threads=0`): prompts are in memory and tokenization is cheap, so threads would only add GIL contention
and nondeterministic timing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxrl_fp8.data.records import PromptRecord
from jaxrl_fp8.data.tokenizer import TextTokenizer

__all__ = ["LoaderConfig", "PromptBatch", "PromptLoader", "pad_prompts"]

STATE_VERSION = 1


@dataclasses.dataclass(frozen=True)
class LoaderConfig:
    """Batching and sharding. `batch_size` is prompts per batch *per process*; `num_epochs=None` repeats forever."""

    batch_size: int
    seed: int = 0
    shuffle: bool = True
    num_epochs: int | None = None
    drop_remainder: bool = True
    process_index: int = 0
    process_count: int = 1
    use_chat_template: bool | None = None  # None: templates for chat prompts / when the tokenizer has one
    max_prompt_tokens: int | None = None  # longer prompts are dropped (and counted) when the loader is built

    def __post_init__(self):
        if self.batch_size < 1:
            raise ValueError(f"batch_size={self.batch_size} must be >= 1")
        if self.process_count < 1 or not 0 <= self.process_index < self.process_count:
            raise ValueError(f"process_index={self.process_index} must be in [0, process_count={self.process_count})")
        if self.num_epochs is not None and self.num_epochs < 1:
            raise ValueError(f"num_epochs={self.num_epochs} must be >= 1 or None")
        if not 0 <= self.seed < 2**32:
            raise ValueError(f"seed={self.seed} must be in [0, 2**32)")


@dataclasses.dataclass(frozen=True)
class PromptBatch:
    """One batch of prompts. `prompt_ids[i]` is an int32 array; use `pad_prompts` for a rectangular array."""

    uids: np.ndarray  # int64 [B]: record uids (index in the full dataset)
    prompts: list[str]  # rendered prompt text
    prompt_ids: list[np.ndarray]
    answers: list[str]
    sources: list[str]  # file:line or task:index

    def __len__(self) -> int:
        return len(self.prompts)


def pad_prompts(prompt_ids: Sequence[np.ndarray], pad_id: int, *, side: str = "left",
                length: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """`[B, L]` int32 ids and `[B]` lengths; left padding keeps every prompt's end at the same column."""
    if side not in ("left", "right"):
        raise ValueError(f"side={side!r} must be 'left' or 'right'")
    lengths = np.array([len(p) for p in prompt_ids], np.int32)
    width = int(lengths.max(initial=0)) if length is None else length
    if lengths.size and lengths.max() > width:
        raise ValueError(f"a prompt has {lengths.max()} tokens, more than length={width}")
    out = np.full((len(prompt_ids), width), pad_id, np.int32)
    for i, ids in enumerate(prompt_ids):
        if len(ids):
            if side == "left":
                out[i, width - len(ids):] = ids
            else:
                out[i, : len(ids)] = ids
    return out, lengths


def _batch_fn(items: Sequence[tuple[PromptRecord, str, np.ndarray]]) -> PromptBatch:
    return PromptBatch(
        uids=np.array([r.uid for r, _, _ in items], np.int64),
        prompts=[text for _, text, _ in items],
        prompt_ids=[ids for _, _, ids in items],
        answers=[r.answer for r, _, _ in items],
        sources=[r.source for r, _, _ in items],
    )


class PromptLoader:
    """Iterator of `PromptBatch` for this process, with `get_state()` / `set_state()` for exact resume."""

    def __init__(self, records: Sequence[PromptRecord], tokenizer: TextTokenizer, config: LoaderConfig,
                 **template_kwargs: Any):
        import grain

        self.config = config
        self.tokenizer = tokenizer
        records = list(records)
        self.num_dropped_too_long = 0
        if config.max_prompt_tokens is not None:
            kept = []
            for r in records:
                _, ids = tokenizer.encode_prompt(r.prompt, config.use_chat_template, **template_kwargs)
                if len(ids) <= config.max_prompt_tokens:
                    kept.append(r)
            self.num_dropped_too_long = len(records) - len(kept)
            records = kept
        per_shard = len(records) // config.process_count
        if per_shard < 1 or (config.drop_remainder and per_shard < config.batch_size):
            raise ValueError(
                f"{len(records)} prompts give {per_shard} per process ({config.process_count} processes): "
                f"fewer than batch_size={config.batch_size}"
            )
        self.num_records = len(records)
        self.shard_size = per_shard

        def encode(record: PromptRecord) -> tuple[PromptRecord, str, np.ndarray]:
            text, ids = tokenizer.encode_prompt(record.prompt, config.use_chat_template, **template_kwargs)
            return record, text, np.asarray(ids, np.int32)

        ds = grain.MapDataset.source(records)
        # Equal-size shards so every process sees the same number of batches (collectives stay in step).
        ds = ds[: per_shard * config.process_count][config.process_index :: config.process_count]
        if config.shuffle:
            ds = ds.shuffle(seed=config.seed)
        ds = ds.repeat(config.num_epochs)
        ds = ds.map(encode)
        ds = ds.batch(config.batch_size, drop_remainder=config.drop_remainder, batch_fn=_batch_fn)
        self._dataset = ds.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
        self._iterator = iter(self._dataset)
        self._batches_per_epoch = (per_shard // config.batch_size if config.drop_remainder
                                   else -(-per_shard // config.batch_size))

    # iteration ---------------------------------------------------------------------------------------
    def __iter__(self) -> "PromptLoader":
        return self

    def __next__(self) -> PromptBatch:
        return next(self._iterator)

    @property
    def batches_per_epoch(self) -> int:
        return self._batches_per_epoch

    # state -------------------------------------------------------------------------------------------
    def _fingerprint(self) -> dict[str, Any]:
        c = self.config
        return {
            "num_records": self.num_records,
            "batch_size": c.batch_size,
            "seed": c.seed,
            "shuffle": c.shuffle,
            "num_epochs": c.num_epochs,
            "drop_remainder": c.drop_remainder,
            "process_index": c.process_index,
            "process_count": c.process_count,
        }

    def get_state(self) -> dict[str, Any]:
        """A JSON-serializable state: where the iterator is, and what pipeline it belongs to."""
        return {"version": STATE_VERSION, "iterator": dict(self._iterator.get_state()),
                "pipeline": self._fingerprint()}

    def set_state(self, state: dict[str, Any]) -> None:
        """Continue exactly where `get_state()` was taken; refuses a state from a different pipeline."""
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION or "iterator" not in state:
            raise ValueError(f"data iterator state {state!r} is not a PromptLoader state (version {STATE_VERSION})")
        saved = state.get("pipeline", {})
        mine = self._fingerprint()
        diff = {k: (saved.get(k), v) for k, v in mine.items() if saved.get(k) != v}
        if diff:
            detail = ", ".join(f"{k}: saved {a!r} vs now {b!r}" for k, (a, b) in sorted(diff.items()))
            raise ValueError(f"data iterator state belongs to a different pipeline ({detail})")
        self._iterator.set_state(dict(state["iterator"]))
