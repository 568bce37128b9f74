"""Turn rollout samples into the fixed-shape arrays the jitted train step consumes.

Layout: row i = prompt_i ++ response_i, right-padded to `seq_len`. Target j predicts token j+1, so the
response tokens are targets [P-1, P+T-1) of a row and `response_mask` marks exactly those. Routed experts
(R3) cover every position that was fed into the rollout model (prompt + response minus the last token);
other positions get -1 (computed routing; their outputs never score a response token).
Fixed shapes mean one compilation for the whole run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from jaxrl_fp8.rollout.types import Sample

__all__ = ["TrainBatch", "build_batch"]


@dataclasses.dataclass
class TrainBatch:
    tokens: np.ndarray  # int32 [B, L]
    response_mask: np.ndarray  # float32 [B, L-1] over targets
    rollout_logp: np.ndarray  # float32 [B, L-1] (0 outside the mask)
    routed_experts: np.ndarray | None  # int32 [B, L, layers, k] or None
    rewards: np.ndarray  # float32 [B]
    response_lengths: np.ndarray  # int32 [B]
    prompt_lengths: np.ndarray  # int32 [B]
    truncated: np.ndarray  # bool [B]: finish_reason == "length"

    @property
    def num_tokens(self) -> int:
        return int(self.response_mask.sum())


def build_batch(samples: Sequence[Sample], rewards: np.ndarray, seq_len: int, pad_id: int, *, num_layers: int, top_k: int,
                with_routing: bool) -> TrainBatch:
    b = len(samples)
    tokens = np.full((b, seq_len), pad_id, np.int32)
    mask = np.zeros((b, seq_len - 1), np.float32)
    rollout = np.zeros((b, seq_len - 1), np.float32)
    routed = np.full((b, seq_len, num_layers, top_k), -1, np.int32) if with_routing else None
    plen = np.zeros(b, np.int32)
    rlen = np.zeros(b, np.int32)
    for i, s in enumerate(samples):
        p, t = len(s.prompt_ids), len(s.response_ids)
        if p + t > seq_len:
            raise ValueError(f"sample {i}: prompt {p} + response {t} tokens exceed the train sequence length {seq_len}")
        tokens[i, :p] = s.prompt_ids
        tokens[i, p : p + t] = s.response_ids
        mask[i, p - 1 : p - 1 + t] = 1.0
        rollout[i, p - 1 : p - 1 + t] = s.rollout_logprobs
        plen[i], rlen[i] = p, t
        if with_routing:
            if s.routed_experts is None:
                raise ValueError(f"sample {i} has no routed experts but routing replay (R3) is on")
            r = np.asarray(s.routed_experts)
            if r.shape[1:] != (num_layers, top_k):
                raise ValueError(f"sample {i}: routed experts shaped {r.shape[1:]}, the model has ({num_layers}, {top_k})")
            routed[i, : r.shape[0]] = r
    truncated = np.array([s.finish_reason == "length" for s in samples], bool)
    return TrainBatch(tokens, mask, rollout, routed, np.asarray(rewards, np.float32), rlen, plen, truncated)
