"""`dbs-fast run-batch`: a file of requests through the service's engine loop, offline.

Input, one request a line (read lazily):
- OpenAI's batch format: JSONL lines `{"custom_id", "method": "POST", "url": "/v1/completions" or
  "/v1/chat/completions", "body"}`, the body as the service takes it (keywords and DBS options as
  its extra fields);
- a plain form for data work: JSONL lines or CSV rows with `keywords` and, optionally, `context`,
  `id` and `seed` (JSONL lines may carry every option of /v1/generate).

Output, one JSONL line per request as it finishes: `{"id", "custom_id", "response": {"status_code",
"request_id", "body"}, "error"}`, the body what the service would have answered (for the plain form,
the JSON of /v1/generate). A bad line becomes a line whose `error` is OpenAI's error object naming
the field, and the job goes on.

Resumable: an output that exists is read first; its requests are skipped, and a line a killed job
left half-written is cut off. Each request's seed is its body's, else one derived from its
`custom_id` and the job's seed, so a resumed job writes the texts an uninterrupted one would.
Memory stays flat: at most `max_queue` requests are in flight.
"""
from __future__ import annotations

import csv
import hashlib
import json
import queue
import sys
import time
from pathlib import Path

from ..config import SEED_MAX
from ..errors import DBSError
from . import openai_api as oa

OPENAI_URLS = {"/v1/completions": False, "/v1/chat/completions": True}       # url -> chat


def derived_seed(job_seed: int, custom_id: str) -> int:
    """The seed of a request that gives none: from the job's seed and its custom_id alone."""
    digest = hashlib.sha256(f"{job_seed}:{custom_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") & SEED_MAX


def done_ids(out: Path) -> set[str]:
    """The custom_ids an earlier run of the job wrote to `out`; a half-written last line is cut off."""
    if not out.exists():
        return set()
    with open(out, "rb+") as f:
        data = f.read()
        keep = data.rfind(b"\n") + 1
        if keep < len(data):                    # killed while writing a line
            f.truncate(keep)
    return {json.loads(line)["custom_id"] for line in data[:keep].decode().splitlines() if line.strip()}


def failed_lines(out: Path) -> int:
    """How many lines of the output `out` are errors, whichever run wrote them."""
    if not out.exists():
        return 0
    with open(out, encoding="utf-8") as f:
        return sum(json.loads(line).get("error") is not None for line in f if line.strip())


def read_lines(path: Path):
    """(line number, custom_id, kind, request or None, error or None) per input line, read lazily;
    kind is "chat", "completion" or "plain"."""
    if path.suffix.lower() == ".csv":
        with open(path, newline="", encoding="utf-8") as f:
            for n, row in enumerate(csv.DictReader(f), 1):
                yield (n, *_plain(n, {k: v for k, v in row.items() if v not in (None, "")}, csv_row=True))
        return
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                yield n, f"line-{n}", "plain", None, oa.error_body(400, f"line {n} is not JSON: {e}")["error"]
                continue
            if not isinstance(obj, dict):
                yield n, f"line-{n}", "plain", None, oa.error_body(400, f"line {n} is not a JSON object")["error"]
            elif "body" in obj or "url" in obj or "custom_id" in obj:
                yield (n, *_openai(n, obj))
            else:
                yield (n, *_plain(n, obj))


def _openai(n: int, obj: dict):
    cid = obj.get("custom_id")
    if not isinstance(cid, str) or not cid:
        return f"line-{n}", "completion", None, oa.error_body(400, "`custom_id` must be a non-empty string",
                                                              "custom_id")["error"]
    url, body = obj.get("url"), obj.get("body")
    if url not in OPENAI_URLS or obj.get("method", "POST") != "POST":
        return cid, "completion", None, oa.error_body(
            400, f"`url` must be one of {sorted(OPENAI_URLS)} with method POST, got {url!r}", "url")["error"]
    if not isinstance(body, dict):
        return cid, "completion", None, oa.error_body(400, "`body` must be a JSON object", "body")["error"]
    return cid, "chat" if OPENAI_URLS[url] else "completion", body, None


def _plain(n: int, obj: dict, csv_row: bool = False):
    obj = dict(obj)
    cid = str(obj.pop("id", f"line-{n}"))
    if csv_row:
        unknown = sorted(set(obj) - {"keywords", "context", "seed"})
        if unknown:
            return cid, "plain", None, oa.error_body(400, f"unknown column {unknown[0]!r}: a CSV row takes keywords, "
                                                          f"context, id and seed", unknown[0])["error"]
        if "seed" in obj:
            try:
                obj["seed"] = int(obj["seed"])
            except ValueError:
                return cid, "plain", None, oa.error_body(400, f"`seed` must be an integer, got {obj['seed']!r}",
                                                         "seed")["error"]
    return cid, "plain", obj, None


def pending(inp: Path, done: set[str]):
    """The input's lines not answered yet, as (custom_id, kind, request or None, error or None); a
    custom_id an earlier line used is answered as an error under its own id and line number."""
    seen = set()
    for n, cid, kind, request, error in read_lines(inp):
        if cid in seen:
            error = oa.error_body(400, f"`custom_id` {cid!r} is used by an earlier line", "custom_id")["error"]
            cid = f"{cid} (line {n})"
        seen.add(cid)
        yield cid, kind, request, error, cid in done


def _request_id(cid: str) -> str:
    return hashlib.sha256(cid.encode()).hexdigest()[:24]


def output_line(cid: str, response: dict | None, error: dict | None) -> str:
    """One output line (without its newline), OpenAI's batch output shape."""
    return json.dumps({"id": "batch_req_" + _request_id(cid), "custom_id": cid, "response": response,
                       "error": error}, allow_nan=False)


class FileSink:
    """Writes output lines to an open file, one write and a flush each (a kill cuts at most the
    line being written), counting them; `progress(1)` per line. A sink is called with a request's
    (custom_id, response, error)."""

    def __init__(self, f, progress=None):
        self.f, self.progress = f, progress
        self.counts = {"ok": 0, "failed": 0, "skipped": 0}

    def __call__(self, cid: str, response: dict | None, error: dict | None) -> None:
        self.write(output_line(cid, response, error), failed=error is not None)

    def write(self, line: str, failed: bool) -> None:
        self.f.write(line + "\n")
        self.f.flush()
        self.counts["failed" if failed else "ok"] += 1
        self.skip(count=False)

    def skip(self, count: bool = True) -> None:
        if count:
            self.counts["skipped"] += 1
        if self.progress is not None:
            self.progress(1)


class BatchJob:
    """Requests through a `Service`'s batcher: `answer` sends each one's output line to a sink
    (a file; a list in a Ray Data worker) as it finishes."""

    def __init__(self, svc, job_seed: int = 0):
        self.svc, self.job_seed = svc, job_seed
        self.results: queue.Queue = queue.Queue()
        self.in_flight: dict[str, object] = {}          # custom_id -> its Reply (None: plain form)

    def answer(self, records, sink) -> None:
        """`records`: (custom_id, kind, request or None, error or None); a line each to `sink`."""
        for cid, kind, request, error in records:
            if error is None:
                error = self._submit(cid, kind, request, sink)
            if error is not None:
                sink(cid, None, error)
        while self.in_flight:
            self._collect(sink, block=True)

    def _submit(self, cid: str, kind: str, request: dict, sink) -> dict | None:
        """Queue the request; OpenAI's error object (for an output line) when it is bad."""
        from pydantic import ValidationError

        from .bodies import fault

        svc = self.svc
        request = dict(request)
        request.setdefault("seed", derived_seed(self.job_seed, cid))
        try:
            if kind == "plain":
                from .service import request_model

                job, reply = svc.job(request_model().model_validate(request)), None
            else:
                chat = kind == "chat"
                body = (oa.chat_model() if chat else oa.completion_model()).model_validate(request)
                if body.stream:
                    raise oa.Refused("stream", "`stream` is not available in a batch file")
                args = oa.job_arguments(body, svc.opts.model, svc.dbs.config.beams,
                                        svc.dbs.chat_template if chat else None, chat,
                                        tokenizer=svc.dbs.backend.tokenizer)
                reply = oa.Reply.answering(body, chat, args.pop("stops"))
                job = svc.make_job(context=args.pop("contexts")[0], **args)
        except oa.Refused as e:
            return e.body()["error"]
        except DBSError as e:
            return oa.error_body(400, str(e), e.field)["error"]
        except ValidationError as e:
            param, msg = fault(e.errors())
            return oa.error_body(400, msg, param)["error"]
        job.send = lambda k, payload, cid=cid: self.results.put((cid, k, payload)) if k != "chunk" else None
        self.in_flight[cid] = reply
        while not svc.batcher.submit(job):          # the queue is full: write what has finished
            self._collect(sink, block=True)
        while self._collect(sink, block=False):
            pass
        return None

    def _collect(self, sink, block: bool) -> bool:
        try:
            cid, kind, payload = self.results.get(block=block, timeout=None if block else 0)
        except queue.Empty:
            return False
        reply = self.in_flight.pop(cid)
        if kind == "result":
            body = reply.final([payload]) if reply is not None else payload.to_json()
            sink(cid, {"status_code": 200, "request_id": _request_id(cid), "body": body}, None)
        else:
            status, detail = payload
            sink(cid, None, oa.error_body(status, str(detail))["error"])
        return True


def _open_job(inp: Path, out: Path):
    if not inp.is_file():
        raise DBSError(f"input file not found: {inp}", "input", str(inp))
    if out.exists() and not out.is_file():
        raise DBSError(f"output is not a file: {out}", "output", str(out))
    out.parent.mkdir(parents=True, exist_ok=True)


def _progress_bar(inp: Path):
    """A progress bar on stderr (lines, rate, ETA) when it is a terminal, else None."""
    if not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    with open(inp, "rb") as f:
        total = sum(1 for line in f if line.strip()) - (1 if inp.suffix.lower() == ".csv" else 0)
    return tqdm(total=total, desc="run-batch", unit="req", file=sys.stderr)


def run_batch(inp: Path, out: Path, opts, dbs=None, job_seed: int = 0) -> dict:
    """Every line of `inp` answered once in `out` (resuming what an earlier run wrote): the counts."""
    from .service import Service

    _open_job(inp, out)
    svc = Service(opts, dbs)
    svc._load()
    if svc.error:
        raise DBSError(f"the model did not load: {svc.error}")
    bar, t0 = _progress_bar(inp), time.perf_counter()
    try:
        with open(out, "a", encoding="utf-8") as f:
            sink = FileSink(f, bar.update if bar else None)

            def todo():
                for cid, kind, request, error, done in pending(inp, done_ids(out)):
                    if done:
                        sink.skip()
                    else:
                        yield cid, kind, request, error

            BatchJob(svc, job_seed).answer(todo(), sink)
    finally:
        if bar is not None:
            bar.close()
        svc.stop()
    return {**sink.counts, "seconds": time.perf_counter() - t0, "failed_in_output": failed_lines(out)}


class RayEngine:
    """A Ray Data worker: one engine with its own continuous batching, loaded once per actor, that
    answers a batch of requests with their output lines."""

    def __init__(self, opts: dict, job_seed: int):
        from .service import Service, ServiceOptions

        svc = Service(ServiceOptions(**opts))
        svc._load()
        if svc.error:
            raise RuntimeError(f"the model did not load: {svc.error}")
        self.job = BatchJob(svc, job_seed)

    def __call__(self, batch: dict) -> dict:
        lines, failed = [], []

        def sink(cid, response, error):
            lines.append(output_line(cid, response, error))
            failed.append(error is not None)

        self.job.answer(((c, k, json.loads(r), None) for c, k, r in
                         zip(batch["custom_id"], batch["kind"], batch["request"])), sink)
        return {"line": lines, "failed": failed}


def run_batch_ray(inp: Path, out: Path, opts, job_seed: int = 0, address: str | None = None, workers: int = 2,
                  cpus_per_worker: float = 1.0, batch_size: int = 16) -> dict:
    """`run_batch` on a Ray cluster (`address`; None: a local one): a Ray Data pipeline whose actor
    pool of `workers` engines answers the requests; the driver writes each line as it arrives, so
    a worker that dies has its batch retried by Ray and the output stays exactly-once, and a
    driver that dies resumes as `run_batch` does. The requests not answered yet are held in the
    driver's memory as JSON strings."""
    import dataclasses

    import ray

    _open_job(inp, out)
    if not ray.is_initialized():
        ray.init(address=address, include_dashboard=False, log_to_driver=False)
    bar, t0 = _progress_bar(inp), time.perf_counter()
    try:
        with open(out, "a", encoding="utf-8") as f:
            sink = FileSink(f, bar.update if bar else None)
            records = []
            for cid, kind, request, error, done in pending(inp, done_ids(out)):
                if done:
                    sink.skip()
                elif error is not None:
                    sink(cid, None, error)
                else:
                    records.append({"custom_id": cid, "kind": kind, "request": json.dumps(request)})
            if records:
                options = dataclasses.asdict(opts)
                ds = ray.data.from_items(records).map_batches(
                    RayEngine, fn_constructor_kwargs={"opts": options, "job_seed": job_seed}, batch_size=batch_size,
                    concurrency=workers, num_cpus=cpus_per_worker, batch_format="numpy")
                for row in ds.iter_rows():
                    sink.write(str(row["line"]), bool(row["failed"]))
    finally:
        if bar is not None:
            bar.close()
    return {**sink.counts, "seconds": time.perf_counter() - t0, "failed_in_output": failed_lines(out)}
