"""Any `RolloutEngine` behind the subset of SGLang's HTTP API that RL uses (stdlib only).

So a JAX rollout fleet runs as separate processes and `SGLangClient`/`SGLangFleet` drive it exactly
like SGLang. Endpoints: POST /generate, /update_weights_from_disk, /update_weight_version,
/pause_generation, /continue_generation, /flush_cache (also GET); GET /health, /health_generate,
/model_info, /server_info, /weight_version (plus SGLang's older /get_* aliases).

- Concurrent /generate requests are queued and run as one engine call (`http_batcher`).
- Requests are validated before they reach the engine (`http_schema`, the one place): malformed JSON,
  unknown fields, wrong types, out-of-vocabulary ids, prompt + max_new_tokens over the engine's limit and
  oversize bodies get a 4xx JSON error naming the field; the server stays up.
- Weight updates take the engine lock, so they wait for the running batch: a sample never mixes two
  versions. /pause_generation blocks new generation until /continue_generation; in "abort" mode the
  queued (not yet running) requests are answered at once with finish_reason abort.
- Routed experts go out base64 like SGLang's, only when the request asks for them and the server was
  started with `enable_return_routed_experts` (else the field is absent, as with SGLang).
"""

from __future__ import annotations

import json
import logging
import signal
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from jaxrl_fp8.rollout.http_batcher import Batcher, Job
from jaxrl_fp8.rollout.http_schema import (
    BadRequest,
    ParsedGenerate,
    ServerConfig,
    aborted_output,
    error_body,
    parse_generate_body,
    parse_pause_mode,
    parse_update_from_disk,
    parse_update_weight_version,
    sample_rid,
    sample_to_output,
)
from jaxrl_fp8.rollout.types import ModelInfo, RolloutEngine, SamplingParams

__all__ = ["EmbeddedServer", "ServerConfig", "serve_forever", "start_in_thread"]

log = logging.getLogger(__name__)


class EmbeddedServer:
    """A `RolloutEngine` served over HTTP. `start()` runs it in background threads."""

    def __init__(self, engine: RolloutEngine, host: str = "127.0.0.1", port: int = 0,
                 config: ServerConfig = ServerConfig()):
        self.engine = engine
        self.config = config
        self.engine_lock = threading.Lock()
        self.batcher = Batcher(engine, self.engine_lock, config)
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
        job = Job(parsed)
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
        job = Job(parsed)
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
                outputs += [aborted_output(prompt, sample_rid(rid, j, sp.n), version, job.aborted,
                                            parsed.return_logprob) for j in range(sp.n)]
        else:
            routed = parsed.return_routed_experts and app.routed_experts_enabled
            samples = iter(job.samples or [])
            for rid, sp in zip(parsed.rids, parsed.params):
                for j in range(sp.n):
                    outputs.append(sample_to_output(next(samples), sample_rid(rid, j, sp.n),
                                                    return_logprob=parsed.return_logprob,
                                                    return_routed_experts=routed))
        single_output = parsed.single and parsed.params[0].n == 1
        self._send(HTTPStatus.OK, outputs[0] if single_output else outputs)

    def update_weights_from_disk(self) -> None:
        app = self.server.app
        req = parse_update_from_disk(self._read_json())
        with app.engine_lock:  # waits for the running batch: no sample mixes versions
            target = req.weight_version if req.weight_version is not None else app.engine.weight_version
            try:
                app.engine.update_weights_from_disk(req.model_path, target)
            except Exception as e:
                log.exception("update_weights_from_disk(%s) failed", req.model_path)
                self._send(HTTPStatus.BAD_REQUEST, {"success": False, "num_paused_requests": 0,
                                                    "message": f"Failed to load weights from {req.model_path}: "
                                                               f"{type(e).__name__}: {e}"})
                return
            if req.flush_cache:
                app.engine.flush_cache()
        self._send(HTTPStatus.OK, {"success": True, "num_paused_requests": 0,
                                   "message": f"Succeeded to update model weights. Weight version updated to {target}."})

    def update_weight_version(self) -> None:
        app = self.server.app
        version = parse_update_weight_version(self._read_json())
        with app.engine_lock:
            app.engine.set_weight_version(version)
        self._send(HTTPStatus.OK, {"success": True, "new_version": version,
                                   "message": f"Weight version updated to {version}"})

    def flush_cache(self) -> None:
        app = self.server.app
        self._read_json()
        with app.engine_lock:
            app.engine.flush_cache()
        self._send(HTTPStatus.OK, text="Cache flushed.\n")

    def pause_generation(self) -> None:
        aborted = self.server.app.pause(parse_pause_mode(self._read_json()))
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
