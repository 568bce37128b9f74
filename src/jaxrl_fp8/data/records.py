"""The unit every prompt source produces: one prompt with its reference answer."""

from __future__ import annotations

import dataclasses
from typing import Any

Message = dict[str, str]  # {"role": ..., "content": ...}


class DatasetError(ValueError):
    """A malformed dataset row or file; the message starts with `file:line` (line = row number, 1-based)."""


@dataclasses.dataclass(frozen=True)
class PromptRecord:
    """One prompt. `prompt` is raw text or chat messages; `source` is `file:line` (or `task:index`).

    `uid` is the record's index in its full dataset (before sharding/shuffling): stable across processes and
    restarts, so rollout groups and logs can name the prompt they came from.
    """

    uid: int
    prompt: str | tuple[Message, ...]
    answer: str
    source: str
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict, compare=False)

    @property
    def is_chat(self) -> bool:
        return not isinstance(self.prompt, str)
