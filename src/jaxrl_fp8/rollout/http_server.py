"""Any `RolloutEngine` behind the subset of SGLang's HTTP API that RL uses (stdlib only).

So a JAX rollout fleet runs as separate processes and `SGLangClient`/`SGLangFleet` drive it exactly
like SGLang. Endpoints: POST /generate, /update_weights_from_disk, /update_weight_version,
/pause_generation, /continue_generation, /flush_cache (also GET); GET /health, /health_generate,
/model_info, /server_info, /weight_version (plus SGLang's older /get_* aliases).

- Concurrent /generate requests are queued and run as one engine call (a batching window of
  `max_wait_s`, at most `max_batch_prompts` prompts), each prompt keeping its own sampling params.
- Requests are validated before they reach the engine: malformed JSON, unknown fields, wrong types,
  out-of-vocabulary ids, prompt + max_new_tokens over the engine's limit and oversize bodies get a 4xx
  JSON error `{"object": "error", "message", "type", "code"}` naming the field; the server stays up.
- Weight updates take the engine lock, so they wait for the running batch: a sample never mixes two
  versions. /pause_generation blocks new generation until /continue_generation; in "abort" mode the
  queued (not yet running) requests are answered at once with finish_reason abort.
- Routed experts go out base64 like SGLang's, only when the request asks for them and the server was
  started with `enable_return_routed_experts` (else the field is absent, as with SGLang).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import signal
import threading
import time
import uuid
from collections.abc import Sequence
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from jaxrl_fp8.rollout.sglang_client import encode_routed_experts
from jaxrl_fp8.rollout.types import MAX_SEED, ModelInfo, RolloutEngine, Sample, SamplingParams

log = logging.getLogger(__name__)

GENERATE_FIELDS = frozenset(
    {"input_ids", "sampling_params", "return_logprob", "logprob_start_len", "return_routed_experts", "rid", "stream"}
)
SAMPLING_FIELDS = frozenset(
    {"temperature", "top_p", "top_k", "max_new_tokens", "stop_token_ids", "ignore_eos", "n", "sampling_seed"}
)
# SGLang's UpdateWeightFromDiskReqInput fields; the ones without meaning here are accepted and ignored.
UPDATE_FROM_DISK_FIELDS = frozenset(
    {"model_path", "load_format", "weight_version", "flush_cache", "abort_all_requests", "is_async",
     "torch_empty_cache", "keep_pause", "recapture_cuda_graph", "token_step", "rid"}
)


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


# ---------------------------------------------------------------------------------------------
# Request parsing (pure; unit-testable without HTTP).
# ---------------------------------------------------------------------------------------------


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


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _token_list(value: Any, where: str, vocab_size: int, allow_empty: bool = False) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise BadRequest(f"{where} must be a list of token ids, got {type(value).__name__}")
    if not value and not allow_empty:
        raise BadRequest(f"{where} must not be empty")
    for i, t in enumerate(value):
        if not _is_int(t):
            raise BadRequest(f"{where}[{i}] must be an integer token id, got {t!r}")
        if not 0 <= t < vocab_size:
            raise BadRequest(f"{where}[{i}] = {t} is out of the vocabulary [0, {vocab_size})")
    return tuple(value)


def parse_sampling_params(raw: Any, where: str, vocab_size: int, max_n: int) -> SamplingParams:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise BadRequest(f"{where} must be an object, got {type(raw).__name__}")
    unknown = sorted(set(raw) - SAMPLING_FIELDS)
    if unknown:
        raise BadRequest(f"{where} has unsupported fields {unknown}; supported: {sorted(SAMPLING_FIELDS)}")
    kw: dict[str, Any] = {}
    v = raw.get("temperature")
    if v is not None:
        if not _is_number(v) or v < 0:
            raise BadRequest(f"{where}.temperature must be a finite number >= 0, got {v!r}")
        kw["temperature"] = float(v)
    v = raw.get("top_p")
    if v is not None:
        if not _is_number(v) or not 0 < v <= 1:
            raise BadRequest(f"{where}.top_p must be a number in (0, 1], got {v!r}")
        kw["top_p"] = float(v)
    v = raw.get("top_k")
    if v is not None:
        if not _is_int(v) or not (v == -1 or v >= 1):
            raise BadRequest(f"{where}.top_k must be -1 (all) or an integer >= 1, got {v!r}")
        kw["top_k"] = v
    v = raw.get("max_new_tokens")
    if v is not None:
        if not _is_int(v) or v < 0:
            raise BadRequest(f"{where}.max_new_tokens must be an integer >= 0, got {v!r}")
        kw["max_new_tokens"] = v
    v = raw.get("stop_token_ids")
    if v is not None:
        kw["stop_token_ids"] = _token_list(v, f"{where}.stop_token_ids", vocab_size, allow_empty=True)
    v = raw.get("ignore_eos")
    if v is not None:
        if not isinstance(v, bool):
            raise BadRequest(f"{where}.ignore_eos must be a boolean, got {v!r}")
        kw["ignore_eos"] = v
    v = raw.get("n")
    if v is not None:
        if not _is_int(v) or not 1 <= v <= max_n:
            raise BadRequest(f"{where}.n must be an integer in [1, {max_n}], got {v!r}")
        kw["n"] = v
    v = raw.get("sampling_seed")
    if v is not None:
        if not _is_int(v) or not 0 <= v <= MAX_SEED:
            raise BadRequest(f"{where}.sampling_seed must be an integer in [0, {MAX_SEED}], got {v!r}")
        kw["seed"] = v
    return SamplingParams(**kw)


def parse_generate_body(body: Any, info: ModelInfo, config: ServerConfig) -> ParsedGenerate:
    """Validate a /generate body against SGLang's schema (our subset) and the engine's limits."""
    if not isinstance(body, dict):
        raise BadRequest(f"the request body must be a JSON object, got {type(body).__name__}")
    if "text" in body:
        raise BadRequest("'text' prompts are not supported by this server (it has no tokenizer); send 'input_ids'")
    unknown = sorted(set(body) - GENERATE_FIELDS)
    if unknown:
        raise BadRequest(f"unsupported fields {unknown}; supported: {sorted(GENERATE_FIELDS)}")
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
    prompts = [
        _token_list(p, "input_ids" if single else f"input_ids[{i}]", info.vocab_size)
        for i, p in enumerate(raw_prompts)
    ]

    raw_sp = body.get("sampling_params")
    if isinstance(raw_sp, list):
        if len(raw_sp) != len(prompts):
            raise BadRequest(f"'sampling_params' has {len(raw_sp)} entries for {len(prompts)} prompts")
        params = [parse_sampling_params(s, f"sampling_params[{i}]", info.vocab_size, config.max_n)
                  for i, s in enumerate(raw_sp)]
    else:
        params = [parse_sampling_params(raw_sp, "sampling_params", info.vocab_size, config.max_n)] * len(prompts)

    for i, (p, sp) in enumerate(zip(prompts, params)):
        if len(p) + sp.max_new_tokens > info.max_total_tokens:
            name = "input_ids" if single else f"input_ids[{i}]"
            raise BadRequest(
                f"{name} has {len(p)} tokens + max_new_tokens {sp.max_new_tokens} = {len(p) + sp.max_new_tokens}, "
                f"over this server's max_total_tokens {info.max_total_tokens}"
            )

    rid = body.get("rid")
    if rid is None:
        base = uuid.uuid4().hex
        rids = [base] if single else [f"{base}_{i}" for i in range(len(prompts))]
    elif isinstance(rid, str):
        rids = [rid] if single else [f"{rid}_{i}" for i in range(len(prompts))]
    elif isinstance(rid, list) and all(isinstance(r, str) for r in rid) and len(rid) == len(prompts):
        rids = list(rid)
    else:
        raise BadRequest(f"'rid' must be a string or a list of {len(prompts)} strings, got {rid!r}")

    return ParsedGenerate(prompts, params, rids, bool(body.get("return_logprob", False)),
                          bool(body.get("return_routed_experts", False)), single)


# ---------------------------------------------------------------------------------------------
# Response building.
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


def _aborted_output(prompt: Sequence[int], rid: str, version: str, message: str, return_logprob: bool) -> dict:
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


def error_body(message: str, status: int) -> dict[str, Any]:
    return {"object": "error", "message": message, "type": HTTPStatus(status).phrase, "param": None, "code": status}


# ---------------------------------------------------------------------------------------------
# Batching.
# ---------------------------------------------------------------------------------------------


class _Job:
    def __init__(self, parsed: ParsedGenerate):
        self.parsed = parsed
        self.done = threading.Event()
        self.samples: list[Sample] | None = None
        self.aborted: str | None = None
        self.error: str | None = None

    @property
    def num_prompts(self) -> int:
        return len(self.parsed.prompts)


class _Batcher:
    """One thread; merges queued jobs into one `engine.generate` call under the engine lock."""

    def __init__(self, engine: RolloutEngine, engine_lock: threading.Lock, config: ServerConfig):
        self.engine = engine
        self.engine_lock = engine_lock
        self.config = config
        self._queue: list[_Job] = []
        self._cond = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="rollout-batcher", daemon=True)
        self.batches_run = 0
        self.prompts_run = 0

    def start(self) -> None:
        self._thread.start()

    def submit(self, job: _Job) -> None:
        with self._cond:
            if self._stopping:
                job.error = "server is shutting down"
                job.done.set()
                return
            self._queue.append(job)
            self._cond.notify_all()

    @property
    def queued_prompts(self) -> int:
        """Prompts waiting behind the running batch (the ones an abort-mode pause would answer)."""
        with self._cond:
            return sum(j.num_prompts for j in self._queue)

    def abort_queued(self, message: str) -> int:
        with self._cond:
            jobs, self._queue = self._queue, []
        for job in jobs:
            job.aborted = message
            job.done.set()
        return len(jobs)

    def stop(self, timeout_s: float = 30.0) -> None:
        with self._cond:
            self._stopping = True
            jobs, self._queue = self._queue, []
            self._cond.notify_all()
        for job in jobs:
            job.error = "server is shutting down"
            job.done.set()
        self._thread.join(timeout_s)

    def _take_batch(self) -> list[_Job]:
        with self._cond:
            while not self._queue and not self._stopping:
                self._cond.wait()
            if self._stopping:
                return []
            deadline = time.monotonic() + self.config.max_wait_s
            while sum(j.num_prompts for j in self._queue) < self.config.max_batch_prompts and not self._stopping:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            batch, total = [], 0
            while self._queue and total + self._queue[0].num_prompts <= self.config.max_batch_prompts:
                job = self._queue.pop(0)
                batch.append(job)
                total += job.num_prompts
            return batch

    def _loop(self) -> None:
        while True:
            batch = self._take_batch()
            if not batch:
                if self._stopping:
                    return
                continue
            self._run(batch)

    def _run(self, batch: list[_Job]) -> None:
        prompts = [p for j in batch for p in j.parsed.prompts]
        params = [sp for j in batch for sp in j.parsed.params]
        routed = any(j.parsed.return_routed_experts for j in batch)
        try:
            with self.engine_lock:
                samples = self.engine.generate(prompts, params, return_routed_experts=routed)
            expected = sum(sp.n for sp in params)
            if len(samples) != expected:
                raise RuntimeError(f"engine returned {len(samples)} samples for {expected} requested")
        except Exception as e:  # the engine failed: fail this batch, keep serving
            log.exception("engine.generate failed for a batch of %d prompts", len(prompts))
            for job in batch:
                job.error = f"engine error: {type(e).__name__}: {e}"
                job.done.set()
            return
        self.batches_run += 1
        self.prompts_run += len(prompts)
        pos = 0
        for job in batch:
            count = sum(sp.n for sp in job.parsed.params)
            job.samples = samples[pos : pos + count]
            pos += count
            job.done.set()


# ---------------------------------------------------------------------------------------------
# The server.
# ---------------------------------------------------------------------------------------------


class EmbeddedServer:
    """A `RolloutEngine` served over HTTP. `start()` runs it in background threads."""

    def __init__(self, engine: RolloutEngine, host: str = "127.0.0.1", port: int = 0,
                 config: ServerConfig = ServerConfig()):
        self.engine = engine
        self.config = config
        self.engine_lock = threading.Lock()
        self.batcher = _Batcher(engine, self.engine_lock, config)
        self._pause_cond = threading.Condition()
        self._paused = False
        self._stopping = False
        self._httpd = _HTTPServer((host, port), _Handler)
        self._httpd.app = self
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="rollout-http", daemon=True)
        self._info_cache: ModelInfo | None = None

    @property
    def host(self) -> str:
        return self._httpd.server_address[0]

    @property
    def port(self) -> int:
        return self._httpd.server_address[1]

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> EmbeddedServer:
        self.batcher.start()
        self._thread.start()
        log.info("rollout server listening on %s", self.url)
        return self

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop accepting, let the running batch finish, answer queued requests with 503, close."""
        with self._pause_cond:
            self._stopping = True
            self._pause_cond.notify_all()
        self._httpd.shutdown()
        self.batcher.stop(timeout_s)
        self._httpd.server_close()
        self._thread.join(timeout_s)

    def __enter__(self) -> EmbeddedServer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    # -- state ----------------------------------------------------------------------------------

    def model_info(self) -> ModelInfo:
        return self.engine.model_info()

    def _limits(self) -> ModelInfo:
        """Vocabulary and length limits (fixed for the server's lifetime; read once)."""
        if self._info_cache is None:
            self._info_cache = self.engine.model_info()
        return self._info_cache

    @property
    def routed_experts_enabled(self) -> bool:
        return self.config.enable_return_routed_experts and self._limits().supports_routed_experts

    def wait_unpaused(self) -> bool:
        """Block while paused; False when the server is shutting down."""
        with self._pause_cond:
            while self._paused and not self._stopping:
                self._pause_cond.wait()
            return not self._stopping

    def pause(self, mode: str) -> int:
        with self._pause_cond:
            self._paused = True
        self.engine.pause()
        return self.batcher.abort_queued("paused for a weight update") if mode == "abort" else 0

    def resume(self) -> None:
        self.engine.resume()
        with self._pause_cond:
            self._paused = False
            self._pause_cond.notify_all()

    @property
    def paused(self) -> bool:
        return self._paused


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    app: EmbeddedServer


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _HTTPServer

    # -- plumbing -------------------------------------------------------------------------------

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        log.debug("%s %s", self.address_string(), format % args)

    def _send(self, status: int, payload: Any = None, *, text: str | None = None) -> None:
        if text is not None:
            data, ctype = text.encode(), "text/plain; charset=utf-8"
        elif payload is None:
            data, ctype = b"", "application/json"
        else:
            data, ctype = json.dumps(payload).encode(), "application/json"
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _error(self, status: int, message: str) -> None:
        self._send(status, error_body(message, status))

    def _read_json(self) -> Any:
        """The JSON body; {} when empty. Raises BadRequest (4xx) on size / encoding / syntax errors."""
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            raise BadRequest("chunked bodies are not supported; send Content-Length", HTTPStatus.LENGTH_REQUIRED)
        length_header = self.headers.get("Content-Length")
        if length_header is None:
            return {}
        try:
            length = int(length_header)
        except ValueError:
            raise BadRequest(f"invalid Content-Length {length_header!r}") from None
        if length < 0:
            raise BadRequest(f"invalid Content-Length {length}")
        limit = self.server.app.config.max_body_bytes
        if length > limit:
            # Drain a moderately oversize body so the client reads our 413 instead of a reset; beyond
            # that, close the connection rather than read gigabytes.
            if length <= 8 * limit:
                _drain(self.rfile, length)
            else:
                self.close_connection = True
            raise BadRequest(f"body of {length} bytes is over the limit of {limit} bytes",
                             HTTPStatus.REQUEST_ENTITY_TOO_LARGE)
        raw = self.rfile.read(length)
        if not raw.strip():
            return {}
        try:
            return json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise BadRequest(f"malformed JSON body: {e}") from None

    def _dispatch(self, routes: dict[str, Any]) -> None:
        path = self.path.split("?", 1)[0]
        handler = routes.get(path)
        try:
            if handler is None:
                other = _GET_ROUTES if self.command == "POST" else _POST_ROUTES
                if path in other:
                    self._error(HTTPStatus.METHOD_NOT_ALLOWED, f"{self.command} is not allowed on {path}")
                else:
                    self._error(HTTPStatus.NOT_FOUND, f"no endpoint {path}")
                return
            handler(self)
        except BadRequest as e:
            self._error(e.status, str(e))
        except Exception as e:  # never let one request take the server down
            log.exception("unhandled error on %s %s", self.command, path)
            self._error(HTTPStatus.INTERNAL_SERVER_ERROR, f"{type(e).__name__}: {e}")

    def do_GET(self) -> None:  # noqa: N802 - stdlib naming
        self._dispatch(_GET_ROUTES)

    def do_POST(self) -> None:  # noqa: N802
        self._dispatch(_POST_ROUTES)

    def do_PUT(self) -> None:  # noqa: N802 - SGLang accepts PUT on /generate
        self._dispatch({"/generate": _POST_ROUTES["/generate"]})

    # -- endpoints ------------------------------------------------------------------------------

    def health(self) -> None:
        app = self.server.app
        ok = not app._stopping and bool(app.engine.health())
        self._send(HTTPStatus.OK if ok else HTTPStatus.SERVICE_UNAVAILABLE)

    def health_generate(self) -> None:
        app = self.server.app
        parsed = ParsedGenerate([(0,)], [SamplingParams(temperature=0.0, max_new_tokens=1)],
                                [f"HEALTH_CHECK_{time.time()}"], False, False, True)
        job = _Job(parsed)
        app.batcher.submit(job)  # bypasses the pause gate, like SGLang's health check
        ok = job.done.wait(app.config.health_generate_timeout_s) and job.error is None
        self._send(HTTPStatus.OK if ok else HTTPStatus.SERVICE_UNAVAILABLE)

    def model_info(self) -> None:
        self._read_json()
        info = self.server.app.model_info()
        self._send(HTTPStatus.OK, {
            "model_path": info.model_path,
            "tokenizer_path": None,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": info.weight_version,
            # Not in SGLang's answer; lets clients validate ids and reshape routed experts.
            "vocab_size": info.vocab_size,
            "num_hidden_layers": info.num_hidden_layers,
            "num_experts_per_tok": info.num_experts_per_tok,
            "max_total_tokens": info.max_total_tokens,
        })

    def server_info(self) -> None:
        app = self.server.app
        info = app.model_info()
        self._send(HTTPStatus.OK, {
            "model_path": info.model_path,
            "weight_version": info.weight_version,
            "enable_return_routed_experts": app.routed_experts_enabled,
            "max_total_tokens": info.max_total_tokens,
            "max_batch_prompts": app.config.max_batch_prompts,
            "paused": app.paused,
            "batches_run": app.batcher.batches_run,
            "prompts_run": app.batcher.prompts_run,
            "version": "jaxrl_fp8-embedded",
        })

    def weight_version(self) -> None:
        self._send(HTTPStatus.OK, {"weight_version": self.server.app.engine.weight_version})

    def generate(self) -> None:
        app = self.server.app
        body = self._read_json()
        parsed = parse_generate_body(body, app._limits(), app.config)
        if not app.wait_unpaused():
            self._error(HTTPStatus.SERVICE_UNAVAILABLE, "server is shutting down")
            return
        job = _Job(parsed)
        app.batcher.submit(job)
        job.done.wait()
        if job.error is not None:
            status = HTTPStatus.SERVICE_UNAVAILABLE if "shutting down" in job.error else HTTPStatus.INTERNAL_SERVER_ERROR
            self._error(status, job.error)
            return
        outputs: list[dict] = []
        if job.aborted is not None:
            version = app.engine.weight_version
            for prompt, sp, rid in zip(parsed.prompts, parsed.params, parsed.rids):
                outputs += [_aborted_output(prompt, _sample_rid(rid, j, sp.n), version, job.aborted,
                                            parsed.return_logprob) for j in range(sp.n)]
        else:
            routed = parsed.return_routed_experts and app.routed_experts_enabled
            samples = iter(job.samples or [])
            for rid, sp in zip(parsed.rids, parsed.params):
                for j in range(sp.n):
                    outputs.append(sample_to_output(next(samples), _sample_rid(rid, j, sp.n),
                                                    return_logprob=parsed.return_logprob,
                                                    return_routed_experts=routed))
        single_output = parsed.single and parsed.params[0].n == 1
        self._send(HTTPStatus.OK, outputs[0] if single_output else outputs)

    def update_weights_from_disk(self) -> None:
        app = self.server.app
        body = self._read_json()
        if not isinstance(body, dict):
            raise BadRequest("the request body must be a JSON object")
        unknown = sorted(set(body) - UPDATE_FROM_DISK_FIELDS)
        if unknown:
            raise BadRequest(f"unsupported fields {unknown}; supported: {sorted(UPDATE_FROM_DISK_FIELDS)}")
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
        with app.engine_lock:  # waits for the running batch: no sample mixes versions
            target = version if version is not None else app.engine.weight_version
            try:
                app.engine.update_weights_from_disk(path, target)
            except Exception as e:
                log.exception("update_weights_from_disk(%s) failed", path)
                self._send(HTTPStatus.BAD_REQUEST, {"success": False, "num_paused_requests": 0,
                                                    "message": f"Failed to load weights from {path}: "
                                                               f"{type(e).__name__}: {e}"})
                return
            if flush:
                app.engine.flush_cache()
        self._send(HTTPStatus.OK, {"success": True, "num_paused_requests": 0,
                                   "message": f"Succeeded to update model weights. Weight version updated to {target}."})

    def update_weight_version(self) -> None:
        app = self.server.app
        body = self._read_json()
        if not isinstance(body, dict) or not isinstance(body.get("new_version"), str):
            raise BadRequest("'new_version' (a string) is required")
        unknown = sorted(set(body) - {"new_version", "abort_all_requests", "rid"})
        if unknown:
            raise BadRequest(f"unsupported fields {unknown}")
        with app.engine_lock:
            app.engine.set_weight_version(body["new_version"])
        self._send(HTTPStatus.OK, {"success": True, "new_version": body["new_version"],
                                   "message": f"Weight version updated to {body['new_version']}"})

    def flush_cache(self) -> None:
        app = self.server.app
        self._read_json()
        with app.engine_lock:
            app.engine.flush_cache()
        self._send(HTTPStatus.OK, text="Cache flushed.\n")

    def pause_generation(self) -> None:
        body = self._read_json()
        if not isinstance(body, dict):
            raise BadRequest("the request body must be a JSON object")
        mode = body.get("mode", "abort")
        if mode not in ("abort", "retract", "in_place"):
            raise BadRequest(f"'mode' must be abort, retract or in_place, got {mode!r}")
        aborted = self.server.app.pause(mode)
        self._send(HTTPStatus.OK, {"message": "Generation paused successfully.", "status": "ok",
                                   "num_aborted_requests": aborted})

    def continue_generation(self) -> None:
        self._read_json()
        self.server.app.resume()
        self._send(HTTPStatus.OK, {"message": "Generation continued successfully.", "status": "ok"})


def _drain(stream: Any, length: int, chunk: int = 1 << 20) -> None:
    while length > 0:
        got = stream.read(min(chunk, length))
        if not got:
            return
        length -= len(got)


def _sample_rid(rid: str, j: int, n: int) -> str:
    return rid if n == 1 else f"{rid}_{j}"


_GET_ROUTES = {
    "/health": _Handler.health,
    "/health_generate": _Handler.health_generate,
    "/model_info": _Handler.model_info,
    "/get_model_info": _Handler.model_info,
    "/server_info": _Handler.server_info,
    "/get_server_info": _Handler.server_info,
    "/weight_version": _Handler.weight_version,
    "/get_weight_version": _Handler.weight_version,
    "/flush_cache": _Handler.flush_cache,
}
_POST_ROUTES = {
    "/generate": _Handler.generate,
    "/update_weights_from_disk": _Handler.update_weights_from_disk,
    "/update_weight_version": _Handler.update_weight_version,
    "/flush_cache": _Handler.flush_cache,
    "/pause_generation": _Handler.pause_generation,
    "/continue_generation": _Handler.continue_generation,
}


def start_in_thread(engine: RolloutEngine, host: str = "127.0.0.1", port: int = 0,
                    config: ServerConfig = ServerConfig()) -> EmbeddedServer:
    """Serve `engine` from background threads; port 0 picks a free port (see `.url`)."""
    return EmbeddedServer(engine, host, port, config).start()


def serve_forever(engine: RolloutEngine, host: str = "127.0.0.1", port: int = 0,
                  config: ServerConfig = ServerConfig(), *, ready: Any = None) -> None:
    """Serve until SIGINT/SIGTERM, then shut down gracefully. Call from the main thread.

    `ready`, if given, is called with the running server (e.g. to print or write the bound port).
    """
    server = start_in_thread(engine, host, port, config)
    stop = threading.Event()

    def _on_signal(signum: int, _frame: Any) -> None:
        log.info("signal %d: shutting down", signum)
        stop.set()

    previous = {s: signal.signal(s, _on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        if ready is not None:
            ready(server)
        while not stop.wait(0.5):
            pass
    finally:
        server.shutdown()
        for s, h in previous.items():
            signal.signal(s, h)
