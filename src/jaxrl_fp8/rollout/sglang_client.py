"""Client for one SGLang server (or one `jaxrl_fp8.serve` server: same API subset).

Wire format, as read from SGLang's source (python/sglang/srt/entrypoints/http_server.py,
managers/io_struct.py, layers/moe/routed_experts_capturer.py):
- `POST /generate` takes `input_ids`, `sampling_params` (`temperature`, `top_p`, `top_k`,
  `max_new_tokens`, `stop_token_ids`, `ignore_eos`, `n`, `sampling_seed`), `return_logprob`,
  `logprob_start_len`, `return_routed_experts`, `rid`. It answers one object, or a list of `n`
  objects when `n > 1`: `{text, output_ids, meta_info: {id, finish_reason, prompt_tokens,
  completion_tokens, weight_version, output_token_logprobs: [[logprob, token_id, text|null], ...],
  routed_experts}}`.
- `finish_reason` is an object (`{"type": "length", "length": N}`, `{"type": "stop", "matched": id}`,
  `{"type": "abort", "message": ...}`); older builds and some proxies send a bare string.
- `routed_experts` is base64 of little-endian int32, flattened `[rows, num_hidden_layers, top_k]`,
  rows = `seqlen - 1 - routed_experts_start_len` with seqlen = prompt + output tokens (the capturer
  reads the KV slots `[start, seqlen - 1)`: every token that was forwarded). Servers started without
  `--enable-return-routed-experts` silently omit the field.
- `/model_info` (older: `/get_model_info`) reports `weight_version`; `/server_info` (older:
  `/get_server_info`) reports the server args, including `enable_return_routed_experts`.

Retries: connection errors, timeouts and 5xx are retried with exponential backoff and jitter; 4xx
never (the request itself is wrong and would fail everywhere).
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import logging
import random
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import requests

from jaxrl_fp8.rollout.types import FINISH_REASONS, GenerateRequest, Sample, sample_seed

log = logging.getLogger(__name__)


class SGLangError(RuntimeError):
    """Base class of every error this client raises."""


class ServerUnavailable(SGLangError):
    """The server could not be reached or kept failing (connection error, timeout, 5xx) after retries.

    Retryable elsewhere: a fleet takes the server out and re-sends the request to another one.
    """

    def __init__(self, url: str, message: str):
        super().__init__(f"{url}: {message}")
        self.url = url


class SGLangHTTPError(SGLangError):
    """The server rejected the request (4xx): retrying it, here or on another server, cannot help."""

    def __init__(self, url: str, status: int, body: str):
        super().__init__(f"{url} answered HTTP {status}: {body[:2000]}")
        self.url = url
        self.status = status
        self.body = body


class RoutedExpertsUnsupported(SGLangError):
    """Routing replay asked for routed experts and the server does not return them."""


class MalformedResponse(SGLangError):
    """The server answered 200 with a body that does not follow the /generate contract."""


@dataclasses.dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff with jitter: attempt a (0-based) sleeps base·2^a capped at max, ±jitter."""

    max_attempts: int = 4
    backoff_base_s: float = 0.5
    backoff_max_s: float = 8.0
    jitter: float = 0.5  # fraction of the delay drawn uniformly at random

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"RetryPolicy.max_attempts must be >= 1, got {self.max_attempts}")
        if not 0.0 <= self.jitter <= 1.0:
            raise ValueError(f"RetryPolicy.jitter must be in [0, 1], got {self.jitter}")

    def delay_s(self, attempt: int, rng: random.Random | None = None) -> float:
        rng = rng or random
        base = min(self.backoff_max_s, self.backoff_base_s * (2.0**attempt))
        return base * (1.0 - self.jitter + self.jitter * rng.random())


# ---------------------------------------------------------------------------------------------
# Wire codecs (shared with http_server so both ends agree by construction).
# ---------------------------------------------------------------------------------------------


def encode_routed_experts(routed_experts: np.ndarray) -> str:
    """base64 of the little-endian int32 bytes, SGLang's `meta_info.routed_experts` encoding."""
    return base64.b64encode(np.ascontiguousarray(routed_experts, dtype="<i4").tobytes()).decode("ascii")


def decode_routed_experts(payload: str, num_rows: int, num_layers: int, top_k: int) -> np.ndarray:
    """Decode `meta_info.routed_experts` to int32 `[num_rows, num_layers, top_k]`, checking the size."""
    try:
        raw = base64.b64decode(payload.encode("ascii"), validate=True)
    except (binascii.Error, ValueError, UnicodeEncodeError) as e:
        raise MalformedResponse(f"meta_info.routed_experts is not valid base64: {e}") from e
    if len(raw) % 4:
        raise MalformedResponse(f"meta_info.routed_experts has {len(raw)} bytes, not a multiple of 4 (int32)")
    flat = np.frombuffer(raw, dtype="<i4").astype(np.int32)
    expected = num_rows * num_layers * top_k
    if flat.size != expected:
        per_row = num_layers * top_k
        rows_got = flat.size / per_row if per_row else float("nan")
        raise MalformedResponse(
            f"meta_info.routed_experts has {flat.size} ids; expected {num_rows} tokens x {num_layers} layers x "
            f"{top_k} experts = {expected} (got {rows_got:g} token rows). Check num_layers/top_k against the "
            f"model's config.json (num_hidden_layers, num_experts_per_tok)"
        )
    return flat.reshape(num_rows, num_layers, top_k)


def parse_finish_reason(value: Any) -> str:
    """SGLang's finish reason (a `{"type": ...}` object or a bare string) → "stop" | "length" | "abort"."""
    kind = value.get("type") if isinstance(value, dict) else value
    if kind not in FINISH_REASONS:
        raise MalformedResponse(f"meta_info.finish_reason {value!r} is not one of {FINISH_REASONS}")
    return kind


def parse_generate_output(
    output: dict[str, Any],
    request: GenerateRequest,
    sample_offset: int,
    *,
    routed_experts_shape: tuple[int, int] | None,
    url: str = "",
) -> Sample:
    """One element of a /generate response → `Sample` (checks lengths; slices nothing silently)."""
    if not isinstance(output, dict) or not isinstance(output.get("meta_info"), dict):
        raise MalformedResponse(f"{url}: /generate output lacks a meta_info object: {str(output)[:300]}")
    meta = output["meta_info"]
    finish = parse_finish_reason(meta.get("finish_reason"))
    token_logprobs = meta.get("output_token_logprobs")
    if token_logprobs is None:
        token_logprobs = [] if finish == "abort" else None
    if token_logprobs is None:
        raise MalformedResponse(f"{url}: meta_info.output_token_logprobs missing although return_logprob was set")
    output_ids = output.get("output_ids")
    if output_ids is None:
        output_ids = [int(entry[1]) for entry in token_logprobs]
    output_ids = [int(t) for t in output_ids]
    if len(token_logprobs) != len(output_ids):
        raise MalformedResponse(
            f"{url}: {len(token_logprobs)} output_token_logprobs for {len(output_ids)} output_ids (rid {request.rid})"
        )
    logprobs = np.empty(len(output_ids), dtype=np.float32)
    for t, (entry, token) in enumerate(zip(token_logprobs, output_ids)):
        if not isinstance(entry, (list, tuple)) or len(entry) < 2 or entry[0] is None:
            raise MalformedResponse(f"{url}: output_token_logprobs[{t}] = {entry!r} is not [logprob, token_id, ...]")
        if int(entry[1]) != token:
            raise MalformedResponse(
                f"{url}: output_token_logprobs[{t}] is for token {entry[1]} but output_ids[{t}] is {token}"
            )
        logprobs[t] = float(entry[0])
    routed = None
    if request.return_routed_experts and finish != "abort":
        routed = _routed_experts_of(meta, len(request.prompt_ids), len(output_ids), routed_experts_shape, url)
    sample_index = sample_offset
    seed = request.sampling.seed
    return Sample(
        prompt_ids=np.asarray(request.prompt_ids, dtype=np.int32),
        response_ids=np.asarray(output_ids, dtype=np.int32),
        rollout_logprobs=logprobs,
        finish_reason=finish,
        weight_version=str(meta.get("weight_version") or "unknown"),
        request_id=request.rid,
        routed_experts=routed,
        prompt_index=request.prompt_index,
        sample_index=request.first_sample_index + sample_index,
        seed=None if seed is None else sample_seed(seed, sample_index),
    )


def _routed_experts_of(
    meta: dict[str, Any],
    prompt_len: int,
    response_len: int,
    shape: tuple[int, int] | None,
    url: str,
) -> np.ndarray:
    payload = meta.get("routed_experts")
    num_rows = prompt_len + response_len - 1
    start = int(meta.get("routed_experts_start_len") or 0)
    if start:
        raise MalformedResponse(
            f"{url}: routed_experts_start_len={start}; this client asks for the full sequence and does not "
            f"stitch partial routings"
        )
    if shape is None:
        raise RoutedExpertsUnsupported(
            f"{url}: cannot reshape routed_experts: the number of layers and top-k are unknown. Pass "
            f"routed_experts_shape=(num_hidden_layers, num_experts_per_tok) from the model's config.json"
        )
    if payload is None or payload == "":
        if num_rows == 0:
            return np.zeros((0, *shape), dtype=np.int32)
        raise RoutedExpertsUnsupported(
            f"{url}: return_routed_experts was requested but the response has no meta_info.routed_experts. "
            f"The server was most likely started without --enable-return-routed-experts; restart it with "
            f"that flag or turn routing replay (R3) off"
        )
    if not isinstance(payload, str):
        raise MalformedResponse(f"{url}: meta_info.routed_experts must be a base64 string, got {type(payload).__name__}")
    return decode_routed_experts(payload, num_rows, *shape)


# ---------------------------------------------------------------------------------------------
# The client.
# ---------------------------------------------------------------------------------------------


class SGLangClient:
    """Talks to one server. Thread-safe: each thread gets its own `requests.Session`."""

    def __init__(
        self,
        base_url: str,
        *,
        request_timeout_s: float = 600.0,
        connect_timeout_s: float = 5.0,
        control_timeout_s: float = 1800.0,
        retry: RetryPolicy = RetryPolicy(),
        routed_experts_shape: tuple[int, int] | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ):
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"server URL must start with http:// or https://, got {base_url!r}")
        self.url = base_url.rstrip("/")
        self.request_timeout_s = request_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.control_timeout_s = control_timeout_s
        self.retry = retry
        self._routed_experts_shape = routed_experts_shape
        self._sleep = sleep
        self._local = threading.local()
        self._rng = random.Random()
        self._server_info: dict[str, Any] | None = None

    def __repr__(self) -> str:
        return f"SGLangClient({self.url!r})"

    # -- transport ------------------------------------------------------------------------------

    def _session(self) -> requests.Session:
        session = getattr(self._local, "session", None)
        if session is None:
            session = requests.Session()
            self._local.session = session
        return session

    def _request(
        self,
        method: str,
        path: str,
        *,
        json_body: Any = None,
        timeout_s: float | None = None,
        retry: RetryPolicy | None = None,
    ) -> requests.Response:
        """One call with retries on connection errors / timeouts / 5xx; 4xx raise at once."""
        retry = retry or self.retry
        timeout = (self.connect_timeout_s, timeout_s if timeout_s is not None else self.request_timeout_s)
        last = ""
        for attempt in range(retry.max_attempts):
            try:
                resp = self._session().request(method, self.url + path, json=json_body, timeout=timeout)
            except (requests.ConnectionError, requests.Timeout, requests.exceptions.ChunkedEncodingError) as e:
                # ChunkedEncodingError: the connection broke inside the body (a server killed mid-answer), which
                # requests does not count as a ConnectionError; the server is as unavailable as one that refused
                last = f"{type(e).__name__}: {e}"
                # The connection may be half-dead: start the next attempt on a fresh session.
                self._local.session = None
            else:
                if resp.status_code < 400:
                    return resp
                if resp.status_code < 500:
                    raise SGLangHTTPError(self.url + path, resp.status_code, resp.text)
                last = f"HTTP {resp.status_code}: {resp.text[:500]}"
            if attempt + 1 < retry.max_attempts:
                delay = retry.delay_s(attempt, self._rng)
                log.debug("%s%s failed (%s); retry %d in %.2fs", self.url, path, last, attempt + 1, delay)
                self._sleep(delay)
        raise ServerUnavailable(self.url, f"{method} {path} failed after {retry.max_attempts} attempts; last: {last}")

    def _json(self, resp: requests.Response, path: str) -> Any:
        try:
            return resp.json()
        except ValueError as e:
            raise MalformedResponse(f"{self.url}{path}: response is not JSON: {resp.text[:300]}") from e

    def _get_with_fallback(self, paths: Sequence[str], *, timeout_s: float | None = None,
                           retry: RetryPolicy | None = None) -> Any:
        """GET the first path that exists (SGLang renamed /get_model_info → /model_info, etc.)."""
        for i, path in enumerate(paths):
            try:
                return self._json(self._request("GET", path, timeout_s=timeout_s, retry=retry), path)
            except SGLangHTTPError as e:
                if e.status == 404 and i + 1 < len(paths):
                    continue
                raise
        raise AssertionError("unreachable")

    # -- generation -----------------------------------------------------------------------------

    def generate(self, request: GenerateRequest, *, wire_rid: str | None = None,
                 retry: RetryPolicy | None = None) -> list[Sample]:
        """Run one request; returns its `request.sampling.n` samples in order."""
        body = request.to_sglang(rid=wire_rid)
        resp = self._request("POST", "/generate", json_body=body, retry=retry)
        data = self._json(resp, "/generate")
        outputs = data if isinstance(data, list) else [data]
        n = request.sampling.n
        if len(outputs) != n:
            raise MalformedResponse(f"{self.url}: /generate returned {len(outputs)} outputs for n={n}")
        shape = self._routed_experts_shape
        if request.return_routed_experts and shape is None:
            shape = self.routed_experts_shape()
        try:
            return [
                parse_generate_output(o, request, j, routed_experts_shape=shape, url=self.url)
                for j, o in enumerate(outputs)
            ]
        except RoutedExpertsUnsupported as e:
            raise RoutedExpertsUnsupported(self._explain_missing_routed_experts(str(e))) from None

    def _explain_missing_routed_experts(self, message: str) -> str:
        try:
            enabled = self.server_info().get("enable_return_routed_experts")
        except SGLangError:
            return message
        if enabled is False:
            return (
                f"{self.url} was started without --enable-return-routed-experts "
                f"(server_info.enable_return_routed_experts = false) but routing replay asked for routed "
                f"experts; restart the server with that flag or turn routing replay (R3) off"
            )
        return message

    def routed_experts_shape(self) -> tuple[int, int] | None:
        """(num_hidden_layers, num_experts_per_tok): given at construction, else from /model_info."""
        if self._routed_experts_shape is None:
            info = self.model_info()
            layers, k = info.get("num_hidden_layers"), info.get("num_experts_per_tok")
            if isinstance(layers, int) and isinstance(k, int):
                self._routed_experts_shape = (layers, k)
        return self._routed_experts_shape

    def check_routed_experts_support(self) -> None:
        """Fail before a rollout, not in the middle of one, when the server cannot return routing."""
        enabled = self.server_info(refresh=True).get("enable_return_routed_experts")
        if enabled is False:
            raise RoutedExpertsUnsupported(
                f"{self.url} was started without --enable-return-routed-experts "
                f"(server_info.enable_return_routed_experts = false); routing replay (R3) needs it"
            )

    # -- status ---------------------------------------------------------------------------------

    def health(self, timeout_s: float = 5.0) -> bool:
        """GET /health → True on 200. Never raises."""
        try:
            self._request("GET", "/health", timeout_s=timeout_s, retry=RetryPolicy(max_attempts=1))
            return True
        except SGLangError:
            return False

    def health_generate(self, timeout_s: float = 30.0) -> bool:
        """GET /health_generate (runs one token through the model) → True on 200. Never raises."""
        try:
            self._request("GET", "/health_generate", timeout_s=timeout_s, retry=RetryPolicy(max_attempts=1))
            return True
        except SGLangError:
            return False

    def model_info(self, *, timeout_s: float = 10.0, retry: RetryPolicy | None = None) -> dict[str, Any]:
        return self._get_with_fallback(["/model_info", "/get_model_info"], timeout_s=timeout_s, retry=retry)

    def server_info(self, *, refresh: bool = False, timeout_s: float = 10.0) -> dict[str, Any]:
        if self._server_info is None or refresh:
            self._server_info = self._get_with_fallback(["/server_info", "/get_server_info"], timeout_s=timeout_s)
        return self._server_info

    def weight_version(self, *, timeout_s: float = 10.0, retry: RetryPolicy | None = None) -> str | None:
        """The served weight version, from /model_info (SGLang's current home for it)."""
        version = self.model_info(timeout_s=timeout_s, retry=retry).get("weight_version")
        return None if version is None else str(version)

    # -- control --------------------------------------------------------------------------------

    def flush_cache(self) -> None:
        self._request("POST", "/flush_cache", timeout_s=self.control_timeout_s)

    def pause_generation(self, mode: str = "abort") -> None:
        """Stop scheduling generation. "abort" returns in-flight requests as aborted, so no sample ever
        spans two weight versions (the fleet re-sends them); "retract"/"in_place" keep them."""
        if mode not in ("abort", "retract", "in_place"):
            raise ValueError(f"pause mode must be abort, retract or in_place, got {mode!r}")
        self._request("POST", "/pause_generation", json_body={"mode": mode}, timeout_s=self.control_timeout_s)

    def continue_generation(self) -> None:
        self._request("POST", "/continue_generation", json_body={}, timeout_s=self.control_timeout_s)

    def update_weights_from_disk(
        self,
        model_path: str,
        *,
        weight_version: str,
        load_format: str | None = None,
        flush_cache: bool = True,
        retry: RetryPolicy | None = None,
    ) -> dict[str, Any]:
        """POST /update_weights_from_disk; raises SGLangHTTPError when the server reports failure."""
        body: dict[str, Any] = {"model_path": model_path, "weight_version": weight_version, "flush_cache": flush_cache}
        if load_format is not None:
            body["load_format"] = load_format
        resp = self._request("POST", "/update_weights_from_disk", json_body=body,
                             timeout_s=self.control_timeout_s, retry=retry)
        data = self._json(resp, "/update_weights_from_disk")
        if not data.get("success", False):
            raise SGLangHTTPError(self.url + "/update_weights_from_disk", resp.status_code, str(data))
        return data

    def update_weight_version(self, new_version: str) -> None:
        self._request("POST", "/update_weight_version", json_body={"new_version": new_version},
                      timeout_s=self.control_timeout_s)

    def init_weights_update_group(
        self,
        *,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str = "nccl",
    ) -> dict[str, Any]:
        """POST /init_weights_update_group; blocks until every rank of the group has joined."""
        body = {
            "master_address": master_address,
            "master_port": int(master_port),
            "rank_offset": int(rank_offset),
            "world_size": int(world_size),
            "group_name": group_name,
            "backend": backend,
        }
        resp = self._request("POST", "/init_weights_update_group", json_body=body,
                             timeout_s=self.control_timeout_s, retry=RetryPolicy(max_attempts=1))
        return self._checked(resp, "/init_weights_update_group")

    def update_weights_from_distributed(
        self,
        *,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        group_name: str = "weight_update_group",
        weight_version: str | None = None,
        flush_cache: bool = True,
    ) -> dict[str, Any]:
        """POST /update_weights_from_distributed; returns once the server has received the broadcast."""
        body: dict[str, Any] = {
            "names": list(names),
            "dtypes": list(dtypes),
            "shapes": [list(map(int, s)) for s in shapes],
            "group_name": group_name,
            "flush_cache": flush_cache,
        }
        if weight_version is not None:
            body["weight_version"] = weight_version
        resp = self._request("POST", "/update_weights_from_distributed", json_body=body,
                             timeout_s=self.control_timeout_s, retry=RetryPolicy(max_attempts=1))
        return self._checked(resp, "/update_weights_from_distributed")

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> None:
        self._request("POST", "/destroy_weights_update_group", json_body={"group_name": group_name},
                      timeout_s=self.control_timeout_s)

    def _checked(self, resp: requests.Response, path: str) -> dict[str, Any]:
        data = self._json(resp, path)
        if not isinstance(data, dict) or not data.get("success", False):
            raise SGLangHTTPError(self.url + path, resp.status_code, str(data))
        return data
