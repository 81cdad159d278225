"""`dbs-fast serve`: the engine over HTTP, a layer on top of it (FastAPI + uvicorn).

FastAPI rather than bare Starlette: the request body is declared once as a pydantic model
(derived from `config.OPTIONS`, as the CLI flags are), so a wrong type or an unknown field is a
400 that names the field, and the OpenAPI page (/docs, /openapi.json) comes with it. Every error
of /v1/* has OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, on every endpoint.

Endpoints: POST /v1/generate (JSON, or Server-Sent Events with "stream": true), the OpenAI-compatible
GET /v1/models, POST /v1/completions and /v1/chat/completions (`dbs_fast.serving.openai_api`), GET /health,
GET /metrics (Prometheus text), GET /docs (Swagger UI from local files). One `Batcher` thread owns
the model (continuous batching at chunk boundaries, `dbs_fast.serving.batcher`); handlers only validate,
queue and wait. With an API key, /v1/* needs `Authorization: Bearer <key>`.
"""

import asyncio
import functools
import hmac
import json
import threading
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from typing import Literal, Optional, Union

from ..backend import SCHEDULES
from ..config import (
    DEFAULT_CONTEXT,
    JSON_NAMES,
    STREAM_LAG,
    TASKS,
    DBSConfig,
    door_name,
    door_words,
    preset,
)
from ..errors import DBSError
from ..kv.prefix_cache import KV_LAYOUTS
from . import openai_api as oa
from .batcher import Batcher, Job
from .bodies import body_config, fault, given_options, option_fields

SERVE_EXTRA = "pip install 'dbs-fast[serve]'"


@dataclass(frozen=True)
class ServiceOptions:
    model: str = "default"
    embeddings: str = "default"
    max_rows: int = 140            # rows decoded together: two paper-setting requests (b*s = 70) at once,
    #                                or 35 small ones (b = s = 2); a 70-row step is compute-bound on 2 cores
    max_queue: int = 64            # requests waiting beyond that are refused (429)
    threads: Optional[int] = None
    provider: str = "cpu"
    cuda_graph: bool = False       # with provider cuda: each decode step one captured CUDA graph (docs/guides/gpu.md)
    kv_layout: str = "auto"        # the prefix cache where the export has it (see DirectedBeamSearch)
    schedule: str = "distinct"     # distinct candidate histories computed once (see DirectedBeamSearch)
    timeout: float = 300.0         # per request, seconds (a request may ask for less)
    grace: float = 30.0            # at shutdown: seconds to finish running requests before cancelling them
    admit_wait: float = 0.1        # at a boundary where requests ended: seconds to wait for their clients' next
    #                                ones (closed-loop clients), so that they join this chunk, not the next;
    #                                over HTTP on loopback they came back in 30-65 ms (docs/design/batching.md)
    chunked_prefill: bool = True   # a long context joins a running batch one prefill slice per chunk boundary
    api_key: Optional[str] = None  # requests to /v1/* need `Authorization: Bearer <key>` (None: open)
    auth_health: bool = False      # /health and /metrics need the key too
    max_body_bytes: int = 1 << 20  # a larger request body is refused (413) before it is read
    cors_origins: tuple = ()       # origins allowed by CORS (none: no CORS headers)

    def __post_init__(self):
        for name in ("max_rows", "max_queue", "max_body_bytes"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise DBSError(f"`--{name.replace('_', '-')}` must be an integer >= 1, got {v!r}")
        if self.threads is not None and self.threads < 1:
            raise DBSError(f"`--threads` must be >= 1, got {self.threads}")
        if not self.timeout > 0:
            raise DBSError(f"`--timeout` must be > 0 seconds, got {self.timeout}")
        if not 0 <= self.admit_wait <= 1:
            raise DBSError(f"`--admit-wait` must be in 0..1 seconds, got {self.admit_wait}")

        if self.cuda_graph and self.provider != "cuda":
            raise DBSError("`--cuda-graph` needs --provider cuda")
        if self.kv_layout not in KV_LAYOUTS:
            raise DBSError(f"`--kv-layout` must be one of {KV_LAYOUTS}, got {self.kv_layout!r}")
        if self.schedule not in SCHEDULES:
            raise DBSError(f"`--schedule` must be one of {SCHEDULES}, got {self.schedule!r}")


# every error of /v1/*, /v1/generate's too, is OpenAI's shape: {"error": {"message", "type", "param", "code"}};
# bad input is a 400, as OpenAI answers an invalid request
INVALID = 400


@functools.cache
def request_model():
    """The body of POST /v1/generate: context, constraints, seed, stream, and every option of
    `dbs-fast generate` (`config.OPTIONS`), named like its flag. Unknown fields are refused."""
    from pydantic import Field, create_model

    fields = {
        "context": (Optional[str], Field(None, description=f"text to continue (empty: a new document; default "
                                                           f"{DEFAULT_CONTEXT!r}, or the task's context)")),
        "task": (Optional[Literal[TASKS]], Field(None, description="a task preset: commongen (one sentence "
                                                                   "from unordered concepts)")),
        "keywords": (Optional[Union[str, list[str]]], Field(None, description='"enemy,speed" or a list; "a|b" '
                                                                            'alternatives, spaces make a phrase; '
                                                                            "none: the model's own text")),
        "ban": (Optional[Union[str, list[str]]], Field(None, description="words that must not appear")),
        "seed": (int, Field(0, description="0..2**63-1; the same seed gives the same text")),
        "stream": (bool, Field(False, description="Server-Sent Events: one per chunk, then the result")),
        "paper": (bool, Field(False, description="start from the paper's settings instead of the default")),
        "unguided": (bool, Field(False, description="the baseline: no boosts")),
        "timeout": (Optional[float], Field(None, gt=0, description="seconds; at most the server's timeout option")),
    }
    return create_model("GenerateRequest", __config__=body_config(), **fields, **option_fields("json", JSON_NAMES))


class Metrics:
    """Prometheus metrics of one server (its own registry: several apps can live in a process)."""

    def __init__(self):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        r = self.registry = CollectorRegistry()
        self.requests = Counter("dbs_requests", "requests by final status (ok, invalid, refused, timeout, "
                                "disconnected, shutdown, error)", ["status"], registry=r)
        self.queue = Gauge("dbs_queue_depth", "requests waiting for rows", registry=r)
        self.rows = Gauge("dbs_batch_rows", "candidate rows in the running batches", registry=r)
        self.batches = Gauge("dbs_running_batches", "running batches: one per settings their requests share "
                             "(budgets, log-prob counts and sampling settings apart); several take turns chunk by chunk", registry=r)
        self.tokens = Counter("dbs_candidate_tokens", "candidate tokens sampled", registry=r)
        self.rate = Gauge("dbs_candidate_tokens_per_second", "candidate tokens/s of the last chunk", registry=r)
        self.moved = Counter("dbs_host_device_bytes", "bytes the decode graph bound from host memory (with "
                             "--provider cuda: copied between host and GPU; the prefix cache only)", registry=r)
        self.chunks = Histogram("dbs_chunk_seconds", "seconds per chunk of a running batch", registry=r,
                                buckets=(0.01, 0.03, 0.1, 0.3, 1, 3, 10, 30))
        self.store = None                  # the engine's ContextStore, once loaded (None: off)
        for name, what, stat in (("hits", "prefills that reused a stored context prefix", "hits"),
                                 ("lookups", "prefills that looked in the context store", "lookups"),
                                 ("reused_tokens", "context tokens taken from the store instead of prefilled",
                                  "reused_tokens"),
                                 ("context_tokens", "context tokens of the prefills that looked", "context_tokens"),
                                 ("bytes", "bytes the context store holds", "nbytes")):
            Gauge(f"dbs_context_cache_{name}", what, registry=r).set_function(
                lambda stat=stat: getattr(self.store, stat, 0))
        self.latency = Histogram("dbs_request_latency_seconds", "seconds from arrival to the result",
                                 registry=r, buckets=(0.1, 0.25, 0.5, 1, 2, 4, 8, 15, 30, 60, 120, 300))
        self.admit_waits = Histogram("dbs_admit_wait_seconds", "seconds the running batch waited at a boundary "
                                     "where requests ended, by whether as many new ones came in time "
                                     "(returned) or --admit-wait ran out (timeout)", ["outcome"], registry=r,
                                     buckets=(0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1))

    def finished(self, status: str, latency: float | None = None) -> None:
        self.requests.labels(status).inc()
        if latency is not None:
            self.latency.observe(latency)

    def chunk(self, seconds: float, tokens: int, moved: int = 0) -> None:
        self.tokens.inc(tokens)
        self.moved.inc(moved)
        self.rate.set(tokens / max(seconds, 1e-9))
        self.chunks.observe(seconds)

    def admit_wait(self, seconds: float, returned: bool) -> None:
        self.admit_waits.labels("returned" if returned else "timeout").observe(seconds)

    def gauges(self, queue: int, rows: int, batches: int) -> None:
        self.queue.set(queue)
        self.rows.set(rows)
        self.batches.set(batches)


class Service:
    """The engine behind the app: loads the model off the event loop, then runs the batcher."""

    def __init__(self, opts: ServiceOptions, dbs=None):
        self.opts, self.dbs, self.batcher = opts, None, None
        self.metrics = Metrics()
        self.error: str | None = None
        self._preloaded = dbs

    def start(self) -> None:
        threading.Thread(target=self._load, name="dbs-fast-load", daemon=True).start()

    def _load(self) -> None:
        from ..api import DirectedBeamSearch

        try:
            dbs = self._preloaded or DirectedBeamSearch(self.opts.model, self.opts.embeddings, threads=self.opts.threads,
                                                        provider=self.opts.provider, quiet=True,
                                                        kv_layout=self.opts.kv_layout, schedule=self.opts.schedule,
                                                        cuda_graph=self.opts.cuda_graph)
            dbs.word_piece, dbs.sentence_end                           # built once, before the first request
            dbs.generate(DEFAULT_CONTEXT, "day", config=DBSConfig(beams=1, candidates=1, max_new_tokens=8, stop="max"))  # warm-up
            self.metrics.store = dbs.decoder.store if dbs.decoder is not None else None
            self.batcher = Batcher(dbs, self.opts.max_rows, self.opts.max_queue, self.metrics, self.opts.admit_wait,
                                   self.opts.chunked_prefill)
            self.dbs = dbs
        except Exception as e:   # noqa: BLE001 -- reported by /health, the server stays up
            self.error = f"{type(e).__name__}: {e.in_cli() if isinstance(e, DBSError) else e}"   # the server's flags

    @property
    def ready(self) -> bool:
        return self.dbs is not None

    def stop(self) -> None:
        if self.batcher is not None:
            self.batcher.stop(self.opts.grace)

    # -- validation: every bad field a 400 that names it -------------------------------------
    def job(self, body) -> "Job":
        """A job from the body of POST /v1/generate."""
        given = given_options(body, "json", JSON_NAMES)
        if body.unguided:
            given["guided"] = False
        base, context = preset(body.task, body.paper)
        context = context if body.context is None else body.context
        return self.make_job(context, body.keywords, body.ban, body.seed, given, base, body.timeout, body.stream)

    def make_job(self, context, keywords, ban, seed, given: dict, base: DBSConfig, timeout=None,
                 stream: bool = False, door: str = "json", context_field: str = "context") -> "Job":
        """A job: `base` with the options `given` (DBSConfig field -> value; None = not given), the
        request built and checked. A DBSError names the field as `door` calls it
        (`config.door_name`; the context is `context_field` there)."""
        if stream and given.get("stream_lag") is None:
            given = {**given, "stream_lag": STREAM_LAG}        # a stream's text arrives as it is committed
        try:
            cfg = replace(base, **{k: v for k, v in given.items() if v is not None})
            request = self.dbs.request(context, keywords, ban, seed, cfg)
        except DBSError as e:
            name = "body" if not e.field else context_field if e.field == "context" else door_name(e.field, door)
            raise DBSError(door_words(e.said_as(f"`{name}`"), door), name, e.value) from None
        if cfg.beams * cfg.candidates > self.opts.max_rows:
            field = "beams" if cfg.beams > cfg.candidates else "candidates"     # the larger of the two
            raise DBSError(f"beams x candidates = {cfg.beams * cfg.candidates} rows, more than this server's "
                           f"limit of {self.opts.max_rows}", field, getattr(cfg, field))
        timeout = min(timeout or self.opts.timeout, self.opts.timeout)
        return Job(request, cfg, send=None, stream=stream, deadline=time.perf_counter() + timeout)


def _sse(kind: str, payload) -> str:
    return f"event: {kind}\ndata: {json.dumps(payload)}\n\n"


def create_app(opts: ServiceOptions | None = None, dbs=None):
    """The FastAPI app; `dbs`: an already built `DirectedBeamSearch` to serve (tests, Ray)."""
    try:
        from fastapi import FastAPI
        from starlette.concurrency import run_in_threadpool
    except ImportError as e:
        raise DBSError(f"the service needs the serve extra: {SERVE_EXTRA} (missing: {e.name})") from None
    opts = opts or ServiceOptions()
    ep = Endpoints(Service(opts, dbs))

    @asynccontextmanager
    async def lifespan(app):
        ep.svc.start()
        yield
        await run_in_threadpool(ep.svc.stop)

    app = FastAPI(title="dbs-fast", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None,
                  description="Directed Beam Search: text that contains the keywords you ask for.")
    app.state.service = ep.svc
    _guard(app, opts, ep.svc)
    _error_handlers(app, ep)
    _operations_routes(app, ep)
    _generation_routes(app, ep)
    return app


class Endpoints:
    """What the routes share: the service, the answers of refused requests (counted), and a
    job's way through the batcher to its response or stream."""

    def __init__(self, svc: Service):
        self.svc, self.opts = svc, svc.opts

    def refuse(self, status: int, label: str, detail, retry: int | None = None):
        from starlette.responses import JSONResponse

        self.svc.metrics.finished(label)
        headers = {"Retry-After": str(retry)} if retry is not None else None
        return JSONResponse(detail if isinstance(detail, dict) else {"detail": detail}, status, headers=headers)

    def openai_error(self, status: int, label: str, msg: str, param=None, retry: int | None = None):
        return self.refuse(status, label, oa.error_body(status, msg, param), retry)

    def submit(self, job, events=None, tag=None):
        """The job queued, with the queue its events arrive on (`events`, shared by a list's jobs,
        each event then led by the job's `tag`); None when the queue is full."""
        loop, events = asyncio.get_running_loop(), asyncio.Queue() if events is None else events
        lead = () if tag is None else (tag,)
        job.send = lambda kind, payload: loop.call_soon_threadsafe(events.put_nowait, (*lead, kind, payload))
        return events if self.svc.batcher.submit(job) else None

    def queue_full(self) -> tuple[str, int]:
        return f"the queue is full ({self.opts.max_queue} waiting); retry later", self.svc.batcher.retry_after()

    async def outcome(self, job, events, request):
        """("result", payload), ("error", (status, detail)), or a Response for a client gone or a timeout."""
        from starlette.responses import JSONResponse, PlainTextResponse

        while True:
            try:
                kind, payload = await asyncio.wait_for(events.get(), 0.25)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    self.svc.batcher.cancel(job, "disconnected")
                    return PlainTextResponse("client disconnected", 499)
                if time.perf_counter() > job.deadline + 1.0:    # the engine is inside a long chunk
                    self.svc.batcher.cancel(job, "timeout")
                    return JSONResponse(oa.error_body(504, "the request timed out"), 504)
                continue
            if kind in ("result", "error"):
                return kind, payload

    async def generate(self, body, request):
        from starlette.responses import JSONResponse, StreamingResponse

        svc = self.svc
        if not svc.ready:
            return self.openai_error(503, "error", svc.error or "the model is loading", retry=5)
        try:
            job = svc.job(body)
        except DBSError as e:
            return self.openai_error(INVALID, "invalid", str(e), e.field)
        events = self.submit(job)
        if events is None:
            msg, retry = self.queue_full()
            return self.openai_error(429, "refused", msg, retry=retry)
        if body.stream:
            return StreamingResponse(self.events(job, events), media_type="text/event-stream")
        got = await self.outcome(job, events, request)
        if not isinstance(got, tuple):
            return got
        kind, payload = got
        return JSONResponse(payload.to_json()) if kind == "result" else \
            JSONResponse(oa.error_body(payload[0], payload[1]), payload[0])

    async def events(self, job, events):
        """/v1/generate's Server-Sent Events: the chunks, then the result or the error."""
        done = False
        try:
            while True:
                kind, payload = await events.get()
                if kind == "error":
                    status, detail = payload
                    payload = {"status": status, **oa.error_body(status, detail)}
                elif kind == "result":
                    payload = payload.to_json()
                done = kind in ("result", "error")
                yield _sse(kind, payload)
                if done:
                    return
        finally:
            if not done:                 # the client went away: its rows leave at the next boundary
                self.svc.batcher.cancel(job, "disconnected")

    async def openai_answer(self, body, request, chat: bool):
        from starlette.responses import JSONResponse, StreamingResponse

        svc = self.svc
        if not svc.ready:
            return self.openai_error(503, "error", svc.error or "the model is loading", retry=5)
        try:
            template = svc.dbs.chat_template if chat else None
            args = oa.job_arguments(body, self.opts.model, svc.dbs.config.beams, template, chat, self.opts.max_queue,
                                    svc.dbs.backend.tokenizer)
            stops = args.pop("stops")
            jobs = [svc.make_job(context=c, **args) for c in args.pop("contexts")]
        except oa.Refused as e:
            return self.refuse(e.status, "invalid", e.body())
        except DBSError as e:
            return self.openai_error(INVALID, "invalid", str(e), e.field)
        reply = oa.Reply.answering(body, chat, stops)
        shared = asyncio.Queue() if body.stream else None     # a stream's events, led by their prompt's index
        queued = []
        for i, job in enumerate(jobs):   # a list of prompts: one job each, all queued or none
            events = self.submit(job, shared, i if body.stream else None)
            if events is None:
                for j, _ in queued:
                    svc.batcher.cancel(j, "refused")
                msg, retry = self.queue_full()
                return self.openai_error(429, "refused", msg, retry=retry)
            queued.append((job, events))
        if body.stream:
            usage = bool((body.stream_options or {}).get("include_usage"))
            return StreamingResponse(self.openai_events(jobs, shared, reply, usage), media_type="text/event-stream")
        results = []
        for k, (job, events) in enumerate(queued):
            got = await self.outcome(job, events, request)
            if not isinstance(got, tuple) or got[0] == "error":
                for j, _ in queued[k + 1:]:
                    svc.batcher.cancel(j, "refused")
                return got if not isinstance(got, tuple) else \
                    JSONResponse(oa.error_body(got[1][0], got[1][1]), got[1][0])
            results.append(got[1])
        return JSONResponse(reply.final(results))

    async def openai_events(self, jobs, events, reply, usage: bool):
        """An OpenAI stream of a prompt each `jobs` (their events on `events`, each led by the job's
        index): each prompt's certain text as deltas, then its rest, as they come; once all are in,
        the usage if asked and [DONE]. An error ends the stream and the other prompts' jobs."""
        replies = [reply.prompt(i) for i in range(len(jobs))]
        results = [None] * len(jobs)
        done = False
        try:
            for i, job in enumerate(jobs):
                first = replies[i].start(job.request.context)
                if first:
                    yield first
            while not done:
                i, kind, payload = await events.get()
                if kind == "chunk":
                    piece = replies[i].certain(payload["text"], payload.get("logprobs"))
                    if piece:
                        yield piece
                    continue
                if kind == "error":
                    done = True
                    for j, job in enumerate(jobs):
                        if j != i and results[j] is None:
                            self.svc.batcher.cancel(job, "refused")
                    for piece in reply.error(*payload):
                        yield piece
                    return
                results[i] = payload
                for piece in replies[i].end(payload):
                    yield piece
                done = all(r is not None for r in results)
            for piece in reply.close(results, usage):
                yield piece
        finally:
            if not done:                 # the client went away: the rows leave at the next boundary
                for job, result in zip(jobs, results):
                    if result is None:
                        self.svc.batcher.cancel(job, "disconnected")


def _error_handlers(app, ep: Endpoints) -> None:
    """Bad bodies counted; an unknown path or method in OpenAI's error shape on every path, and under
    /v1/ bad input a 400 naming its field."""
    from fastapi.exception_handlers import request_validation_exception_handler
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException as StarletteHTTPException
    from starlette.responses import JSONResponse

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request, exc):           # types, ranges, unknown fields, a body that is not JSON
        if request.url.path.startswith("/v1/"):     # `param` naming the field
            param, msg = fault(exc.errors())
            return ep.openai_error(INVALID, "invalid", msg, param)
        ep.svc.metrics.finished("invalid")
        return await request_validation_exception_handler(request, exc)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, exc):             # an unknown path or method: OpenAI's shape on every path
        headers, message = getattr(exc, "headers", None), str(exc.detail)
        where = f"{request.method} {request.url.path}"
        if exc.status_code == 404 and message == "Not Found":
            message = f"Invalid URL ({where}): this server's endpoints are listed at /docs and /openapi.json"
        elif exc.status_code == 405:
            allow = {k.lower(): v for k, v in (headers or {}).items()}.get("allow", "another method")
            message = f"Invalid method ({where}): {allow} is allowed there"
        return JSONResponse(oa.error_body(exc.status_code, message), exc.status_code, headers=headers)


def _operations_routes(app, ep: Endpoints) -> None:
    """/health, /metrics, /v1/models and the offline /docs."""
    from fastapi.openapi.docs import get_swagger_ui_html
    from starlette.responses import JSONResponse, PlainTextResponse, Response

    svc = ep.svc
    swagger = _swagger_assets()
    if swagger is not None:
        from starlette.staticfiles import StaticFiles

        app.mount("/docs-assets", StaticFiles(directory=swagger), name="docs-assets")

    @app.get("/docs", include_in_schema=False)
    async def docs():
        if swagger is None:
            return PlainTextResponse("the API page needs swagger-ui-bundle (the serve extra); the schema is at "
                                     "/openapi.json", 404)
        return get_swagger_ui_html(openapi_url="/openapi.json", title="dbs-fast API",
                                   swagger_js_url="/docs-assets/swagger-ui-bundle.js",
                                   swagger_css_url="/docs-assets/swagger-ui.css",
                                   swagger_favicon_url="/docs-assets/favicon-32x32.png")

    @app.get("/health")
    async def health():
        if svc.error:
            return JSONResponse({"status": "failed", "detail": svc.error}, 503)
        if not svc.ready:
            return JSONResponse({"status": "loading"}, 503)
        b = svc.batcher
        return {"status": "ready", "model": str(svc.dbs.model_dir), "rows": b.n_rows, "max_rows": b.max_rows,
                "queue": b.queue_depth, "max_queue": b.max_queue}

    @app.get("/metrics")
    async def metrics():
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(svc.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        """The served model, in OpenAI's shape."""
        return oa.models_list(ep.opts.model)

    @app.get("/v1/models/{model:path}")
    async def model(model: str):
        """The served model by its name (OpenAI's retrieve), or a 404 naming it."""
        for m in oa.models_list(ep.opts.model)["data"]:
            if model in (m["id"], ep.opts.model):
                return m
        from starlette.responses import JSONResponse

        return JSONResponse(oa.error_body(404, f"model {model!r} is not served here; GET /v1/models lists "
                                               f"{oa.served_name(ep.opts.model)!r}", "model"), 404)


def _generation_routes(app, ep: Endpoints) -> None:
    """POST /v1/generate, /v1/completions and /v1/chat/completions; their bodies' models are the
    handlers' annotations (FastAPI validates against them and lists them in /openapi.json)."""
    from fastapi import Request

    GenerateRequest = request_model()
    CompletionRequest, ChatRequest = oa.completion_model(), oa.chat_model()

    @app.post("/v1/generate")
    async def generate(body: GenerateRequest, request: Request):
        """The same JSON as `dbs-fast generate --format json`; with "stream": true, Server-Sent
        Events: `chunk` events ({"chunk", "text": the generated text already certain, a snapshot
        that only grows, "found"}), then `result` (or `error` with {"status", "detail"})."""
        return await ep.generate(body, request)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        """OpenAI's completions: `prompt` is the context; the keywords and every DBS option are
        extra body fields (see `dbs_fast.serving.openai_api`)."""
        return await ep.openai_answer(body, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        """OpenAI's chat completions: `messages` through the model's chat template; the keywords
        and every DBS option are extra body fields."""
        return await ep.openai_answer(body, request, chat=True)


def _swagger_assets() -> str | None:
    """The Swagger UI files of the swagger-ui-bundle package (served locally: /docs works offline)."""
    try:
        from swagger_ui_bundle import swagger_ui_path
    except ImportError:
        return None
    return str(swagger_ui_path)


class Guard:
    """API key and request body size, before any route runs: a plain ASGI middleware (no task or
    body copy per request, as Starlette's BaseHTTPMiddleware makes); a body without a length is
    read only up to the limit."""

    def __init__(self, app, opts: ServiceOptions, svc: "Service"):
        self.app, self.opts, self.svc = app, opts, svc
        self.protected = ("/v1/",) + (("/health", "/metrics") if opts.auth_health else ())
        self.expected = f"Bearer {opts.api_key}" if opts.api_key else None

    async def __call__(self, scope, receive, send):
        from starlette.datastructures import Headers
        from starlette.responses import JSONResponse

        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers, limit = Headers(scope=scope), self.opts.max_body_bytes
        msg = f"the request body is over {limit} bytes"
        too_big = JSONResponse(oa.error_body(413, msg, "body") if scope["path"].startswith("/v1/") else {"detail": msg}, 413)
        if self.expected and scope["path"].startswith(self.protected) and \
                not hmac.compare_digest(headers.get("authorization", ""), self.expected):
            self.svc.metrics.finished("unauthorized")
            return await JSONResponse(
                oa.error_body(401, "a valid API key is needed: `Authorization: Bearer <key>`", code="invalid_api_key"),
                401, headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
        size = headers.get("content-length")
        if size is not None and (not size.isdigit() or int(size) > limit):
            self.svc.metrics.finished("invalid")
            return await too_big(scope, receive, send)
        if size is None and scope["method"] == "POST":     # a chunked body: read it up to the limit
            got, n = [], 0
            while True:
                message = await receive()
                got.append(message)
                if message["type"] != "http.request":
                    break
                n += len(message.get("body", b""))
                if n > limit:
                    self.svc.metrics.finished("invalid")
                    return await too_big(scope, receive, send)
                if not message.get("more_body", False):
                    break

            async def replay():
                return got.pop(0) if got else await receive()

            return await self.app(scope, replay, send)
        return await self.app(scope, receive, send)


def _guard(app, opts: ServiceOptions, svc: "Service") -> None:
    """API key, request body size and CORS, before any route runs."""
    app.add_middleware(Guard, opts=opts, svc=svc)
    if opts.cors_origins:
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(opts.cors_origins), allow_methods=["GET", "POST"],
                           allow_headers=["authorization", "content-type"])


def serve(opts: ServiceOptions, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> None:
    """Run the server until SIGINT/SIGTERM (uvicorn), then shut down gracefully."""
    try:
        import uvicorn
    except ImportError as e:
        raise DBSError(f"the service needs the serve extra: {SERVE_EXTRA} (missing: {e.name})") from None
    uvicorn.run(create_app(opts), host=host, port=port, log_level=log_level, timeout_graceful_shutdown=opts.grace)
