"""A fleet of SGLang (or `jaxrl_fp8.serve`) servers behind one `RolloutEngine`.

Guarantees of `SGLangFleet.generate`:
- every request completes exactly once: results are keyed by the request's slot in the batch, a
  request is in flight on at most one server at a time, and a late duplicate is dropped;
- a server that fails (connection refused/reset, timeout, 5xx after the client's own retries) is
  taken out, its in-flight requests are re-sent to the live servers, and it is re-probed later; it
  comes back only once its weight version equals the fleet's (re-loading the current checkpoint if
  needed), so a recovered server can never serve a stale version;
- aborted requests (SGLang's `/pause_generation` in "abort" mode, used by weight sync) are re-sent,
  so no sample spans two weight versions;
- a request the server rejects (4xx) or a server without routed-expert support fails the whole
  rollout at once with a clear error; so does a fleet with no live server left.

Load balancing: least outstanding requests, ties broken round robin. Seeded requests with n > 1 are
split into n single-sample requests with seeds `sample_seed(seed, j)` (same tokens, better spread).
"""

from __future__ import annotations

import dataclasses
import heapq
import logging
import threading
import time
import uuid
from collections import Counter, deque
from collections.abc import Iterable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any

from tqdm.auto import tqdm

from jaxrl_fp8.rollout.sglang_client import (
    RetryPolicy,
    RoutedExpertsUnsupported,
    SGLangClient,
    SGLangError,
    ServerUnavailable,
)
from jaxrl_fp8.rollout.types import GenerateRequest, ModelInfo, Sample, SamplingParams, per_prompt_sampling
from jaxrl_fp8.rollout.weight_sync import WeightSyncConfig, WeightSyncError, WeightSynchronizer

log = logging.getLogger(__name__)


class AllServersDead(SGLangError):
    """No server of the fleet answered for `all_dead_timeout_s`."""


class RolloutFailed(SGLangError):
    """A request could not be completed (rejected by a server, or failed too many times)."""


@dataclasses.dataclass(frozen=True)
class FleetConfig:
    max_in_flight_per_server: int = 32
    request_timeout_s: float = 600.0
    connect_timeout_s: float = 5.0
    # Retries on the same server before the fleet declares it dead and fails the request over.
    client_retry: RetryPolicy = RetryPolicy(max_attempts=2, backoff_base_s=0.2, backoff_max_s=2.0)
    max_failures_per_request: int = 6  # server failures one request may see before the rollout fails
    max_aborts_per_request: int = 32  # aborted answers (pauses) one request may see
    abort_backoff_s: float = 0.05
    reprobe_interval_s: float = 5.0
    probe_timeout_s: float = 2.0
    all_dead_timeout_s: float = 30.0
    split_seeded_samples: bool = True
    show_progress: bool = True
    sync: WeightSyncConfig = WeightSyncConfig(unreachable="exclude")

    def __post_init__(self) -> None:
        if self.max_in_flight_per_server < 1:
            raise ValueError(f"FleetConfig.max_in_flight_per_server must be >= 1, got {self.max_in_flight_per_server}")
        if self.max_failures_per_request < 1:
            raise ValueError(f"FleetConfig.max_failures_per_request must be >= 1, got {self.max_failures_per_request}")


@dataclasses.dataclass
class RolloutStats:
    """What happened during the last `generate` call (for logs and tests)."""

    requests: int = 0
    samples: int = 0
    sends: int = 0
    resent_after_failure: int = 0
    resent_after_abort: int = 0
    duplicates_dropped: int = 0
    servers_marked_dead: list[str] = dataclasses.field(default_factory=list)
    completed_per_server: Counter = dataclasses.field(default_factory=Counter)
    elapsed_s: float = 0.0


class _Server:
    def __init__(self, client: SGLangClient):
        self.client = client
        self.alive = True
        self.last_error = ""
        self.next_probe_at = 0.0
        self.probing = False
        self._outstanding = 0
        self._lock = threading.Lock()

    @property
    def url(self) -> str:
        return self.client.url

    @property
    def outstanding(self) -> int:
        with self._lock:
            return self._outstanding

    def track(self, future: Future) -> None:
        """Count `future` as outstanding until it finishes, even if the rollout that sent it is gone."""
        with self._lock:
            self._outstanding += 1
        future.add_done_callback(self._done)

    def _done(self, _: Future) -> None:
        with self._lock:
            self._outstanding -= 1


class SGLangFleet:
    """N servers, one `RolloutEngine`. Use as a context manager or call `close()`."""

    def __init__(
        self,
        urls: Sequence[str],
        *,
        config: FleetConfig = FleetConfig(),
        routed_experts_shape: tuple[int, int] | None = None,
        current_checkpoint: str | None = None,
        clock: Any = time.monotonic,
    ):
        if not urls:
            raise ValueError("SGLangFleet needs at least one server URL")
        if len(set(urls)) != len(urls):
            raise ValueError(f"duplicate server URLs: {sorted(u for u, c in Counter(urls).items() if c > 1)}")
        self.config = config
        self._servers = [
            _Server(
                SGLangClient(
                    u,
                    request_timeout_s=config.request_timeout_s,
                    connect_timeout_s=config.connect_timeout_s,
                    retry=config.client_retry,
                    routed_experts_shape=routed_experts_shape,
                )
            )
            for u in urls
        ]
        self._clock = clock
        self._rr = 0
        self._pool = ThreadPoolExecutor(
            max_workers=len(urls) * (config.max_in_flight_per_server + 1), thread_name_prefix="fleet"
        )
        self._generate_lock = threading.Lock()
        # The version every admitted server serves, and the checkpoint it came from (for re-sync).
        self.expected_weight_version: str | None = None
        self.current_checkpoint = current_checkpoint
        self.last_stats = RolloutStats()

    # -- lifecycle ------------------------------------------------------------------------------

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> SGLangFleet:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self._servers]

    @property
    def clients(self) -> list[SGLangClient]:
        return [s.client for s in self._servers]

    def live_servers(self) -> list[str]:
        return [s.url for s in self._servers if s.alive]

    # -- RolloutEngine --------------------------------------------------------------------------

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingParams | Sequence[SamplingParams],
        *,
        return_routed_experts: bool = False,
    ) -> list[Sample]:
        """`sampling_i.n` samples for each prompt, prompt-major, each produced exactly once."""
        params = per_prompt_sampling(sampling, len(prompts))
        requests = self._build_requests(prompts, params, return_routed_experts)
        with self._generate_lock:
            if return_routed_experts:
                self._check_routed_experts_support()
            stats = RolloutStats(requests=len(requests), samples=sum(r.sampling.n for r in requests))
            self.last_stats = stats
            start = self._clock()
            results = self._run(requests, stats)
            stats.elapsed_s = self._clock() - start
        return [s for i in range(len(requests)) for s in results[i]]

    def update_weights_from_disk(self, path: str, weight_version: str) -> None:
        """Versioned push to every live server (pause → update → verify → continue), see weight_sync."""
        live = [s for s in self._servers if s.alive]
        if not live:
            raise AllServersDead(f"no live server to push weights {weight_version} to: {self._describe_servers()}")
        sync = WeightSynchronizer(
            [s.client for s in live],
            config=self.config.sync,
            previous_checkpoint=self.current_checkpoint,
            previous_version=self.expected_weight_version,
        )
        try:
            report = sync.push_from_disk(path, weight_version)
        except WeightSyncError as e:
            for url in e.quarantine:
                self._mark_dead(self._server(url), f"quarantined after failed weight sync: {e}")
            raise
        for url, reason in report.excluded.items():
            self._mark_dead(self._server(url), f"unreachable during weight sync to {weight_version}: {reason}")
        self.current_checkpoint = path
        self.expected_weight_version = weight_version

    def update_weights(self, named_arrays: Iterable[tuple[str, Any]], weight_version: str) -> None:
        raise NotImplementedError(
            "SGLangFleet cannot take in-process arrays: write a checkpoint to a directory every server can "
            "read and call update_weights_from_disk, or use weight_sync.NcclWeightBroadcaster"
        )

    @property
    def weight_version(self) -> str:
        if self.expected_weight_version is not None:
            return self.expected_weight_version
        versions = {}
        for s in self._servers:
            if s.alive:
                try:
                    versions[s.url] = s.client.weight_version()
                except SGLangError as e:
                    self._mark_dead(s, str(e))
        distinct = set(versions.values())
        if len(distinct) > 1:
            raise RolloutFailed(f"servers report different weight versions: {versions}")
        if not distinct:
            raise AllServersDead(f"no live server to ask for its weight version: {self._describe_servers()}")
        return str(distinct.pop())

    def set_weight_version(self, weight_version: str) -> None:
        for s in self._servers:
            if s.alive:
                s.client.update_weight_version(weight_version)
        self.expected_weight_version = weight_version

    def health(self) -> bool:
        return any(self.check_health().values())

    def check_health(self) -> dict[str, bool]:
        """Probe every server now (re-admitting recovered ones); url → alive."""
        futures = {self._pool.submit(self._probe, s): s for s in self._servers}
        for fut, server in futures.items():
            ok, reason = fut.result()
            if ok and not server.alive:
                log.info("server %s is back", server.url)
            if ok:
                server.alive = True
            else:
                self._mark_dead(server, reason)
        return {s.url: s.alive for s in self._servers}

    def model_info(self) -> ModelInfo:
        for s in self._servers:
            if not s.alive:
                continue
            try:
                info = s.client.model_info()
            except SGLangError as e:
                self._mark_dead(s, str(e))
                continue
            shape = s.client.routed_experts_shape() or (0, 0)
            return ModelInfo(
                model_path=str(info.get("model_path", "")),
                weight_version=str(info.get("weight_version")),
                vocab_size=int(info.get("vocab_size", 0) or 0),
                num_hidden_layers=shape[0],
                num_experts_per_tok=shape[1],
                max_total_tokens=int(info.get("max_total_tokens", 0) or 0),
                supports_routed_experts=bool(s.client.server_info().get("enable_return_routed_experts", False)),
            )
        raise AllServersDead(f"no live server: {self._describe_servers()}")

    def flush_cache(self) -> None:
        for s in self._servers:
            if s.alive:
                s.client.flush_cache()

    def pause(self) -> None:
        for s in self._servers:
            if s.alive:
                s.client.pause_generation("abort")

    def resume(self) -> None:
        for s in self._servers:
            if s.alive:
                s.client.continue_generation()

    # -- internals ------------------------------------------------------------------------------

    def _server(self, url: str) -> _Server:
        for s in self._servers:
            if s.url == url:
                return s
        raise KeyError(url)

    def _describe_servers(self) -> str:
        return "; ".join(f"{s.url} ({'alive' if s.alive else 'dead: ' + s.last_error})" for s in self._servers)

    def _check_routed_experts_support(self) -> None:
        for s in self._servers:
            if not s.alive:
                continue
            try:
                s.client.check_routed_experts_support()
            except RoutedExpertsUnsupported:
                raise
            except SGLangError as e:
                self._mark_dead(s, str(e))

    def _build_requests(
        self, prompts: Sequence[Sequence[int]], params: list[SamplingParams], routed: bool
    ) -> list[GenerateRequest]:
        batch = uuid.uuid4().hex[:12]
        requests: list[GenerateRequest] = []
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            ids = tuple(int(t) for t in prompt)
            if not ids:
                raise ValueError(f"prompt {i} is empty")
            if p.seed is not None and p.n > 1 and self.config.split_seeded_samples:
                for j in range(p.n):
                    requests.append(GenerateRequest(len(requests), ids, p.for_sample(j), f"{batch}-{i}-{j}",
                                                    routed, prompt_index=i, first_sample_index=j))
            else:
                requests.append(GenerateRequest(len(requests), ids, p, f"{batch}-{i}", routed, prompt_index=i))
        return requests

    def _pick(self) -> _Server | None:
        candidates = [s for s in self._servers if s.alive and s.outstanding < self.config.max_in_flight_per_server]
        if not candidates:
            return None
        least = min(s.outstanding for s in candidates)
        tied = [s for s in candidates if s.outstanding == least]
        self._rr += 1
        return tied[self._rr % len(tied)]

    def _mark_dead(self, server: _Server, reason: str) -> None:
        if server.alive:
            log.warning("taking server %s out of the fleet: %s", server.url, reason)
            self.last_stats.servers_marked_dead.append(server.url)
        server.alive = False
        server.last_error = reason
        server.next_probe_at = self._clock() + self.config.reprobe_interval_s

    def _probe(self, server: _Server) -> tuple[bool, str]:
        """Health + version check; re-loads the fleet's checkpoint on a server that missed a push."""
        client = server.client
        if not client.health(timeout_s=self.config.probe_timeout_s):
            return False, "health check failed"
        expected = self.expected_weight_version
        if expected is None:
            return True, ""
        try:
            version = client.weight_version(timeout_s=self.config.probe_timeout_s, retry=RetryPolicy(max_attempts=1))
            if version != expected and self.current_checkpoint is not None:
                log.info("re-syncing %s from %s to %s (%s)", server.url, version, expected, self.current_checkpoint)
                client.update_weights_from_disk(self.current_checkpoint, weight_version=expected,
                                                retry=RetryPolicy(max_attempts=1))
                version = client.weight_version(timeout_s=self.config.probe_timeout_s)
        except SGLangError as e:
            return False, f"version check failed: {e}"
        if version != expected:
            return False, f"serves weight version {version!r}, fleet is on {expected!r}"
        return True, ""

    def _start_probes(self, probes: dict[Future, _Server]) -> None:
        now = self._clock()
        for s in self._servers:
            if not s.alive and not s.probing and s.next_probe_at <= now:
                s.probing = True
                probes[self._pool.submit(self._probe, s)] = s

    def _finish_probe(self, server: _Server, future: Future) -> None:
        server.probing = False
        try:
            ok, reason = future.result()
        except Exception as e:  # a probe must never kill the rollout
            ok, reason = False, f"probe raised {type(e).__name__}: {e}"
        if ok:
            log.info("server %s is back in the fleet", server.url)
            server.alive = True
        else:
            server.last_error = reason
            server.next_probe_at = self._clock() + self.config.reprobe_interval_s

    def _run(self, requests: list[GenerateRequest], stats: RolloutStats) -> dict[int, list[Sample]]:
        cfg = self.config
        pending: deque[int] = deque(range(len(requests)))
        delayed: list[tuple[float, int]] = []  # (not before, index): re-sends after an abort
        in_flight: dict[Future, tuple[int, _Server]] = {}
        probes: dict[Future, _Server] = {}
        results: dict[int, list[Sample]] = {}
        sends: Counter = Counter()
        failures: Counter = Counter()
        aborts: Counter = Counter()
        all_dead_since: float | None = None
        bar = tqdm(total=stats.samples, desc="rollout", unit="sample", disable=not cfg.show_progress, leave=False)
        try:
            while len(results) < len(requests):
                now = self._clock()
                while delayed and delayed[0][0] <= now:
                    pending.append(heapq.heappop(delayed)[1])
                self._start_probes(probes)
                while pending:
                    server = self._pick()
                    if server is None:
                        break
                    idx = pending.popleft()
                    sends[idx] += 1
                    stats.sends += 1
                    req = requests[idx]
                    fut = self._pool.submit(server.client.generate, req, wire_rid=f"{req.rid}.a{sends[idx]}",
                                            retry=cfg.client_retry)
                    server.track(fut)
                    in_flight[fut] = (idx, server)

                if any(s.alive for s in self._servers):
                    all_dead_since = None
                else:
                    all_dead_since = now if all_dead_since is None else all_dead_since
                    if not in_flight and now - all_dead_since > cfg.all_dead_timeout_s:
                        raise AllServersDead(
                            f"every server of the fleet is down ({len(results)}/{len(requests)} requests done): "
                            f"{self._describe_servers()}"
                        )

                if not (pending or delayed or in_flight):
                    lost = sorted(set(range(len(requests))) - set(results))
                    raise AssertionError(f"fleet lost track of requests {lost[:10]}")  # a bug, never a state
                waitables = list(in_flight) + list(probes)
                if not waitables:
                    time.sleep(0.05)
                    continue
                done, _ = wait(waitables, timeout=0.25, return_when=FIRST_COMPLETED)
                for fut in done:
                    if fut in probes:
                        self._finish_probe(probes.pop(fut), fut)
                        continue
                    idx, server = in_flight.pop(fut)
                    req = requests[idx]
                    exc = fut.exception()
                    if exc is None:
                        samples = fut.result()
                        if any(s.finish_reason == "abort" for s in samples):
                            aborts[idx] += 1
                            stats.resent_after_abort += 1
                            if aborts[idx] > cfg.max_aborts_per_request:
                                raise RolloutFailed(
                                    f"request {req.rid} (prompt {req.prompt_index}) was aborted {aborts[idx]} times; "
                                    f"last by {server.url}"
                                )
                            heapq.heappush(delayed, (self._clock() + cfg.abort_backoff_s, idx))
                        elif idx in results:
                            stats.duplicates_dropped += 1
                        else:
                            results[idx] = samples
                            stats.completed_per_server[server.url] += 1
                            bar.update(len(samples))
                    elif isinstance(exc, ServerUnavailable):
                        self._mark_dead(server, str(exc))
                        failures[idx] += 1
                        stats.resent_after_failure += 1
                        if failures[idx] >= cfg.max_failures_per_request:
                            raise RolloutFailed(
                                f"request {req.rid} (prompt {req.prompt_index}) failed {failures[idx]} times; "
                                f"last on {server.url}: {exc}"
                            ) from exc
                        pending.appendleft(idx)
                    elif isinstance(exc, RoutedExpertsUnsupported):
                        raise exc
                    else:
                        raise RolloutFailed(
                            f"request {req.rid} (prompt {req.prompt_index}) failed on {server.url}: {exc}"
                        ) from exc
        finally:
            bar.close()
        return results
