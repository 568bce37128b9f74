"""What the SGLang-API server accepts and answers: its limits, request validation, response bodies.

All request validation is here (pure functions, testable without HTTP); sampling parameters are validated
by `SamplingParams.from_sglang`, token ids by `types.token_ids`, so the server checks nothing itself. A bad
request raises `BadRequest`, which the handler turns into SGLang's 4xx JSON error
`{"object": "error", "message", "type", "code"}`, the message naming the field.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Sequence
from http import HTTPStatus
from typing import Any

from jaxrl_fp8.rollout.sglang_client import encode_routed_experts
from jaxrl_fp8.rollout.types import ModelInfo, Sample, SamplingParams, token_ids

GENERATE_FIELDS = frozenset(
    {"input_ids", "sampling_params", "return_logprob", "logprob_start_len", "return_routed_experts", "rid", "stream"}
)
# SGLang's UpdateWeightFromDiskReqInput fields; the ones without meaning here are accepted and ignored.
UPDATE_FROM_DISK_FIELDS = frozenset(
    {"model_path", "load_format", "weight_version", "flush_cache", "abort_all_requests", "is_async",
     "torch_empty_cache", "keep_pause", "recapture_cuda_graph", "token_step", "rid"}
)
UPDATE_VERSION_FIELDS = frozenset({"new_version", "abort_all_requests", "rid"})
PAUSE_MODES = ("abort", "retract", "in_place")


class BadRequest(ValueError):
    """A request the server refuses; becomes a 4xx JSON error."""

    def __init__(self, message: str, status: int = HTTPStatus.BAD_REQUEST):
        super().__init__(message)
        self.status = int(status)


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    max_body_bytes: int = 16 << 20
    max_batch_prompts: int = 256  # prompts in one engine call
    max_prompts_per_request: int = 256
    max_n: int = 64
    max_wait_s: float = 0.005  # how long the first queued request waits for company
    enable_return_routed_experts: bool = True
    health_generate_timeout_s: float = 20.0

    def __post_init__(self) -> None:
        if self.max_prompts_per_request > self.max_batch_prompts:
            raise ValueError("ServerConfig.max_prompts_per_request must be <= max_batch_prompts")


@dataclasses.dataclass
class ParsedGenerate:
    prompts: list[tuple[int, ...]]
    params: list[SamplingParams]
    rids: list[str]
    return_logprob: bool
    return_routed_experts: bool
    single: bool  # input_ids was one prompt (the response is then not wrapped per prompt)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _object(body: Any, what: str = "the request body must be a JSON object") -> dict[str, Any]:
    if not isinstance(body, dict):
        raise BadRequest(what)
    return body


def _refuse_unknown(body: dict[str, Any], supported: frozenset[str], *, list_supported: bool = True) -> None:
    unknown = sorted(set(body) - supported)
    if unknown:
        raise BadRequest(f"unsupported fields {unknown}" + (f"; supported: {sorted(supported)}" if list_supported else ""))


def _bad_request(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """`fn(...)`, its ValueError (a message naming the field) as a BadRequest."""
    try:
        return fn(*args, **kwargs)
    except ValueError as e:
        raise BadRequest(str(e)) from None


def parse_generate_body(body: Any, info: ModelInfo, config: ServerConfig) -> ParsedGenerate:
    """Validate a /generate body against SGLang's schema (our subset) and the engine's limits."""
    _object(body, f"the request body must be a JSON object, got {type(body).__name__}")
    if "text" in body:
        raise BadRequest("'text' prompts are not supported by this server (it has no tokenizer); send 'input_ids'")
    _refuse_unknown(body, GENERATE_FIELDS)
    if body.get("stream"):
        raise BadRequest("'stream': true is not supported by this server")
    for flag in ("return_logprob", "return_routed_experts", "stream"):
        if body.get(flag) is not None and not isinstance(body[flag], bool):
            raise BadRequest(f"'{flag}' must be a boolean, got {body[flag]!r}")
    start = body.get("logprob_start_len")
    if start is not None and (not _is_int(start) or start != -1):
        raise BadRequest(f"'logprob_start_len' must be -1 (output tokens only), got {start!r}")

    ids = body.get("input_ids")
    if ids is None:
        raise BadRequest("'input_ids' is required")
    if not isinstance(ids, list) or not ids:
        raise BadRequest("'input_ids' must be a non-empty list of token ids or a list of such lists")
    single = not isinstance(ids[0], list)
    raw_prompts = [ids] if single else ids
    if len(raw_prompts) > config.max_prompts_per_request:
        raise BadRequest(
            f"{len(raw_prompts)} prompts in one request; at most {config.max_prompts_per_request} are accepted"
        )
    names = ["input_ids"] if single else [f"input_ids[{i}]" for i in range(len(raw_prompts))]
    prompts = [_bad_request(token_ids, p, name, info.vocab_size, allow_empty=False)
               for p, name in zip(raw_prompts, names)]

    raw_sp = body.get("sampling_params")
    limits = {"vocab_size": info.vocab_size, "max_n": config.max_n}
    if isinstance(raw_sp, list):
        if len(raw_sp) != len(prompts):
            raise BadRequest(f"'sampling_params' has {len(raw_sp)} entries for {len(prompts)} prompts")
        params = [_bad_request(SamplingParams.from_sglang, s, f"sampling_params[{i}]", **limits)
                  for i, s in enumerate(raw_sp)]
    else:
        params = [_bad_request(SamplingParams.from_sglang, raw_sp, "sampling_params", **limits)] * len(prompts)

    for name, p, sp in zip(names, prompts, params):
        if len(p) + sp.max_new_tokens > info.max_total_tokens:
            raise BadRequest(
                f"{name} has {len(p)} tokens + max_new_tokens {sp.max_new_tokens} = {len(p) + sp.max_new_tokens}, "
                f"over this server's max_total_tokens {info.max_total_tokens}"
            )

    rid = body.get("rid")
    if rid is None or isinstance(rid, str):
        base = uuid.uuid4().hex if rid is None else rid
        rids = [base] if single else [f"{base}_{i}" for i in range(len(prompts))]
    elif isinstance(rid, list) and all(isinstance(r, str) for r in rid) and len(rid) == len(prompts):
        rids = list(rid)
    else:
        raise BadRequest(f"'rid' must be a string or a list of {len(prompts)} strings, got {rid!r}")

    return ParsedGenerate(prompts, params, rids, bool(body.get("return_logprob", False)),
                          bool(body.get("return_routed_experts", False)), single)


@dataclasses.dataclass(frozen=True)
class UpdateFromDisk:
    model_path: str
    weight_version: str | None
    flush_cache: bool


def parse_update_from_disk(body: Any) -> UpdateFromDisk:
    """Validate an /update_weights_from_disk body (SGLang's UpdateWeightFromDiskReqInput)."""
    _refuse_unknown(_object(body), UPDATE_FROM_DISK_FIELDS)
    path = body.get("model_path")
    if not isinstance(path, str) or not path:
        raise BadRequest("'model_path' must be a non-empty string")
    version = body.get("weight_version")
    if version is not None and not isinstance(version, str):
        raise BadRequest(f"'weight_version' must be a string, got {version!r}")
    load_format = body.get("load_format")
    if load_format not in (None, "auto"):
        raise BadRequest(f"'load_format' {load_format!r} is not supported (only 'auto')")
    flush = body.get("flush_cache", True)
    if not isinstance(flush, bool):
        raise BadRequest(f"'flush_cache' must be a boolean, got {flush!r}")
    return UpdateFromDisk(path, version, flush)


def parse_update_weight_version(body: Any) -> str:
    """Validate an /update_weight_version body; the new version."""
    if not isinstance(body, dict) or not isinstance(body.get("new_version"), str):
        raise BadRequest("'new_version' (a string) is required")
    _refuse_unknown(body, UPDATE_VERSION_FIELDS, list_supported=False)
    return body["new_version"]


def parse_pause_mode(body: Any) -> str:
    """Validate a /pause_generation body; its mode (SGLang's default: abort)."""
    mode = _object(body).get("mode", "abort")
    if mode not in PAUSE_MODES:
        raise BadRequest(f"'mode' must be abort, retract or in_place, got {mode!r}")
    return mode


# ---------------------------------------------------------------------------------------------
# Response bodies.
# ---------------------------------------------------------------------------------------------


def _finish_json(sample: Sample) -> dict[str, Any]:
    if sample.finish_reason == "length":
        return {"type": "length", "length": int(sample.response_ids.size)}
    if sample.finish_reason == "stop":
        matched = int(sample.response_ids[-1]) if sample.response_ids.size else None
        return {"type": "stop", "matched": matched}
    return {"type": "abort", "message": "aborted"}


def sample_to_output(sample: Sample, rid: str, *, return_logprob: bool, return_routed_experts: bool) -> dict:
    """One element of a /generate response, shaped like SGLang's."""
    meta: dict[str, Any] = {
        "id": rid,
        "finish_reason": _finish_json(sample),
        "prompt_tokens": int(sample.prompt_ids.size),
        "completion_tokens": int(sample.response_ids.size),
        "cached_tokens": 0,
        "weight_version": sample.weight_version,
    }
    if return_logprob:
        meta["output_token_logprobs"] = [
            [float(lp), int(t), None] for lp, t in zip(sample.rollout_logprobs.tolist(), sample.response_ids.tolist())
        ]
    if return_routed_experts and sample.routed_experts is not None:
        meta["routed_experts"] = encode_routed_experts(sample.routed_experts)
    return {"text": "", "output_ids": sample.response_ids.tolist(), "meta_info": meta}


def aborted_output(prompt: Sequence[int], rid: str, version: str, message: str, return_logprob: bool) -> dict:
    """One element of a /generate response for a request answered before it ran (abort-mode pause)."""
    meta: dict[str, Any] = {
        "id": rid,
        "finish_reason": {"type": "abort", "message": message},
        "prompt_tokens": len(prompt),
        "completion_tokens": 0,
        "cached_tokens": 0,
        "weight_version": version,
    }
    if return_logprob:
        meta["output_token_logprobs"] = []
    return {"text": "", "output_ids": [], "meta_info": meta}


def sample_rid(rid: str, j: int, n: int) -> str:
    """The id of sample j of a request with id `rid` and n samples (SGLang's `{rid}_{j}` when n > 1)."""
    return rid if n == 1 else f"{rid}_{j}"


def error_body(message: str, status: int) -> dict[str, Any]:
    return {"object": "error", "message": message, "type": HTTPStatus(status).phrase, "param": None, "code": status}
