"""The rollout contract: sampling parameters, samples, and the `RolloutEngine` protocol.

Every rollout backend — the embedded JAX engine, an SGLang fleet reached over HTTP, a test double —
returns the same `Sample`s, so the trainer never knows which one produced them. This module has no
dependency beyond numpy so that it can be imported by the trainer, the HTTP server and test doubles
without pulling in JAX.

Alignment conventions (the ones SGLang uses, see docs/decisions/0005-rollout-http.md):
- `rollout_logprobs[t]` is log p(response_ids[t] | prompt_ids + response_ids[:t]).
- `routed_experts` covers every token that was *fed into* the model: the prompt and all response
  tokens but the last (the last sampled token is never forwarded). Row `i` is the top-k expert ids of
  the token at absolute position `i`, so the array is `[len(prompt) + len(response) - 1, layers, k]`,
  exactly what SGLang returns with `--enable-return-routed-experts`. R3 replay needs all of it: the
  logits that score response token t depend on the routing of every earlier position, prompt included.
  `Sample.response_routed_experts` gives the `[T, layers, k]` slice aligned with `rollout_logprobs`
  (row t = the position whose output distribution produced response token t).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence
from typing import Any, Literal, Protocol, runtime_checkable

import numpy as np

FinishReason = Literal["stop", "length", "abort"]
FINISH_REASONS: tuple[str, ...] = ("stop", "length", "abort")

# Seeds are kept in the non-negative int32 range: SGLang, JAX PRNG keys and numpy all accept it.
MAX_SEED = 2**31 - 1

_SEED_MIX_MULT = 0x9E3779B97F4A7C15
_MASK64 = (1 << 64) - 1
_PROMPT_MIX_MULT = 0xD6E8FEB86659FD93  # prompt_seed's salt (sample_seed multiplies the seed by 0x100000001B3)


def sample_seed(seed: int, sample_index: int) -> int:
    """Seed of the `sample_index`-th of the n samples drawn for one prompt with base `seed`.

    Sample 0 uses `seed` itself, so a request for one sample with seed `sample_seed(s, j)` reproduces
    sample j of a request for n samples with seed s. That is what lets the fleet split an n-sample
    request into n single-sample requests (on any server) without changing a single token.
    Samples j > 0 use a splitmix64 mix of (seed, j), folded into [0, MAX_SEED].
    """
    _check_seed("seed", seed)
    if not isinstance(sample_index, int) or sample_index < 0:
        raise ValueError(f"sample_index must be a non-negative int, got {sample_index!r}")
    if sample_index == 0:
        return seed
    return _splitmix_seed(seed * 0x100000001B3 + sample_index * _SEED_MIX_MULT)


def prompt_seed(seed: int, prompt_index: int) -> int:
    """Base seed of prompt `prompt_index` of a batch whose run draws with `seed` (its samples then take
    `sample_seed(prompt_seed(seed, i), j)`). One seed for every prompt would give sample j of every prompt the same
    random stream: correlated draws across the batch, and from a near-uniform policy (a random init) the same token
    in every row. A splitmix64 mix of (seed, i) with its own salt, so it does not reproduce `sample_seed`'s values."""
    _check_seed("seed", seed)
    if not isinstance(prompt_index, int) or prompt_index < 0:
        raise ValueError(f"prompt_index must be a non-negative int, got {prompt_index!r}")
    return _splitmix_seed(seed * _PROMPT_MIX_MULT + (prompt_index + 1) * _SEED_MIX_MULT)


def _splitmix_seed(z: int) -> int:
    """splitmix64's finaliser of a 64-bit mix of (seed, index), folded into [0, MAX_SEED]."""
    z &= _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return int(z % (MAX_SEED + 1))


def _check_seed(name: str, seed: Any) -> None:
    if not _is_int(seed) or not 0 <= int(seed) <= MAX_SEED:
        raise ValueError(f"{name} must be an integer in [0, {MAX_SEED}], got {seed!r}")


def token_ids(value: Any, where: str, vocab_size: int | None = None, *, allow_empty: bool = True) -> tuple[int, ...]:
    """`value` (a list of token ids) as a tuple, or a ValueError naming `where` and the bad element.

    Ids must be integers in [0, vocab_size) (>= 0 when vocab_size is None). The one check of token ids, used
    by `SamplingParams` (stop ids) and by the HTTP server (prompts, with the served model's vocabulary).
    """
    if not isinstance(value, (list, tuple, np.ndarray)):
        raise ValueError(f"{where} must be a list of token ids, got {type(value).__name__}")
    if len(value) == 0 and not allow_empty:
        raise ValueError(f"{where} must not be empty")
    for i, t in enumerate(value):
        if not _is_int(t):
            raise ValueError(f"{where}[{i}] must be an integer token id, got {t!r}")
        if t < 0 or (vocab_size is not None and t >= vocab_size):
            bound = "is negative" if vocab_size is None else f"is out of the vocabulary [0, {vocab_size})"
            raise ValueError(f"{where}[{i}] = {t} {bound}")
    return tuple(int(t) for t in value)


# SamplingParams field -> its name in SGLang's `sampling_params` (only the seed differs).
SGLANG_NAMES: dict[str, str] = {
    "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "max_new_tokens": "max_new_tokens",
    "stop_token_ids": "stop_token_ids", "ignore_eos": "ignore_eos", "n": "n", "seed": "sampling_seed",
}


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _check_sampling(values: dict[str, Any], where: str, names: dict[str, str], vocab_size: int | None,
                    max_n: int | None) -> dict[str, Any]:
    """The one validation of sampling parameters: `values` (any subset of the fields) checked and normalised.

    Errors name the field as `{where}.{names[field]}`; `vocab_size` bounds the stop ids and `max_n` bounds n
    (a server's limits; None: no bound beyond the field's own range).
    """
    out = dict(values)

    def bad(field: str, rule: str) -> ValueError:
        return ValueError(f"{where}.{names.get(field, field)} must be {rule}, got {values[field]!r}")

    if "temperature" in values:
        if not _is_number(values["temperature"]) or values["temperature"] < 0:
            raise bad("temperature", "a finite number >= 0")
        out["temperature"] = float(values["temperature"])
    if "top_p" in values:
        if not _is_number(values["top_p"]) or not 0 < values["top_p"] <= 1:
            raise bad("top_p", "a number in (0, 1]")
        out["top_p"] = float(values["top_p"])
    if "top_k" in values and (not _is_int(values["top_k"]) or not (values["top_k"] == -1 or values["top_k"] >= 1)):
        raise bad("top_k", "-1 (all) or an integer >= 1")
    if "max_new_tokens" in values and (not _is_int(values["max_new_tokens"]) or values["max_new_tokens"] < 0):
        raise bad("max_new_tokens", "an integer >= 0")
    if "stop_token_ids" in values:
        out["stop_token_ids"] = token_ids(values["stop_token_ids"], f"{where}.stop_token_ids", vocab_size)
    if "ignore_eos" in values and not isinstance(values["ignore_eos"], bool):
        raise bad("ignore_eos", "a boolean")
    if "n" in values:
        n = values["n"]
        if not _is_int(n) or n < 1 or (max_n is not None and n > max_n):
            raise bad("n", "an integer >= 1" if max_n is None else f"an integer in [1, {max_n}]")
    if values.get("seed") is not None:
        _check_seed(f"{where}.{names.get('seed', 'seed')}", values["seed"])
    return out


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample one prompt. Field names and defaults follow SGLang's `sampling_params`.

    temperature 0 means greedy. top_k -1 means the whole vocabulary. `seed` makes sampling
    reproducible: sample j of the prompt uses `sample_seed(seed, j)`; None leaves it to the engine.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 128
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    n: int = 1
    seed: int | None = None

    def __post_init__(self) -> None:
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for name, value in _check_sampling(fields, "SamplingParams", {}, None, None).items():
            object.__setattr__(self, name, value)

    @classmethod
    def from_sglang(cls, raw: Any, where: str = "sampling_params", *, vocab_size: int | None = None,
                    max_n: int | None = None) -> SamplingParams:
        """The inverse of `to_sglang`: parameters from an SGLang `sampling_params` JSON object (None: defaults).

        Unknown fields are refused; a ValueError names the bad field by its SGLang name under `where`
        (e.g. `sampling_params[1].sampling_seed`). `vocab_size` and `max_n` are the server's limits.
        """
        if raw is None:
            raw = {}
        if not isinstance(raw, dict):
            raise ValueError(f"{where} must be an object, got {type(raw).__name__}")
        supported = sorted(SGLANG_NAMES.values())
        unknown = sorted(set(raw) - set(supported))
        if unknown:
            raise ValueError(f"{where} has unsupported fields {unknown}; supported: {supported}")
        given = {field: raw[wire] for field, wire in SGLANG_NAMES.items() if raw.get(wire) is not None}
        return cls(**_check_sampling(given, where, SGLANG_NAMES, vocab_size, max_n))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def to_sglang(self) -> dict[str, Any]:
        """The `sampling_params` object of an SGLang `/generate` request (SGLang's field names)."""
        out: dict[str, Any] = {
            "temperature": float(self.temperature),
            "top_p": float(self.top_p),
            "top_k": int(self.top_k),
            "max_new_tokens": int(self.max_new_tokens),
            "ignore_eos": bool(self.ignore_eos),
            "n": int(self.n),
        }
        if self.stop_token_ids:
            out["stop_token_ids"] = list(self.stop_token_ids)
        if self.seed is not None:
            out["sampling_seed"] = int(self.seed)
        return out

    def for_sample(self, sample_index: int) -> SamplingParams:
        """Parameters of one sample of this prompt as a standalone n=1 request (same tokens out)."""
        seed = None if self.seed is None else sample_seed(self.seed, sample_index)
        return dataclasses.replace(self, n=1, seed=seed)


def _is_int(x: Any) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def per_prompt_sampling(
    sampling: SamplingParams | Sequence[SamplingParams], num_prompts: int
) -> list[SamplingParams]:
    """Normalise the `sampling` argument of `RolloutEngine.generate` to one `SamplingParams` per prompt."""
    if isinstance(sampling, SamplingParams):
        return [sampling] * num_prompts
    params = list(sampling)
    if len(params) != num_prompts:
        raise ValueError(f"got {len(params)} SamplingParams for {num_prompts} prompts")
    for i, p in enumerate(params):
        if not isinstance(p, SamplingParams):
            raise TypeError(f"sampling[{i}] must be a SamplingParams, got {type(p).__name__}")
    return params


@dataclasses.dataclass
class Sample:
    """One generated response and everything the trainer needs to correct against it."""

    prompt_ids: np.ndarray  # int32 [P]
    response_ids: np.ndarray  # int32 [T]
    rollout_logprobs: np.ndarray  # float32 [T]
    finish_reason: str  # "stop" | "length" | "abort"
    weight_version: str
    request_id: str = ""
    routed_experts: np.ndarray | None = None  # int32 [P + T - 1, layers, k], see module docstring
    prompt_index: int = 0
    sample_index: int = 0
    seed: int | None = None  # the effective seed of this sample (sample_seed(base, sample_index))

    def __post_init__(self) -> None:
        self.prompt_ids = _as_1d(self.prompt_ids, np.int32, "prompt_ids")
        self.response_ids = _as_1d(self.response_ids, np.int32, "response_ids")
        self.rollout_logprobs = _as_1d(self.rollout_logprobs, np.float32, "rollout_logprobs")
        if self.prompt_ids.size == 0:
            raise ValueError("Sample.prompt_ids must not be empty")
        if self.rollout_logprobs.shape != self.response_ids.shape:
            raise ValueError(
                f"Sample.rollout_logprobs has shape {self.rollout_logprobs.shape} but response_ids has "
                f"{self.response_ids.shape}: one log-prob per response token is required"
            )
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"Sample.finish_reason must be one of {FINISH_REASONS}, got {self.finish_reason!r}")
        if not isinstance(self.weight_version, str):
            raise ValueError(f"Sample.weight_version must be a str, got {self.weight_version!r}")
        if self.routed_experts is not None:
            re = np.asarray(self.routed_experts)
            if re.ndim != 3 or not np.issubdtype(re.dtype, np.integer):
                raise ValueError(
                    f"Sample.routed_experts must be an integer array [tokens, layers, k], got dtype "
                    f"{re.dtype} shape {re.shape}"
                )
            if re.shape[0] != self.num_routed_tokens:
                raise ValueError(
                    f"Sample.routed_experts has {re.shape[0]} rows; expected len(prompt) + len(response) - 1 "
                    f"= {self.num_routed_tokens} (one per token fed into the model)"
                )
            self.routed_experts = re.astype(np.int32, copy=False)

    @property
    def num_routed_tokens(self) -> int:
        return int(self.prompt_ids.size + self.response_ids.size - 1)

    @property
    def response_routed_experts(self) -> np.ndarray | None:
        """`[T, layers, k]`: row t is the routing at the position whose logits scored response token t."""
        if self.routed_experts is None:
            return None
        start = self.prompt_ids.size - 1
        return self.routed_experts[start : start + self.response_ids.size]

    @property
    def token_ids(self) -> np.ndarray:
        """Prompt followed by response: the sequence the trainer re-scores."""
        return np.concatenate([self.prompt_ids, self.response_ids])


def _as_1d(x: Any, dtype: Any, name: str) -> np.ndarray:
    arr = np.asarray(x)
    if arr.ndim != 1:
        raise ValueError(f"Sample.{name} must be 1-D, got shape {arr.shape}")
    if arr.size and dtype == np.int32 and not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"Sample.{name} must hold integers, got dtype {arr.dtype}")
    return arr.astype(dtype, copy=False)


@dataclasses.dataclass(frozen=True)
class GenerateRequest:
    """One unit of work sent to one server: one prompt, `sampling.n` samples.

    `index` is the request's slot in the rollout batch (results are keyed by it, which is what makes
    failover exactly-once); `rid` is its stable id (a retry adds an attempt suffix on the wire only).
    """

    index: int
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams
    rid: str
    return_routed_experts: bool = False
    prompt_index: int = 0
    first_sample_index: int = 0  # sample_index of the first sample this request returns

    def to_sglang(self, *, rid: str | None = None) -> dict[str, Any]:
        """The JSON body of SGLang's `POST /generate` for this request."""
        body: dict[str, Any] = {
            "input_ids": list(self.prompt_ids),
            "sampling_params": self.sampling.to_sglang(),
            "return_logprob": True,
            "logprob_start_len": -1,
            "rid": self.rid if rid is None else rid,
            "stream": False,
        }
        if self.return_routed_experts:
            body["return_routed_experts"] = True
        return body


@dataclasses.dataclass(frozen=True)
class ModelInfo:
    """What a client or the HTTP server needs to know about the served model."""

    model_path: str
    weight_version: str
    vocab_size: int
    num_hidden_layers: int  # rows of the layer axis of routed_experts
    num_experts_per_tok: int  # top-k, the last axis of routed_experts
    max_total_tokens: int  # longest prompt + max_new_tokens the engine accepts
    supports_routed_experts: bool = True

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@runtime_checkable
class RolloutEngine(Protocol):
    """What the trainer needs from any rollout backend.

    `generate` returns `sampling_i.n` samples for prompt i, prompt-major and in order. `sampling` is
    one `SamplingParams` for all prompts or one per prompt (so a server can batch requests that differ
    in temperature or seed). A sample must be a pure function of (weights, prompt, its parameters,
    `sample_seed(seed, j)`) when a seed is given — never of the batch it ran in.
    Weight updates must be atomic with respect to `generate`: a sample is produced by one version.
    """

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingParams | Sequence[SamplingParams],
        *,
        return_routed_experts: bool = False,
    ) -> list[Sample]: ...

    def update_weights_from_disk(self, path: str, weight_version: str) -> None: ...

    def update_weights(self, named_arrays: Iterable[tuple[str, Any]], weight_version: str) -> None: ...

    @property
    def weight_version(self) -> str: ...

    def set_weight_version(self, weight_version: str) -> None:
        """Relabel the current weights (SGLang's /update_weight_version) without changing them."""
        ...

    def health(self) -> bool: ...

    def model_info(self) -> ModelInfo: ...

    def flush_cache(self) -> None: ...

    def pause(self) -> None: ...

    def resume(self) -> None: ...
