"""Load test of `dbs-fast serve` on loopback (a benchmark, not a test).

    python -m benchmarks.load --out runs/load [--levels 1,2,4,8,16] [--skip paper,soak]

Each arm starts its own server process (`dbs-fast serve`), waits for /health, and drives it
with N concurrent asyncio clients (httpx), each sending `--per-client` requests back to back:
- small: b = s = 2 requests (CommonGen concept sets, --order any, 32 tokens, context "A"), at
  every concurrency level, against a server with continuous batching (--max-rows 140) and one
  serving one request at a time (--max-rows = the request's rows: the same code, no merging);
- paper: paper-setting requests (b = 7, s = 10, k = 5, 90 tokens, the paper's 50 sets) at 1 and
  4 clients, both servers; and the join test: request B (streamed) arrives while A runs, the
  delay to B's first event against the merged batch's chunk time (B's event spacing);
- long-join: request B with a `--join-context`-token context joins while A (paper setting,
  streamed) runs, against a server that prefills it in pieces between A's chunks and one that
  prefills it whole (`--no-chunked-prefill`): A's largest event gap while B joins, in A's chunk times;
- soak: `--soak` requests (small) from 8 clients, 10% malformed, 5% clients that disconnect
  after sending; counts every answer, checks the server survives, reports its RSS start/end.
- engine: in process, n small requests as one batch: seconds and model ms per step vs rows; and
  one decode step's milliseconds by rows and cache length on the row-layout graph (model.onnx).
- engine-loop: in process, no HTTP: as many closed-loop threads as the largest level send the
  small requests (`--per-client` each) straight to the service's Batcher, continuous and one at a
  time: the throughput ratio of the engine alone, and its seconds waiting, admitting, decoding.
`--task commongen`: the small arm's requests are the CommonGen task preset (b = s = 2; its hidden
few-shot prompt, 40 tokens, one sentence) instead. `--server-checkout DIR HOME`: the servers run the
engine of another checkout (an older commit, `git worktree add`), with its own DBS_FAST_HOME.
Every arm reports the server's RSS at its end.
`--openai`: every request goes through the `openai` SDK to /v1/completions, with an API key (the
servers start with `--api-key`): the context is the prompt, the constraints and settings go in
`extra_body`, a malformed request is a bad extra field or a standard one the engine refuses.
Throughput: requests/s and candidate tokens/s (the server's /metrics counter over the arm's
wall time); latency p50/p95 per request. For the small arm, the same requests of every level are
also sent one at a time by one client to the one-at-a-time server ("alone": no queue, no merging;
same bodies and seeds, so the same texts), and the ratios compare latency under load with the
same requests' latency alone: p95 over p95, and the p95 of each request's own slow-down (beside
the older p95 over the 1-client arm's p50, which is 3 other, shorter requests).
Writes load.json and load.png.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import socket
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from dbs_fast.bench.machine import machine
from dbs_fast.evaluation.runs import builtin_sets
from dbs_fast.serving.service import ServiceOptions

SMALL = {"beams": 2, "candidates": 2, "order": "any", "max_new_tokens": 32, "context": "A"}
PAPER = {"paper": True, "beams": 7, "candidates": 10, "chunk": 5, "max_new_tokens": 90, "context": "It is"}
MALFORMED = [{"keywords": "run|"}, {"keywords": "dog", "beams": 0}, {"keywords": "dog", "top_p": 2},
             {"keywords": "dog", "ban": "dogs"}, {"keywords": "dog", "context": 5}, {"keywords": "dog", "beams": "x"},
             {"keywords": "dog", "order": "sideways"}, {"keywords": "dog", "unknown": 1},
             {"keywords": "dog", "seed": -1}, {"keywords": "dog", "temperature": -1}]
API_KEY = "load-test-key"


class Sender:
    """One request, as JSON to /v1/generate (httpx) or through the `openai` SDK to /v1/completions."""

    def __init__(self, url: str, openai_sdk: bool):
        import httpx

        self.url, self.sdk = url, None
        self.http = httpx.AsyncClient(headers={"Authorization": f"Bearer {API_KEY}"} if openai_sdk else None)
        if openai_sdk:
            import openai

            self.sdk = openai.AsyncOpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0, timeout=None)

    async def send(self, body: dict) -> tuple[int, str | None]:
        """(HTTP status, the error message or None)."""
        if self.sdk is None:
            r = await self.http.post(self.url + "/v1/generate", json=body, timeout=None)
            return r.status_code, (r.json().get("detail") if r.status_code != 200 else None)
        import openai

        std = {k: body[k] for k in ("seed", "temperature") if k in body}
        extra = {k: v for k, v in body.items() if k not in ("context", "max_new_tokens", "seed", "temperature")}
        try:
            await self.sdk.completions.create(model="default", prompt=body.get("context", "It is"),
                                              max_tokens=body.get("max_new_tokens"), extra_body=extra, **std)
            return 200, None
        except openai.APIStatusError as e:
            return e.status_code, json.dumps(e.body)

    async def close(self) -> None:
        await self.http.aclose()
        if self.sdk is not None:
            await self.sdk.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SERVER_CHECKOUT: tuple | None = None     # (checkout dir, its DBS_FAST_HOME) that servers run from
SERVER_ARGS: list[str] = []              # more `dbs-fast serve` options for every server (`--schedule`)


class ServerProcess:
    def __init__(self, model: str, max_rows: int, threads: int | None, log: Path, admit_wait: float | None = None,
                 api_key: str | None = None, chunked_prefill: bool = True):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "dbs_fast.cli", "serve", "--model", model, "--port", str(self.port),
               "--max-rows", str(max_rows), "--max-queue", "1024"] + (["--threads", str(threads)] if threads else []) + (
                   ["--admit-wait", str(admit_wait)] if admit_wait is not None else []) + (
                   ["--api-key", api_key] if api_key else []) + ([] if chunked_prefill else ["--no-chunked-prefill"]) + SERVER_ARGS
        env = {**os.environ, "PYTHONSAFEPATH": "1"}       # a checkout's dbs_fast/ must not shadow the package
        if SERVER_CHECKOUT:                              # `--server-checkout`: another commit's engine serves
            env.update(PYTHONPATH=str(SERVER_CHECKOUT[0]), DBS_FAST_HOME=str(SERVER_CHECKOUT[1]))
        self.log = open(log, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)

    def wait_ready(self, timeout: float = 600) -> "ServerProcess":
        import httpx

        t0 = time.time()
        while time.time() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited ({self.proc.returncode}); see {self.log.name}")
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError("the server did not become ready")

    def rss(self) -> float:
        import psutil

        return psutil.Process(self.proc.pid).memory_info().rss / 2**30

    def metrics(self, prefix: str) -> dict[str, float]:
        """The /metrics samples whose name starts with `prefix`, by their name and labels."""
        import httpx

        lines = httpx.get(self.url + "/metrics", timeout=30).text.splitlines()
        return {k: float(v) for k, v in (line.rsplit(" ", 1) for line in lines if line.startswith(prefix))}

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


TASK = {"task": "commongen", "beams": 2, "candidates": 2}   # `--task commongen`: the preset's few-shot prompt


def bodies(kind: str, n: int, seed0: int = 0) -> list[dict]:
    if kind == "small":
        sets = builtin_sets("commongen-dev")
        return [{**SMALL, "keywords": sets[i % len(sets)], "seed": seed0 + i} for i in range(n)]
    sets = builtin_sets("paper")
    return [{**PAPER, "keywords": sets[i % len(sets)], "seed": seed0 + i} for i in range(n)]


async def drive(url: str, work: list[dict], clients: int, deadline: float, openai_sdk: bool = False) -> list[dict]:
    """`clients` concurrent clients take requests from `work` in order until none is left."""
    queue, out = list(enumerate(work)), []
    sender = Sender(url, openai_sdk)

    async def client():
        while queue and time.time() < deadline:
            i, body = queue.pop(0)
            t = time.perf_counter()
            status, _ = await sender.send(body)
            out.append({"i": i, "status": status, "latency": time.perf_counter() - t})

    await asyncio.gather(*(client() for _ in range(clients)))
    await sender.close()
    return out


def arm(server: ServerProcess, kind: str, clients: int, per_client: int, max_seconds: float,
        senders: int | None = None, openai_sdk: bool = False) -> dict:
    """The work of `clients` clients x `per_client` requests, sent by `senders` concurrent clients
    (default `clients`; 1 measures each of the same requests alone, one after another)."""
    work = bodies(kind, clients * per_client, seed0=1000 * clients)
    before, t0 = server.metrics("dbs_"), time.perf_counter()
    res = asyncio.run(drive(server.url, work, senders or clients, time.time() + max_seconds, openai_sdk))
    wall = time.perf_counter() - t0
    after = server.metrics("dbs_")
    d = {k: v - before.get(k, 0.0) for k, v in after.items()}          # the arm's counts
    tokens, chunks = d.get("dbs_candidate_tokens_total", 0.0), d.get("dbs_chunk_seconds_count", 0.0)
    lat = np.array([r["latency"] for r in res if r["status"] == 200])
    return {"clients": clients, "senders": senders or clients, "requests": len(res),
            "ok": int((np.array([r["status"] for r in res]) == 200).sum()),
            "wall_s": wall, "requests_per_s": len(lat) / wall,
            "candidate_tokens_per_s": tokens / wall,
            # how full the merged batch ran: candidate tokens per chunk (a request's first chunk has b rows, then b*s)
            "candidate_tokens_per_chunk": tokens / chunks if chunks else None,
            "p50_s": float(np.percentile(lat, 50)) if len(lat) else None,
            "p95_s": float(np.percentile(lat, 95)) if len(lat) else None,
            "latency_s": {str(r["i"]): r["latency"] for r in res if r["status"] == 200},
            "admit_waits": admit_waits(d),
            "server_rss_gib": server.rss()}


def admit_waits(d: dict) -> dict:
    """The arm's admission waits from the server's dbs_admit_wait_seconds (`d`: the arm's change of
    every sample): per outcome (returned: as many new requests came as had ended; timeout:
    --admit-wait ran out), how many and their mean seconds, and how many of the returns came within
    30, 50 and 100 ms."""
    out = {}
    for o in ("returned", "timeout"):
        n = d.get(f'dbs_admit_wait_seconds_count{{outcome="{o}"}}', 0.0)
        out[o] = {"n": int(n), "mean_s": d.get(f'dbs_admit_wait_seconds_sum{{outcome="{o}"}}', 0.0) / n if n else None}
    for le in ("0.03", "0.05", "0.1"):
        out["returned"][f"within_{le}_s"] = int(d.get(f'dbs_admit_wait_seconds_bucket{{le="{le}",outcome="returned"}}', 0.0))
    return out


def latency_ratios(cont: dict, alone: dict) -> dict:
    """The same requests under load and alone (same bodies and seeds, so the same texts): p95 over
    p95, and the p95 of each request's own slow-down."""
    both = sorted(set(cont["latency_s"]) & set(alone["latency_s"]), key=int)
    slow = [cont["latency_s"][i] / alone["latency_s"][i] for i in both]
    return {"alone_p50_s": alone["p50_s"], "alone_p95_s": alone["p95_s"],
            "p95_over_alone_p95": cont["p95_s"] / alone["p95_s"],
            "slowdown_p50": float(np.percentile(slow, 50)), "slowdown_p95": float(np.percentile(slow, 95))}


async def a_then_b(url: str, a_body: dict, b_body: dict, after: int) -> tuple[dict, float]:
    """A streams; B is sent (streamed) after A's `after`-th event. The times of each one's events
    and when B was sent."""
    import httpx

    marks: dict[str, list[float]] = {"a": [], "b": []}
    b_sent = asyncio.Event()

    async def stream(c, name, body):
        async with c.stream("POST", url + "/v1/generate", json={**body, "stream": True}, timeout=None) as r:
            async for line in r.aiter_lines():
                if line.startswith("event: "):
                    marks[name].append(time.perf_counter())
                    if name == "a" and len(marks["a"]) == after:
                        b_sent.set()

    async with httpx.AsyncClient() as c:
        ta = asyncio.create_task(stream(c, "a", a_body))
        await b_sent.wait()
        t_b = time.perf_counter()
        await asyncio.gather(ta, stream(c, "b", b_body))
    return marks, t_b


async def join_test(url: str) -> dict:
    """A runs (paper setting, streamed); B arrives after A's first event. B's first event delay
    against the merged batch's chunk time (the spacing of B's events while A still runs)."""
    marks, t_b = await a_then_b(url, *bodies("paper", 2, seed0=77), after=1)
    a_end = marks["a"][-1]
    both = [t for t in marks["b"] if t <= a_end]
    gaps = np.diff(both) if len(both) > 2 else np.diff(marks["b"])
    chunk = float(np.median(gaps))
    first = marks["b"][0] - t_b
    return {"b_first_event_s": first, "merged_chunk_s": chunk, "first_event_in_chunks": first / chunk,
            "a_total_s": a_end - marks["a"][0], "b_events": len(marks["b"])}


async def long_join_test(url: str, context: str) -> dict:
    """A runs (paper setting, streamed); B, with a long context, arrives after A's fourth event.
    How long A's events stall while B's context is prefilled (A's largest gap from B's arrival to
    B's first event, against A's median gap before B came) and B's first event delay."""
    a_body, b_body = bodies("paper", 2, seed0=91)
    marks, t_b = await a_then_b(url, a_body, {**b_body, "context": context, "max_new_tokens": 10}, after=4)
    a, b_first = np.array(marks["a"]), marks["b"][0]
    gaps = np.diff(a)
    before = gaps[a[1:] <= t_b]                                      # A's chunk time before B came
    joining = gaps[(a[1:] > t_b) & (a[:-1] < b_first)]               # gaps that overlap B's arrival..first event
    return {"a_gap_before_s": float(np.median(before)), "a_gap_max_while_b_joins_s": float(joining.max()),
            "stall_in_chunks": float(joining.max() / np.median(before)), "b_first_event_s": b_first - t_b}


async def soak(url: str, n: int, clients: int, rss=None, seed: int = 0, openai_sdk: bool = False) -> dict:

    sender = Sender(url, openai_sdk)
    rng = random.Random(seed)
    good = bodies("small", n, seed0=5000)
    plan = []
    for i in range(n):
        u = rng.random()
        plan.append(("malformed", rng.choice(MALFORMED)) if u < 0.10 else
                    ("disconnect", good[i]) if u < 0.15 else ("good", good[i]))
    queue, out, rss_at = list(enumerate(plan)), [], {}

    async def client():
        while queue:
            i, (kind, body) = queue.pop(0)
            if rss and i % 50 == 0:
                rss_at[i] = rss()
            rec = {"i": i, "kind": kind}
            try:
                if kind == "disconnect":       # sends, then goes away before the answer
                    await asyncio.wait_for(sender.send(body), 0.3)
                    rec["status"] = "answered before the client left"
                else:
                    rec["status"], rec["detail"] = await sender.send(body)
            except asyncio.TimeoutError:
                rec["status"] = "left"
            except Exception as e:   # noqa: BLE001 -- a transport error is counted, the soak goes on
                rec["status"] = f"error: {type(e).__name__}"
            out.append(rec)

    await asyncio.gather(*(client() for _ in range(clients)))
    await sender.close()
    good_ok = sum(r["kind"] == "good" and r["status"] == 200 for r in out)
    bad_4xx = sum(r["kind"] == "malformed" and isinstance(r["status"], int) and 400 <= r["status"] < 500
                  and bool(r["detail"]) for r in out)
    return {"requests": n, "good": sum(r["kind"] == "good" for r in out), "good_ok": good_ok,
            "malformed": sum(r["kind"] == "malformed" for r in out), "malformed_4xx_with_message": bad_4xx,
            "disconnecting": sum(r["kind"] == "disconnect" for r in out),
            "transport_errors": sum(str(r["status"]).startswith("error") for r in out),
            "rss_gb_by_request": dict(sorted(rss_at.items()))}


def small_engine(model: str, threads: int | None):
    """(the engine, the small requests' config, the CommonGen dev sets), warmed up by one request."""
    from dbs_fast import DBSConfig, DirectedBeamSearch

    dbs = DirectedBeamSearch(model, threads=threads)
    cfg = replace(DBSConfig(), **{k: v for k, v in SMALL.items() if k != "context"})
    sets = builtin_sets("commongen-dev")
    dbs.generate(SMALL["context"], sets[0], config=cfg)                      # warm up
    return dbs, cfg, sets


def engine_scaling(model: str, levels: list[int], threads: int | None) -> list[dict]:
    """In process, no HTTP: n small requests decoded as one batch (generate_batch), seconds and
    model milliseconds per step. Shows how a step's cost grows with the rows on this machine."""
    dbs, cfg, sets = small_engine(model, threads)
    out = []
    for n in levels:
        best = None
        for _ in range(2):
            batch = dbs.batch(cfg)
            t = time.perf_counter()
            batch.admit([dbs.request("A", s, None, i, cfg) for i, s in enumerate(sets[:n])])
            batch.run()
            dt = time.perf_counter() - t
            tm = batch.search.t
            cur = {"requests": n, "rows": n * SMALL["beams"] * SMALL["candidates"], "seconds": dt,
                   "model_steps": tm.calls["model"], "model_ms_per_step": 1000 * tm.seconds["model"] / tm.calls["model"]}
            best = cur if best is None or dt < best["seconds"] else best
        out.append(best)
        print("engine", json.dumps(best), flush=True)
    return out


def engine_loop(model: str, clients: int, per: int, threads: int | None, admit_wait: float | None,
                budgets: list[int] | None = None, temperatures: list[float] | None = None) -> dict:
    """In process, no HTTP: `clients` closed-loop threads submit the small requests straight to the
    service's `Batcher`, continuous (max_rows 140) and one request at a time (the rows of one):
    requests per second, their ratio, and the engine thread's seconds waiting for returning
    clients, admitting and decoding. Separates what the engine's batching gains from HTTP.
    `budgets`: request i asks for budgets[i % len(budgets)] new tokens (`max_new_tokens`), as
    clients that set their own `max_tokens` do; `temperatures`: it draws at temperatures[i %
    len(temperatures)], as clients that set their own `temperature` do."""
    import queue
    import threading

    from dbs_fast.serving.batcher import Batcher, Job

    dbs, cfg, sets = small_engine(model, threads)
    wait = ServiceOptions().admit_wait if admit_wait is None else admit_wait
    out = {"clients": clients, "requests": clients * per, "admit_wait": wait, "budgets": budgets,
           "temperatures": temperatures}

    def own(i: int):
        return replace(cfg, **({"max_new_tokens": budgets[i % len(budgets)]} if budgets else {}),
                       **({"temperature": temperatures[i % len(temperatures)]} if temperatures else {}))
    for mode, rows in (("continuous", 140), ("sequential", cfg.beams * cfg.candidates)):
        b = Batcher(dbs, rows, 4 * clients, admit_wait=wait)

        def client(c: int) -> None:
            for i in range(c * per, (c + 1) * per):
                done = queue.Queue()
                c_i = own(i)
                b.submit(Job(dbs.request(SMALL["context"], sets[i], None, i, c_i), c_i,
                             lambda kind, payload: done.put(kind) if kind in ("result", "error") else None))
                assert done.get() == "result"

        t = time.perf_counter()
        threads_ = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
        for th in threads_:
            th.start()
        for th in threads_:
            th.join()
        wall = time.perf_counter() - t
        b.stop(1.0)
        out[mode] = {"wall_s": wall, "requests_per_s": clients * per / wall, "engine_seconds": dict(b.seconds)}
        print("engine-loop", mode, json.dumps(out[mode]), flush=True)
    out["ratio"] = out["continuous"]["requests_per_s"] / out["sequential"]["requests_per_s"]
    return out


def step_cost(model: str, threads: int | None) -> list[dict]:
    """Milliseconds of one decode step (`backend.step`, best of 5) by rows and cache length, on the
    row-layout graph (model.onnx: one cache row per candidate, every row its own context); the
    engine decodes on the prefix graph where the export has one, whose step the engine arm's
    `model_ms_per_step` gives."""
    from dbs_fast import DirectedBeamSearch

    be = DirectedBeamSearch(model, threads=threads).backend
    out = []
    for rows in (4, 8, 16, 32, 64):
        for length in (8, 40, 100):
            _, cache = be.prefill([[1] * length] * rows)
            ids = np.full(rows, 5, np.int64)
            be.step(ids, cache)
            best = float("inf")
            for _ in range(5):
                t = time.perf_counter()
                be.step(ids, cache)
                best = min(best, time.perf_counter() - t)
            out.append({"rows": rows, "cache_length": length, "step_ms": 1000 * best})
            print("step", json.dumps(out[-1]), flush=True)
    return out


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    for mode, style in (("continuous", "o-"), ("sequential", "s--")):
        pts = res["small"].get(mode, [])
        if not pts:
            continue
        x = [p["clients"] for p in pts]
        ax[0].plot(x, [p["requests_per_s"] for p in pts], style, label=f"{mode}")
        ax[1].plot(x, [p["p50_s"] for p in pts], style, label=f"{mode} p50")
        ax[1].plot(x, [p["p95_s"] for p in pts], style, alpha=0.5, label=f"{mode} p95")
    alone = res["small"].get("alone", [])
    if alone:
        ax[1].plot([p["clients"] for p in alone], [p["p95_s"] for p in alone], "k:", label="the same requests alone, p95")
    ax[0].set(xscale="log", xlabel="concurrent clients", ylabel="requests/s", title="small requests (b = s = 2)")
    ax[1].set(xscale="log", yscale="log", xlabel="concurrent clients", ylabel="latency (s)", title="latency")
    for a in ax:
        a.legend()
        a.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="load_out")
    ap.add_argument("--model", default="default")
    ap.add_argument("--levels", default="1,2,4,8,16")
    ap.add_argument("--per-client", type=int, default=3, help="requests each client sends (small)")
    ap.add_argument("--max-seconds", type=float, default=240, help="per arm: clients stop taking work after this")
    ap.add_argument("--soak", type=int, default=500)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--skip", default="", help="comma-separated: engine, engine-loop, small, paper, join, long-join, soak")
    ap.add_argument("--task", choices=["commongen"], default=None,
                    help="the small arm's requests use this task preset (CommonGen: its few-shot prompt, 40 tokens)")
    ap.add_argument("--server-checkout", nargs=2, metavar=("DIR", "HOME"), default=None,
                    help="servers run the engine of another checkout, with its own DBS_FAST_HOME (an A/B of commits)")
    ap.add_argument("--join-context", type=int, default=2000,
                    help="context tokens of the request that joins in the long-join arm (default 2000)")
    ap.add_argument("--schedule", choices=["distinct", "plain"], default=None,
                    help="the servers' --schedule (default: theirs)")
    ap.add_argument("--admit-wait", type=float, default=None,
                    help="the servers' --admit-wait (seconds; default: the server's default)")
    ap.add_argument("--budgets", default=None,
                    help="engine-loop: comma-separated max_new_tokens the requests take in turn (default: the small request's)")
    ap.add_argument("--temperatures", default=None,
                    help="engine-loop: comma-separated temperatures the requests take in turn "
                         "(default: the small request's)")
    ap.add_argument("--openai", action="store_true",
                    help="requests through the openai SDK to /v1/completions, with an API key")
    a = ap.parse_args(argv)
    global SMALL, SERVER_CHECKOUT
    if a.task:
        SMALL = TASK
    if a.server_checkout:
        SERVER_CHECKOUT = tuple(a.server_checkout)
    if a.schedule:
        SERVER_ARGS[:] = ["--schedule", a.schedule]
    key = API_KEY if a.openai else None
    if a.openai:                                  # the paper arm and the join test speak /v1/generate's own stream
        a.skip = ",".join(filter(None, [a.skip, "paper", "join", "long-join"]))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    skip = set(filter(None, a.skip.split(",")))
    levels = [int(x) for x in a.levels.split(",")]
    res = {"small": {}, "paper": {}}
    if (out / "load.json").is_file():            # arms not run this time keep their earlier results
        res = json.loads((out / "load.json").read_text())
    res.update({"machine": {"cpu": machine(), "python": platform.python_version()}, "client": (
                    "openai SDK -> /v1/completions, API key" if a.openai else "httpx -> /v1/generate"),
                "model": a.model, "small_request": SMALL, "paper_request": PAPER,
                "admit_wait": a.admit_wait if a.admit_wait is not None else ServiceOptions().admit_wait})
    res.setdefault("dates", {})
    for arm_name in {"engine", "engine-loop", "small", "paper", "join", "long-join", "soak"} - skip:
        res["dates"][arm_name] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    if "engine" not in skip:
        res["engine_scaling"] = engine_scaling(a.model, levels, a.threads)
        res["step_cost"] = step_cost(a.model, a.threads)
    if "engine-loop" not in skip:
        budgets = [int(x) for x in a.budgets.split(",")] if a.budgets else None
        temperatures = [float(x) for x in a.temperatures.split(",")] if a.temperatures else None
        res["engine_loop"] = engine_loop(a.model, max(levels), a.per_client, a.threads, a.admit_wait, budgets,
                                         temperatures)
    modes = {"continuous": {"small": 140, "paper": 140},
             "sequential": {"small": SMALL["beams"] * SMALL["candidates"], "paper": 70}}
    for mode, rows in modes.items():
        for kind in ("small", "paper"):
            if kind in skip:
                continue
            srv = ServerProcess(a.model, rows[kind], a.threads, out / f"server-{mode}-{kind}.log",
                                a.admit_wait, key).wait_ready()
            try:
                lv = levels if kind == "small" else [1, 4]
                per = a.per_client if kind == "small" else 2
                res[kind][mode] = []
                alone = mode == "sequential" and kind == "small"       # also the same requests, each alone
                if alone:
                    res[kind]["alone"] = []
                for n in lv:
                    r = arm(srv, kind, n, per, a.max_seconds, openai_sdk=a.openai)
                    res[kind][mode].append(r)
                    print(mode, kind, json.dumps(r), flush=True)
                    if alone:
                        res[kind]["alone"].append(arm(srv, kind, n, per, a.max_seconds, senders=1,
                                                      openai_sdk=a.openai))
                if kind == "paper" and mode == "continuous" and "join" not in skip:
                    res["join"] = asyncio.run(join_test(srv.url))
                    print("join", json.dumps(res["join"]), flush=True)
            finally:
                srv.stop()
            (out / "load.json").write_text(json.dumps(res, indent=2))
    for kind in ("small", "paper"):
        c, s = res[kind].get("continuous"), res[kind].get("sequential")
        if c and s:
            alone = res[kind].get("alone") or [None] * len(c)
            res[kind]["ratio"] = [{"clients": x["clients"], "throughput": x["requests_per_s"] / y["requests_per_s"],
                                   "p95_over_single": x["p95_s"] / s[0]["p50_s"],
                                   **(latency_ratios(x, z) if z and "latency_s" in x else {})}
                                  for x, y, z in zip(c, s, alone)]
    if "long-join" not in skip:
        from tokenizers import Tokenizer

        from dbs_fast.api import resolve_model_dir
        from dbs_fast.bench.contexts import context_text

        tok = Tokenizer.from_file(str(resolve_model_dir(a.model) / "tokenizer.json"))
        text = context_text(tok, a.join_context)
        res["long_join"] = {"context_tokens": a.join_context}
        for chunked in (True, False):
            srv = ServerProcess(a.model, 140, a.threads, out / f"server-long-join-{chunked}.log", a.admit_wait, key,
                                chunked_prefill=chunked).wait_ready()
            try:
                asyncio.run(long_join_test(srv.url, "It is"))           # warm-up: kernels compiled
                r = asyncio.run(long_join_test(srv.url, text))
            finally:
                srv.stop()
            res["long_join"]["pieces" if chunked else "whole"] = r
            print("long-join", "pieces" if chunked else "whole", json.dumps(r), flush=True)
        (out / "load.json").write_text(json.dumps(res, indent=2))
    if "soak" not in skip:
        srv = ServerProcess(a.model, 140, a.threads, out / "server-soak.log", a.admit_wait, key).wait_ready()
        try:
            rss0 = srv.rss()
            res["soak"] = asyncio.run(soak(srv.url, a.soak, 8, srv.rss, openai_sdk=a.openai))
            counts = srv.metrics("dbs_requests_total")
            res["soak"].update(rss_start_gb=rss0, rss_end_gb=srv.rss(), server_alive=srv.proc.poll() is None,
                               health=__import__("httpx").get(srv.url + "/health", timeout=30).status_code,
                               statuses={k: counts.get(f'dbs_requests_total{{status="{k}"}}', 0.0)
                                         for k in ("ok", "invalid", "disconnected", "error", "refused")})
            print("soak", json.dumps(res["soak"]), flush=True)
        finally:
            srv.stop()
    (out / "load.json").write_text(json.dumps(res, indent=2))
    if res["small"]:
        plot(res, out / "load.png")
    print(f"wrote {out / 'load.json'}")
    return 0



if __name__ == "__main__":
    sys.exit(main())
