"""The HTTP service over loopback: a real uvicorn server on a free port, the tiny random GPT-2."""
from __future__ import annotations

import json
import socket
import threading
import time
from dataclasses import replace

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")

from dbs_fast.api import DirectedBeamSearch  # noqa: E402
from dbs_fast.config import DBSConfig  # noqa: E402
from dbs_fast.evaluation.metrics import false_end, word_loop  # noqa: E402
from dbs_fast.serving.service import ServiceOptions, create_app  # noqa: E402

SMALL = {"beams": 2, "candidates": 3, "chunk": 4, "max_new_tokens": 16}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """uvicorn in a thread, serving `app` on loopback until `stop`."""

    def __init__(self, app):
        self.app, self.port = app, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.02)

    def wait_ready(self, timeout=120):
        t0 = time.time()
        while (h := httpx.get(self.url + "/health")).status_code != 200:
            assert h.json()["status"] != "failed" and time.time() - t0 < timeout, h.json()
            time.sleep(0.05)
        return self

    def stop(self):
        self.server.should_exit = True
        self.thread.join(60)


@pytest.fixture(scope="module")
def dbs(exported):
    return DirectedBeamSearch(exported["gpt2"])


@pytest.fixture(scope="module")
def server(dbs):
    s = Server(create_app(ServiceOptions(max_rows=24, max_queue=8), dbs=dbs)).wait_ready()
    yield s
    s.stop()


def events(lines) -> list[tuple[str, dict]]:
    out, kind = [], None
    for line in lines:
        if line.startswith("event: "):
            kind = line[7:]
        elif line.startswith("data: "):
            out.append((kind, json.loads(line[6:])))
    return out


def test_generate_answers_the_json_of_generate_and_the_same_text(server, dbs):
    r = httpx.post(server.url + "/v1/generate", json={"context": "It is", "keywords": "colony,enemy", "seed": 3,
                                                      **SMALL, "lambda": 15.0}, timeout=60)
    assert r.status_code == 200, r.text
    got = r.json()
    want = dbs.generate("It is", "colony,enemy", seed=3, config=replace(DBSConfig(), **SMALL, lam=15.0)).to_dict()
    assert set(got) == set(want)
    assert got["generated"] == want["generated"] and got["found"] == want["found"]


def test_requests_served_together_get_the_text_they_get_alone(server, dbs):
    jobs = [("It is", "colony", 0, {}), ("The quick brown fox jumps over", "enemy|mouth", 1, {"min_p": 0.1}),
            ("A", "speed,river", 2, {"ban": "fox"}), ("It is", "meet", 5, {"order": "any", "guarantee": True})]
    out = [None] * len(jobs)

    def send(i, ctx, kw, seed, extra):
        out[i] = httpx.post(server.url + "/v1/generate", json={"context": ctx, "keywords": kw, "seed": seed,
                                                               **SMALL, **extra}, timeout=120).json()

    threads = [threading.Thread(target=send, args=(i, *j)) for i, j in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for (ctx, kw, seed, extra), got in zip(jobs, out):
        cfg_extra = {k: v for k, v in extra.items() if k != "ban"}
        want = dbs.generate(ctx, kw, seed=seed, config=replace(DBSConfig(), **SMALL, **cfg_extra), ban=extra.get("ban"))
        assert got["generated"] == want.generated, (ctx, kw)
        assert not word_loop(got["generated"]) and not (got["stopped"] == "sentence" and false_end(got["generated"]))


@pytest.mark.parametrize("body, field", [
    ({"keywords": "colony", "beams": 0}, "beams"),
    ({"keywords": "colony", "top_p": 1.5}, "top_p"),
    ({"keywords": "colony", "min_p": -0.1}, "min_p"),
    ({"keywords": "colony", "lambda": -1}, "lambda"),
    ({"keywords": "colony", "order": "random"}, "order"),
    ({"keywords": "run|"}, "keywords"),
    ({"keywords": "colony", "ban": "colonies"}, "ban"),
    ({"keywords": "colony", "beams": "many"}, "beams"),
    ({"keywords": "colony", "bogus": 1}, "bogus"),
    ({"keywords": "colony", "beams": 10, "candidates": 10}, "candidates"),     # 100 rows > max_rows 24
    ({"keywords": "colony", "seed": -1}, "seed"),
    ({"keywords": "colony", "beams": 100000}, "beams"),                         # no machine holds it
    ({"keywords": "colony", "max_new_tokens": 100000}, "max_new_tokens"),      # past the model's window
    ({"keywords": "colony", "context": "word " * 300}, "context"),
    ({"keywords": [f"w{i}" for i in range(63)]}, "keywords"),
    ({"keywords": "colony", "task": "poetry"}, "task"),
    ({"keywords": "colony,qzxvbnmw"}, "keywords"),                             # a word the embeddings lack
    ({"keywords": "colony", "beams": "7"}, "beams"),                           # wrong JSON types: not coerced
    ({"keywords": "colony", "guarantee": "yes"}, "guarantee"),
    ({"keywords": "colony", "lambda": "20"}, "lambda"),
    ({"keywords": "colony", "task": "commongen", "paper": True}, "paper"),     # two presets
])
def test_bad_input_is_a_400_in_openais_shape_naming_the_field(server, body, field):
    r = httpx.post(server.url + "/v1/generate", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert set(r.json()) == {"error"} and set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert r.json()["error"]["param"] == field and r.json()["error"]["type"] == "invalid_request_error", r.json()
    assert "--" not in r.json()["error"]["message"]                  # the door's words: no CLI flag


def test_the_suggestion_for_a_word_the_embeddings_lack_works_over_http(server):
    """The 400 for a keyword GloVe lacks names the request fields that place it, and a request
    that takes them is answered with the word in the text."""
    body = {"context": "It is", "keywords": "colony,qzxvbnmw", "seed": 0, **SMALL}
    r = httpx.post(server.url + "/v1/generate", json=body, timeout=30)
    assert r.status_code == 400 and "use `subword_fallback` with `guarantee`" in r.json()["error"]["message"], r.text
    r = httpx.post(server.url + "/v1/generate", json={**body, "subword_fallback": True, "guarantee": True}, timeout=60)
    assert r.status_code == 200 and r.json()["success_rate"] == 1.0 and "qzxvbnmw" in r.json()["generated"], r.text


def test_unknown_path_is_404_and_openapi_lists_generate(server):
    assert httpx.get(server.url + "/v2/nothing").status_code == 404
    assert httpx.get(server.url + "/v1/generate").status_code == 405
    spec = httpx.get(server.url + "/openapi.json").json()
    assert "/v1/generate" in spec["paths"] and "lambda" in json.dumps(spec)
    assert "--" not in json.dumps(spec["components"])           # the fields described in the door's words


def test_stream_sends_certain_text_per_chunk_then_the_result(server):
    body = {"context": "It is", "keywords": "colony,enemy", "seed": 1, **SMALL, "stream": True, "stop": "max"}
    with httpx.stream("POST", server.url + "/v1/generate", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        ev = events(r.iter_lines())
    kinds = [k for k, _ in ev]
    assert kinds[-1] == "result" and set(kinds[:-1]) == {"chunk"} and len(kinds) >= 2
    final = ev[-1][1]
    texts = [p["text"] for k, p in ev[:-1]]
    assert all(final["generated"].startswith(t) for t in texts)
    assert all(a == b[:len(a)] for a, b in zip(texts, texts[1:]))
    assert [p["chunk"] for _, p in ev[:-1]] == list(range(1, len(texts) + 1))
    plain = httpx.post(server.url + "/v1/generate", json={**body, "stream": False}, timeout=60).json()
    assert plain["generated"] == final["generated"]


def test_a_streams_chunks_carry_their_certain_tokens_logprobs_when_asked(server):
    """With `logprobs`, each `chunk` event holds its certain tokens' entries: a prefix of the
    result's `logprobs`, growing with the text; without, no chunk has the field."""
    body = {"context": "It is", "keywords": "colony,enemy", "seed": 1, **SMALL, "stream": True, "stop": "max",
            "stream_lag": 1, "logprobs": 2}
    with httpx.stream("POST", server.url + "/v1/generate", json=body, timeout=60) as r:
        ev = events(r.iter_lines())
    final, chunks = ev[-1][1], [p for k, p in ev[:-1]]
    assert any(c["logprobs"] for c in chunks)
    for c in chunks:
        assert c["logprobs"] == final["logprobs"][:len(c["logprobs"])]
        assert "".join(e["token"] for e in c["logprobs"]).startswith(c["text"])
    with httpx.stream("POST", server.url + "/v1/generate", json={**body, "logprobs": None}, timeout=60) as r:
        assert all("logprobs" not in p for k, p in events(r.iter_lines()) if k == "chunk")


def test_metrics_and_health(server):
    h = httpx.get(server.url + "/health").json()
    assert h["status"] == "ready" and h["max_rows"] == 24
    # one request answered and one refused, so that the test counts its own (it runs alone too)
    ok = {"context": "It is", "keywords": "colony", "seed": 3, **SMALL}
    assert httpx.post(server.url + "/v1/generate", json=ok, timeout=60).status_code == 200
    assert httpx.post(server.url + "/v1/generate", json={"keywords": "run|"}, timeout=30).status_code == 400
    text = httpx.get(server.url + "/metrics").text
    for name in ("dbs_requests_total", "dbs_queue_depth", "dbs_batch_rows", "dbs_running_batches", "dbs_candidate_tokens_total",
                 "dbs_request_latency_seconds_bucket", "dbs_candidate_tokens_per_second"):
        assert name in text
    assert 'dbs_requests_total{status="ok"}' in text and 'dbs_requests_total{status="invalid"}' in text
    # the decode graph counts what it binds from host memory (on a GPU: what crosses the bus)
    moved = next(float(line.split()[-1]) for line in text.splitlines() if line.startswith("dbs_host_device_bytes_total"))
    assert moved > 0
    # the context store: every prefill looked in it (its hit rate: hits / lookups, reused / context tokens)
    stat = {line.split()[0]: float(line.split()[-1]) for line in text.splitlines()
            if line.startswith("dbs_context_cache_")}
    assert stat["dbs_context_cache_lookups"] >= 1 and stat["dbs_context_cache_context_tokens"] >= 1
    assert 0 <= stat["dbs_context_cache_hits"] <= stat["dbs_context_cache_lookups"]


# -- back-pressure, disconnects, timeouts, failures: a server whose model steps slowly ------------
@pytest.fixture()
def slow(exported, monkeypatch):
    dbs = DirectedBeamSearch(exported["gpt2"])
    model = dbs.decoder or dbs.backend          # what runs the model: the decode graph, or the rows'
    step, state = model.step, {"delay": 0.0, "fail": False}

    def slow_step(*args, **kwargs):
        if state["fail"]:
            state["fail"] = False
            raise RuntimeError("injected failure")
        time.sleep(state["delay"])
        return step(*args, **kwargs)

    model.step = slow_step
    s = Server(create_app(ServiceOptions(max_rows=6, max_queue=1), dbs=dbs)).wait_ready()
    state["delay"] = 0.02
    yield s, state
    s.stop()


LONG = {"context": "It is", "keywords": "colony", "beams": 1, "candidates": 6, "chunk": 1, "max_new_tokens": 200,
        "stop": "max"}


def _metric(url, status) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(f'dbs_requests_total{{status="{status}"}}'):
            return float(line.split()[-1])
    return 0.0


def _wait(cond, timeout=30):
    t0 = time.time()
    while not cond():
        assert time.time() - t0 < timeout
        time.sleep(0.02)


def test_full_queue_is_429_and_a_disconnect_drops_the_rows(slow):
    s, _ = slow
    queued = {}
    with httpx.stream("POST", s.url + "/v1/generate", json={**LONG, "stream": True}, timeout=60) as r:
        lines = r.iter_lines()
        first = next(l for l in lines if l.startswith("data: "))       # running: all 6 rows are taken
        assert json.loads(first[6:])["chunk"] == 1
        t = threading.Thread(target=lambda: queued.update(r=httpx.post(s.url + "/v1/generate", json={
            **LONG, "max_new_tokens": 4}, timeout=60)))
        t.start()
        _wait(lambda: httpx.get(s.url + "/health").json()["queue"] == 1)
        refused = httpx.post(s.url + "/v1/generate", json={**LONG, "max_new_tokens": 4}, timeout=60)
        assert refused.status_code == 429 and int(refused.headers["Retry-After"]) >= 1
    # the stream is closed mid-way: its rows leave at the next boundary, the queued request runs
    t.join(60)
    assert queued["r"].status_code == 200
    _wait(lambda: _metric(s.url, "disconnected") == 1)
    _wait(lambda: httpx.get(s.url + "/health").json()["rows"] == 0)


def test_timeout_is_504_and_a_failing_request_spares_the_loop(slow):
    s, state = slow
    r = httpx.post(s.url + "/v1/generate", json={**LONG, "timeout": 0.3}, timeout=60)
    assert r.status_code == 504 and r.json()["error"]["type"] == "server_error"
    state["fail"] = True
    r = httpx.post(s.url + "/v1/generate", json={**LONG, "max_new_tokens": 4}, timeout=60)
    assert r.status_code == 500 and "injected failure" in r.json()["error"]["message"]
    r = httpx.post(s.url + "/v1/generate", json={**LONG, "max_new_tokens": 4}, timeout=60)
    assert r.status_code == 200 and r.json()["new_tokens"] == 4


def test_health_is_503_until_the_model_is_loaded(exported, monkeypatch):
    from dbs_fast.serving import service

    gate = threading.Event()
    load = service.Service._load
    monkeypatch.setattr(service.Service, "_load", lambda self: (gate.wait(60), load(self)))
    s = Server(create_app(ServiceOptions(model=str(exported["gpt2"]))))
    try:
        h = httpx.get(s.url + "/health")
        assert h.status_code == 503 and h.json()["status"] == "loading"
        r = httpx.post(s.url + "/v1/generate", json={"keywords": "colony"})
        assert r.status_code == 503 and "Retry-After" in r.headers
        gate.set()
        s.wait_ready()
        assert httpx.get(s.url + "/health").json()["status"] == "ready"
    finally:
        gate.set()
        s.stop()


def test_shutdown_finishes_running_work_within_the_grace_period(exported):
    from dbs_fast.serving.batcher import Batcher, Job

    dbs = DirectedBeamSearch(exported["gpt2"])
    cfg = replace(DBSConfig(), **{**SMALL, "max_new_tokens": 64, "stop": "max"})     # 16 chunks: still running
    for grace, want in ((60.0, "result"), (0.0, "error")):
        got = []
        b = Batcher(dbs, max_rows=24, max_queue=4)
        model = dbs.decoder or dbs.backend
        step = model.step
        model.step = lambda *a, **kw: (time.sleep(0.01), step(*a, **kw))[1]
        try:
            b.submit(Job(dbs.request("It is", "colony", None, 0, cfg), cfg, send=lambda k, p: got.append((k, p))))
            _wait(lambda: b.n_rows > 0)
            b.stop(grace)
        finally:
            model.step = step
        assert [k for k, _ in got] == [want]
        assert not b.submit(Job(dbs.request("It is", "colony", None, 0, cfg), cfg, send=None))   # stopped
        if want == "error":
            assert got[0][1][0] == 503


@pytest.mark.parametrize("own", [({"max_new_tokens": 64}, {"max_new_tokens": 12}),
                                 ({"temperature": 1.3, "top_p": 0.9}, {"temperature": 0.0, "top_p": 0.5}),
                                 ({"presence_penalty": 0.6}, {"frequency_penalty": 0.4, "repetition_penalty": 1.2}),
                                 ({"logit_bias": {262: 8.0}}, {"logit_bias": {11: 5.0, 13: -100.0}})],
                         ids=["budget", "temperature-top_p", "penalties", "logit_bias"])
def test_requests_that_differ_in_their_own_settings_alone_decode_in_one_batch(exported, own):
    """Settings that are each request's own (its budget, temperature, top_p, penalties and logit
    bias) do not split the engine's batches: two such jobs run in one, and each gets its text alone."""
    from dbs_fast.serving.batcher import Batcher, Job
    from dbs_fast.serving.service import Metrics

    dbs = DirectedBeamSearch(exported["gpt2"])
    base = replace(DBSConfig(), **{**SMALL, "stop": "max"})
    cfgs = [replace(base, **o) for o in own]
    got, batches, gauge = {}, set(), set()
    metrics = Metrics()
    b = Batcher(dbs, max_rows=24, max_queue=4, metrics=metrics)
    model = dbs.decoder or dbs.backend
    step = model.step

    def counted(*a, **kw):                    # the engine thread's running batches, at every step
        batches.add(len(b.batches))
        gauge.add(metrics.registry.get_sample_value("dbs_running_batches"))
        return step(*a, **kw)

    model.step = counted
    try:
        for i, cfg in enumerate(cfgs):
            b.submit(Job(dbs.request("It is", "colony", None, i, cfg), cfg, send=lambda k, p, i=i: got.update({i: (k, p)})))
        _wait(lambda: len(got) == 2)
    finally:
        model.step = step
        b.stop(0.0)
    assert batches == {1} and max(gauge) == 1          # the metric says so too
    for i, cfg in enumerate(cfgs):
        kind, result = got[i]
        assert kind == "result" and result.generated == dbs.generate("It is", "colony", seed=i, config=cfg).generated
        assert result.new_tokens == cfg.max_new_tokens


def test_load_latency_ratios_pair_each_request_with_itself_alone():
    from benchmarks.load import latency_ratios

    alone = {"p50_s": 1.0, "p95_s": 2.0, "latency_s": {"0": 0.5, "1": 1.0, "2": 2.0, "3": 4.0}}
    loaded = {"p95_s": 5.0, "latency_s": {"0": 1.0, "1": 3.0, "2": 2.0, "3": 4.0}}     # request 1 alone took 1 s
    r = latency_ratios(loaded, alone)
    assert r["p95_over_alone_p95"] == 2.5
    assert r["slowdown_p50"] == 1.5 and 2.5 < r["slowdown_p95"] <= 3.0                # slow-downs 2, 3, 1, 1
    assert latency_ratios({**loaded, "latency_s": {"1": 3.0, "9": 1.0}}, alone)["slowdown_p95"] == 3.0


def test_the_load_tests_engine_loop_serves_every_request_both_ways_and_accounts_the_engines_time(exported):
    """The load test's in-process arm: closed-loop threads against the Batcher, continuous and one at
    a time; every request answered, and the engine thread's time split into waiting for returning
    clients, admitting and decoding."""
    from benchmarks.load import engine_loop

    r = engine_loop(exported["gpt2"], clients=3, per=2, threads=None, admit_wait=0.0)
    assert r["requests"] == 6
    for mode in ("continuous", "sequential"):
        secs = r[mode]["engine_seconds"]
        assert set(secs) == {"wait", "admit", "decode"} and secs["admit"] > 0 and secs["decode"] > 0
        assert sum(secs.values()) <= r[mode]["wall_s"] + 1.0
    assert r["ratio"] == r["continuous"]["requests_per_s"] / r["sequential"]["requests_per_s"]


def test_a_closed_loop_clients_next_request_joins_the_boundary_where_its_last_one_ended(dbs):
    """Request A ends while C runs; A's client sends B 30 ms after A's result (mid-chunk: a chunk
    takes >= 4 x 50 ms here). With admit_wait the loop waits at that boundary and B's first chunk is
    C's next one (B's only chunk: it ends with it); without, B waits for the chunk that has already
    started. The server's metrics count each wait at a boundary where requests ended: returned
    (B came in time), or timeout (nobody came)."""
    from dbs_fast.serving.batcher import Batcher, Job
    from dbs_fast.serving.service import Metrics

    short = replace(DBSConfig(), **{**SMALL, "max_new_tokens": 4, "stop": "max"})       # one chunk
    long = replace(DBSConfig(), **{**SMALL, "max_new_tokens": 64, "stop": "max"})       # 16 chunks
    model = dbs.decoder or dbs.backend
    step = model.step
    model.step = lambda *a, **kw: (time.sleep(0.05), step(*a, **kw))[1]
    try:
        for wait, between in ((1.0, [1]), (0.0, [2, 3])):
            events, done = [], threading.Event()
            metrics = Metrics()
            b = Batcher(dbs, max_rows=24, max_queue=8, admit_wait=wait, metrics=metrics)

            def send_b():
                time.sleep(0.03)
                b.submit(Job(dbs.request("It is", "river", None, 2, short), short,
                             send=lambda k, p: (events.append(("B", k)), k == "result" and done.set())))

            def on_a(kind, payload):
                events.append(("A", kind))
                if kind == "result":
                    threading.Thread(target=send_b).start()

            b.submit(Job(dbs.request("It is", "colony", None, 0, long), long, stream=True,
                         send=lambda k, p: events.append(("C", k))))
            _wait(lambda: b.n_rows > 0)
            b.submit(Job(dbs.request("It is", "dog", None, 1, short), short, send=on_a))
            assert done.wait(60)
            b.stop(0.0)
            a_end, b_end = events.index(("A", "result")), events.index(("B", "result"))
            assert events[a_end:b_end].count(("C", "chunk")) in between, (wait, events)
            waits = {o: (metrics.registry.get_sample_value("dbs_admit_wait_seconds_count", {"outcome": o}) or 0,
                         metrics.registry.get_sample_value("dbs_admit_wait_seconds_sum", {"outcome": o}) or 0)
                     for o in ("returned", "timeout")}
            if wait:     # B came about 30 ms after A's result
                assert waits["returned"][0] == 1 and 0.02 < waits["returned"][1] < wait, waits
            else:        # no wait: A's boundary found nobody yet
                assert waits["returned"][0] == 0 and waits["timeout"][0] >= 1, waits
    finally:
        model.step = step


@pytest.mark.parametrize("flag, value, says", [("--admit-wait", "-0.1", "`--admit-wait` must be"),
                                               ("--admit-wait", "5", "`--admit-wait` must be"),
                                               ("--max-rows", "0", "`--max-rows` must be"),
                                               ("--model", "/nonexistent", "neither an embedded model (default,")])
def test_serve_refuses_bad_options_with_exit_2_before_starting(flag, value, says, capsys):
    from dbs_fast.cli import main

    assert main(["serve", flag, value]) == 2
    assert says in capsys.readouterr().err


def test_a_long_context_joins_a_running_batch_in_pieces_between_its_chunks(exported, monkeypatch):
    """A context of several prefill slices that would join a running batch is prefilled one slice
    per chunk boundary into the context store (the running request's chunks go on between the
    pieces), then admitted; its result is the one it gets alone with no store at all."""
    from dbs_fast.kv import decoder
    from dbs_fast.kv.decoder import ContextStore
    from dbs_fast.serving import batcher
    from dbs_fast.serving.batcher import Batcher, Job

    monkeypatch.setattr(decoder, "PREFILL_SLICE", 4)
    monkeypatch.setattr(batcher, "PREFILL_SLICE", 4)
    dbs = DirectedBeamSearch(exported["gpt2"])
    dbs.decoder.store = ContextStore(10**9, granule=4)
    long = replace(DBSConfig(), **{**SMALL, "max_new_tokens": 64, "stop": "max"})
    short = replace(DBSConfig(), **SMALL)
    context = "The river ran past the old mill, where the miller and his children sat on the bank and"
    events, done, result = [], threading.Event(), {}
    ahead = dbs.prefill_ahead
    monkeypatch.setattr(dbs, "prefill_ahead", lambda r: (events.append("piece"), ahead(r))[1])
    b = Batcher(dbs, max_rows=24, max_queue=8)
    try:
        b.submit(Job(dbs.request("It is", "colony", None, 0, long), long, stream=True,
                     send=lambda k, p: events.append("chunk") if k == "chunk" else None))
        _wait(lambda: b.n_rows > 0)
        joiner = dbs.request(context, "river", None, 1, short)
        b.submit(Job(joiner, short, send=lambda k, p: (result.update({k: p}), done.set())))
        assert done.wait(60)
    finally:
        b.stop(0.0)
    n = len(joiner.context_ids)
    assert events.count("piece") == (n - 1) // 4 >= 3          # all but the last slice, one at a time
    first, last = events.index("piece"), len(events) - 1 - events[::-1].index("piece")
    between = events[first:last + 1]
    assert all(between[i + 1] == "chunk" for i, e in enumerate(between[:-1]) if e == "piece"), events
    alone = DirectedBeamSearch(exported["gpt2"], context_cache_mb=0).generate(context, "river", seed=1, config=short)
    assert result["result"].generated == alone.generated
