"""The service's engine loop: one thread owns the model and runs continuous batching.

Jobs wait in a bounded queue; between chunks the loop drops cancelled and timed-out jobs,
admits queued ones while the row budget allows (first come, first served), and decodes one
chunk of every running batch. A context longer than one prefill slice that would join a running
batch is prefilled in pieces first, one slice into the context store between chunks
(`DirectedBeamSearch.prefill_ahead`), so that the running requests wait at most one slice for it (one batch per config, the
budget apart: all requests of a batch share its settings, each with its own `max_new_tokens`,
`logprobs` count, temperature, top_p, penalties and logit bias (`DBSConfig.batched`), so requests
with other settings take turns chunk by chunk). At a boundary where requests have
just ended, it first waits up to `admit_wait` seconds for their clients' next requests
(`_await_returns`). A job leaves with its result when its request ends. Events go back to the asyncio side through `Job.send`; the loop never blocks
on a client. The HTTP layer is `dbs_fast.serving.service`; this module knows nothing of HTTP.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field

from ..api import Batch, DirectedBeamSearch
from ..config import DBSConfig
from ..kv.decoder import PREFILL_SLICE
from ..search.beam import Request
from ..text import occurrence


@dataclass(eq=False)
class Job:
    request: Request
    config: DBSConfig
    send: callable               # send(kind, payload): thread-safe, never blocks
    stream: bool = False
    deadline: float = float("inf")
    submitted: float = field(default_factory=time.perf_counter)
    cancelled: str | None = None  # why: "disconnected", "timeout", "shutdown"
    chunks: int = 0
    ahead: bool = True            # its context may be prefilled in pieces before it joins

    @property
    def n_rows(self) -> int:
        return self.config.beams * self.config.candidates


class Batcher:
    """Continuous batching at chunk boundaries over one `DirectedBeamSearch`."""

    def __init__(self, dbs: DirectedBeamSearch, max_rows: int, max_queue: int, metrics=None, admit_wait: float = 0.0,
                 chunked_prefill: bool = True):
        self.dbs, self.max_rows, self.max_queue, self.admit_wait = dbs, max_rows, max_queue, admit_wait
        self.chunked_prefill = chunked_prefill
        self.metrics = metrics
        self.queue: deque[Job] = deque()
        self.batches: dict[DBSConfig, Batch] = {}
        self.jobs: dict[int, Job] = {}            # id(request) -> job, for the jobs in a batch
        self.cond = threading.Condition()
        self.stopping = False
        self.latencies: deque[float] = deque(maxlen=50)
        self.seconds = {"wait": 0.0, "admit": 0.0, "decode": 0.0}   # the engine thread's time, by what it did
        self.thread = threading.Thread(target=self._loop, name="dbs-fast-engine", daemon=True)
        self.thread.start()

    # -- the asyncio side ---------------------------------------------------------------------
    def submit(self, job: Job) -> bool:
        """Queue `job`; False when the queue is full (or the server is stopping)."""
        if job.n_rows > self.max_rows:
            raise ValueError(f"a request of {job.n_rows} rows can never fit max_rows={self.max_rows}")
        with self.cond:
            if self.stopping or len(self.queue) >= self.max_queue:
                return False
            self.queue.append(job)
            self._gauges()
            self.cond.notify()
        return True

    def cancel(self, job: Job, why: str) -> None:
        """The job's rows leave at the next chunk boundary (or it never starts)."""
        with self.cond:
            job.cancelled = job.cancelled or why
            self.cond.notify()

    def retry_after(self) -> int:
        """Seconds a refused client should wait: about one recent request's latency."""
        recent = list(self.latencies)
        return max(1, round(sum(recent) / len(recent))) if recent else 1

    @property
    def queue_depth(self) -> int:
        return len(self.queue)

    @property
    def n_rows(self) -> int:
        return sum(b.n_rows for b in self.batches.values())

    def stop(self, grace: float) -> None:
        """Take no new jobs; finish the running ones for up to `grace` seconds, then cancel the
        rest (each gets a "shutdown" error event), and end the loop."""
        with self.cond:
            self.stopping = True
            self.cond.notify()
        self.thread.join(grace)
        with self.cond:
            for job in list(self.queue) + list(self.jobs.values()):
                job.cancelled = job.cancelled or "shutdown"
            self.cond.notify()
        self.thread.join(30)

    # -- the engine thread --------------------------------------------------------------------
    def _loop(self) -> None:
        ended = 0                                   # requests that ended at the last boundary
        while True:
            with self.cond:
                while not (self.queue or self.batches or self.stopping):
                    self.cond.wait()
                t0 = time.perf_counter()
                self._await_returns(ended)
                if self.stopping and not self.batches and not self.queue:
                    return
                admit, ahead = self._take_admissible()
            t1 = time.perf_counter()
            self._drop_cancelled()
            self._admit(admit)
            if ahead is not None:                   # one slice of a long context, then the chunk
                try:
                    ahead.ahead = self.dbs.prefill_ahead(ahead.request)
                except Exception:                   # noqa: BLE001 -- its admission prefills it whole (or fails it)
                    ahead.ahead = False
            t2 = time.perf_counter()
            ended = sum(self._step(cfg) for cfg in list(self.batches))
            self._gauges()
            for what, dt in zip(self.seconds, (t1 - t0, t2 - t1, time.perf_counter() - t2)):
                self.seconds[what] += dt

    def _await_returns(self, ended: int) -> None:
        """A client that waits for its result before it sends its next request (a pipeline, a
        worker pool: a closed loop) sends it soon after its request ends (over loopback HTTP, with
        its build, 5-65 ms later: docs/design/batching.md), which is after the loop has started
        the next chunk, so its rows would stay empty for a whole chunk. At a boundary where `ended`
        requests ended, wait up to `admit_wait` seconds for as many to be queued (the batching
        delay of Triton's `max_queue_delay`, Ray Serve's `batch_wait_timeout_s`); return as soon
        as they are there. Called holding `cond`."""
        if not ended:
            return
        t0 = time.perf_counter()
        end = t0 + self.admit_wait
        while len(self.queue) < ended and not self.stopping:
            left = end - time.perf_counter()
            if left <= 0:
                break
            self.cond.wait(left)
        if self.metrics:
            self.metrics.admit_wait(time.perf_counter() - t0, len(self.queue) >= ended)

    def _take_admissible(self) -> tuple[list[Job], Job | None]:
        """Queued jobs that fit the row budget, in order (the first that does not fit waits, and
        so does everything behind it: no starvation of large requests); and the job whose context
        to prefill a piece of first, when it would join running requests with more than one
        prefill slice to compute (it and those behind it wait)."""
        out, free = [], self.max_rows - self.n_rows
        while self.queue:
            job = self.queue[0]
            if job.cancelled is None and time.perf_counter() > job.deadline:
                job.cancelled = "timeout"
            if job.cancelled:
                self.queue.popleft()
                self._finish(job, "error", self._cancel_error(job))
                continue
            if job.n_rows > free:
                break
            if (job.ahead and self.chunked_prefill and self.batches
                    and self.dbs.prefill_left(job.request) > PREFILL_SLICE):
                return out, job
            free -= job.n_rows
            out.append(self.queue.popleft())
        return out, None

    def _admit(self, jobs: list[Job]) -> None:
        by_cfg: dict[DBSConfig, list[Job]] = {}
        for job in jobs:
            by_cfg.setdefault(job.config.batched, []).append(job)   # budget, logprobs, sampling: the request's
        for cfg, group in by_cfg.items():
            batch = self.batches.get(cfg) or self.dbs.batch(cfg)
            try:
                batch.admit([j.request for j in group])
            except Exception as e:            # noqa: BLE001 -- one bad admission fails its jobs only
                for j in group:
                    self._finish(j, "error", (500, f"admission failed: {type(e).__name__}: {e}"))
                if not batch.requests:
                    self.batches.pop(cfg, None)
                continue
            self.batches[cfg] = batch
            for j in group:
                self.jobs[id(j.request)] = j

    def _drop_cancelled(self) -> None:
        now = time.perf_counter()
        for cfg, batch in list(self.batches.items()):
            gone = []
            for r in batch.requests:
                job = self.jobs[id(r)]
                if job.cancelled is None and now > job.deadline:
                    job.cancelled = "timeout"
                if job.cancelled:
                    gone.append(r)
            if gone:
                batch.drop(gone)
                for r in gone:
                    job = self.jobs.pop(id(r))
                    self._finish(job, "error", self._cancel_error(job))
            if not batch.requests:
                del self.batches[cfg]

    def _step(self, cfg: DBSConfig) -> int:
        """One chunk of the batch of `cfg`; returns how many of its requests ended."""
        batch = self.batches[cfg]
        before, t0, moved = batch.candidate_tokens, time.perf_counter(), self._moved()
        try:
            done = batch.decode_chunk()
            def streamed(r):
                return self.jobs[id(r)].stream
            partial = batch.certain_tokens(streamed)
        except Exception as e:                # noqa: BLE001 -- the loop survives; this batch's jobs fail
            for r in batch.requests:
                self._finish(self.jobs.pop(id(r)), "error", (500, f"generation failed: {type(e).__name__}: {e}"))
            del self.batches[cfg]
            return 0
        if self.metrics:
            self.metrics.chunk(time.perf_counter() - t0, batch.candidate_tokens - before, self._moved() - moved)
        for r, text, tokens in partial:
            job = self.jobs[id(r)]
            job.chunks += 1
            event = {"chunk": job.chunks, "text": text,
                     "found": [k.text for k in r.keywords if occurrence.count(text, k, rule=cfg.match) > 0]}
            if tokens is not None:
                event["logprobs"] = tokens               # the certain tokens', as the result's `logprobs`
            job.send("chunk", event)
        for r, result in done:
            job = self.jobs.pop(id(r))
            self.latencies.append(time.perf_counter() - job.submitted)
            self._finish(job, "result", result)                    # a GenerationResult: serialised at the endpoint
        if not batch.requests:
            del self.batches[cfg]
        return len(done)

    def _moved(self) -> int:
        """Bytes the generator's decode graph has bound from host memory so far (0 on the row layout)."""
        decoder = getattr(self.dbs, "decoder", None)
        return decoder.host_bytes_total if decoder is not None else 0

    def _finish(self, job: Job, kind: str, payload) -> None:
        job.send(kind, payload)
        if kind == "result":
            self._count("ok", time.perf_counter() - job.submitted)
        else:
            self._count(job.cancelled or "error")

    @staticmethod
    def _cancel_error(job: Job) -> tuple[int, str]:
        return {"timeout": (504, "the request timed out"), "shutdown": (503, "the server is shutting down"),
                "disconnected": (499, "the client disconnected")}.get(job.cancelled, (500, str(job.cancelled)))

    def _count(self, status: str, latency: float | None = None) -> None:
        if self.metrics:
            self.metrics.finished(status, latency)

    def _gauges(self) -> None:
        if self.metrics:
            self.metrics.gauges(len(self.queue), self.n_rows, len(self.batches))
