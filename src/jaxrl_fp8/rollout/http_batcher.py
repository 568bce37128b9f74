"""The server's batcher: concurrent /generate requests become one `engine.generate` call.

One thread takes the queued jobs: the first waits up to `ServerConfig.max_wait_s` for company, a batch holds
at most `max_batch_prompts` prompts, each prompt keeps its own sampling params, and the engine runs under
the engine lock (which weight updates also take, so a sample never mixes two versions). An engine error
fails that batch's jobs and the batcher keeps serving.
"""

from __future__ import annotations

import logging
import threading
import time

from jaxrl_fp8.rollout.http_schema import ParsedGenerate, ServerConfig
from jaxrl_fp8.rollout.types import RolloutEngine, Sample

log = logging.getLogger(__name__)


class Job:
    """One parsed /generate request waiting for its samples (or for an abort or error message)."""

    def __init__(self, parsed: ParsedGenerate):
        self.parsed = parsed
        self.done = threading.Event()
        self.samples: list[Sample] | None = None
        self.aborted: str | None = None
        self.error: str | None = None

    @property
    def num_prompts(self) -> int:
        return len(self.parsed.prompts)


class Batcher:
    """One thread; merges queued jobs into one `engine.generate` call under the engine lock."""

    def __init__(self, engine: RolloutEngine, engine_lock: threading.Lock, config: ServerConfig):
        self.engine = engine
        self.engine_lock = engine_lock
        self.config = config
        self._queue: list[Job] = []
        self._cond = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="rollout-batcher", daemon=True)
        self.batches_run = 0
        self.prompts_run = 0

    def start(self) -> None:
        self._thread.start()

    def submit(self, job: Job) -> None:
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

    def _take_batch(self) -> list[Job]:
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

    def _run(self, batch: list[Job]) -> None:
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
