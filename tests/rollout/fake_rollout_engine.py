"""A deterministic numpy stand-in for a rollout engine — a TEST DOUBLE, not a model.

next-token logits = table[last token] + 0.5 * table[(7 * len(prefix) + prefix[0]) % V]; log-probs
come from that distribution (temperature-scaled, top-k / top-p masked); routed experts of position i
are a function of (token, position, layer, table). A checkpoint is an .npz holding `logit_table`, so
a weight update really changes outputs. Sampling follows the `RolloutEngine` seed contract
(`sample_seed(seed, j)`), so every sample is reproducible from (table, prompt, params, j).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from jaxrl_fp8.rollout.types import ModelInfo, Sample, SamplingParams, per_prompt_sampling, sample_seed


def make_table(seed: int, vocab_size: int = 64) -> np.ndarray:
    return np.random.default_rng(seed).normal(0.0, 2.0, size=(vocab_size, vocab_size))


def write_checkpoint(path: str, table: np.ndarray) -> str:
    """Atomic write (temp file, then rename) of a fake checkpoint; returns `path`."""
    tmp = f"{path}.tmp{os.getpid()}.npz"
    np.savez(tmp, logit_table=table)
    os.replace(tmp, path)
    return path


class FakeEngine:
    def __init__(
        self,
        *,
        table: np.ndarray | None = None,
        weight_version: str = "v0",
        num_layers: int = 3,
        num_experts: int = 8,
        top_k: int = 2,
        eos_id: int = 1,
        max_total_tokens: int = 256,
        step_delay_s: float = 0.0,
        fail_paths: Sequence[str] = (),
        supports_routed_experts: bool = True,
        model_path: str = "fake://initial",
    ):
        self.table = make_table(0) if table is None else np.asarray(table, dtype=np.float64)
        self.vocab_size = self.table.shape[0]
        self._version = weight_version
        self.num_layers, self.num_experts, self.top_k = num_layers, num_experts, top_k
        self.eos_id = eos_id
        self.max_total_tokens = max_total_tokens
        self.step_delay_s = step_delay_s
        self.fail_paths = tuple(fail_paths)
        self.supports_routed_experts = supports_routed_experts
        self.model_path = model_path
        self.batch_sizes: list[int] = []  # prompts per generate call, to observe batching
        self.paused = False
        self.cache_flushes = 0
        self._rng = np.random.default_rng()
        self._lock = threading.Lock()

    # -- the model --------------------------------------------------------------------------------

    def logits(self, prefix: Sequence[int]) -> np.ndarray:
        v = self.vocab_size
        return self.table[prefix[-1]] + 0.5 * self.table[(7 * len(prefix) + prefix[0]) % v]

    def routing(self, tokens: Sequence[int]) -> np.ndarray:
        """[len(tokens), layers, k] expert ids; distinct within a row."""
        out = np.empty((len(tokens), self.num_layers, self.top_k), dtype=np.int32)
        for i, tok in enumerate(tokens):
            for layer in range(self.num_layers):
                base = int(abs(self.table[tok, layer]) * 1000) + 7 * i
                out[i, layer] = [(base + 3 * m) % self.num_experts for m in range(self.top_k)]
        return out

    def _one(self, prompt: Sequence[int], sp: SamplingParams, j: int, routed: bool) -> Sample:
        seed = None if sp.seed is None else sample_seed(sp.seed, j)
        rng = self._rng if seed is None else np.random.default_rng(seed)
        seq, out, lps, finish = list(prompt), [], [], "length"
        for _ in range(sp.max_new_tokens):
            logits = self.logits(seq)
            if sp.greedy:
                logp = logits - np.logaddexp.reduce(logits)
                tok = int(np.argmax(logits))
            else:
                z = logits / sp.temperature
                if sp.top_k != -1 and sp.top_k < z.size:
                    kth = np.sort(z)[-sp.top_k]
                    z = np.where(z >= kth, z, -np.inf)
                if sp.top_p < 1.0:
                    order = np.argsort(-z)
                    p = np.exp(z[order] - np.max(z))
                    p /= p.sum()
                    keep = np.cumsum(p) - p < sp.top_p
                    mask = np.full(z.shape, -np.inf)
                    mask[order[keep]] = 0.0
                    z = z + mask
                logp = z - np.logaddexp.reduce(z)
                tok = int(rng.choice(z.size, p=np.exp(logp)))
            out.append(tok)
            lps.append(float(logp[tok]))
            seq.append(tok)
            if tok in sp.stop_token_ids or (tok == self.eos_id and not sp.ignore_eos):
                finish = "stop"
                break
        return Sample(
            prompt_ids=np.asarray(prompt, np.int32),
            response_ids=np.asarray(out, np.int32),
            rollout_logprobs=np.asarray(lps, np.float32),
            finish_reason=finish,
            weight_version=self._version,
            routed_experts=self.routing(seq[:-1]) if routed and self.supports_routed_experts else None,
            sample_index=j,
            seed=seed,
        )

    # -- RolloutEngine ----------------------------------------------------------------------------

    def generate(self, prompts, sampling, *, return_routed_experts: bool = False) -> list[Sample]:
        params = per_prompt_sampling(sampling, len(prompts))
        with self._lock:
            self.batch_sizes.append(len(prompts))
            samples = []
            for i, (prompt, sp) in enumerate(zip(prompts, params)):
                for j in range(sp.n):
                    s = self._one(prompt, sp, j, return_routed_experts)
                    s.prompt_index = i
                    samples.append(s)
            longest = max((s.response_ids.size for s in samples), default=0)
        if self.step_delay_s:
            time.sleep(self.step_delay_s * longest)  # one batched decode step per generated position
        return samples

    def update_weights_from_disk(self, path: str, weight_version: str) -> None:
        if any(f in path for f in self.fail_paths):
            raise OSError(f"simulated failure to read {path}")
        with np.load(path) as ckpt:
            table = np.asarray(ckpt["logit_table"], dtype=np.float64)
        if table.shape != self.table.shape:
            raise ValueError(f"logit_table in {path} has shape {table.shape}, expected {self.table.shape}")
        with self._lock:
            self.table, self._version, self.model_path = table, weight_version, path

    def update_weights(self, named_arrays: Iterable[tuple[str, Any]], weight_version: str) -> None:
        arrays = dict(named_arrays)
        with self._lock:
            self.table = np.asarray(arrays["logit_table"], dtype=np.float64)
            self._version = weight_version

    @property
    def weight_version(self) -> str:
        return self._version

    def set_weight_version(self, weight_version: str) -> None:
        self._version = weight_version

    def health(self) -> bool:
        return True

    def model_info(self) -> ModelInfo:
        return ModelInfo(self.model_path, self._version, self.vocab_size, self.num_layers, self.top_k,
                         self.max_total_tokens, self.supports_routed_experts)

    def flush_cache(self) -> None:
        self.cache_flushes += 1

    def pause(self) -> None:
        self.paused = True

    def resume(self) -> None:
        self.paused = False


def wait_for(predicate, what: str = "condition", timeout_s: float = 20.0) -> None:
    """Poll `predicate` until it holds; fail the test naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)
