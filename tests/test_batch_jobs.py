"""`dbs-fast run-batch`: OpenAI's batch format and the plain forms, every request answered exactly
once, bad lines as error lines, and a killed job resumed to the texts of an uninterrupted one."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

pytest.importorskip("pydantic")

from dbs_fast.api import DirectedBeamSearch  # noqa: E402
from dbs_fast.cli import main as cli  # noqa: E402
from dbs_fast.config import DBSConfig  # noqa: E402
from dbs_fast.serving.batch_jobs import derived_seed, run_batch  # noqa: E402
from dbs_fast.serving.service import ServiceOptions  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SMALL = {"beams": 2, "candidates": 2}


@pytest.fixture(scope="module")
def model_dir(chat_model_dir):
    return chat_model_dir


@pytest.fixture(scope="module")
def dbs(model_dir):
    return DirectedBeamSearch(model_dir)


def _openai(cid, url, body):
    return json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": body})


def _lines(out: Path) -> dict:
    got = [json.loads(x) for x in out.read_text().splitlines()]
    ids = [g["custom_id"] for g in got]
    assert len(ids) == len(set(ids)), ids                     # each request answered once
    return {g["custom_id"]: g for g in got}


def _text(line: dict) -> str:
    body = line["response"]["body"]
    if "choices" in body:
        c = body["choices"][0]
        return c["message"]["content"] if "message" in c else c["text"]
    return body["generated"]


def test_every_line_is_answered_once_and_bad_lines_become_error_lines(dbs, model_dir, tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("\n".join([
        _openai("a", "/v1/completions", {"model": "gpt2", "prompt": "It is", "max_tokens": 6, "keywords": "colony",
                                         **SMALL}),
        _openai("b", "/v1/chat/completions", {"model": "gpt2", "messages": [{"role": "user", "content": "Hi"}],
                                              "max_tokens": 6, "keywords": ["enemy"], "seed": 3, **SMALL}),
        _openai("c", "/v1/completions", {"model": "gpt2", "prompt": "It is", "keywords": "colony", "beams": "7"}),
        _openai("d", "/v1/embeddings", {"model": "gpt2", "input": "x"}),
        _openai("a", "/v1/completions", {"model": "gpt2", "prompt": "x", "keywords": "colony"}),
        json.dumps({"keywords": "colony,enemy", "context": "The city", "id": "p1", "max_new_tokens": 6, **SMALL}),
        json.dumps({"keywords": "colony,qzxvbnmw", "id": "p2"}),
        "not json",
        _openai("e", "/v1/completions", {"model": "gpt2", "prompt": ["It is", "x"], "keywords": "colony"}),
    ]) + "\n")
    counts = run_batch(inp, out, ServiceOptions(model=str(model_dir), max_rows=24, max_queue=2), dbs=dbs)
    got = _lines(out)
    assert set(got) == {"a", "b", "c", "d", "a (line 5)", "p1", "p2", "line-8", "e"}
    assert counts["ok"] == 3 and counts["failed"] == 6 and counts["skipped"] == 0
    assert "a line for each prompt" in got["e"]["error"]["message"]         # a line takes one prompt
    for cid, param in (("c", "beams"), ("d", "url"), ("a (line 5)", "custom_id"), ("p2", "keywords"), ("e", "prompt")):
        assert got[cid]["response"] is None and got[cid]["error"]["param"] == param, got[cid]
    assert got["line-8"]["error"]["message"].startswith("line 8 is not JSON")
    # the answers are the service's bodies, with the seed the line gives, else one from its custom_id
    cfg = DBSConfig(max_new_tokens=6, **SMALL)
    assert got["a"]["response"]["body"]["object"] == "text_completion"
    assert _text(got["a"]) == dbs.generate("It is", "colony", seed=derived_seed(0, "a"), config=cfg).generated
    chat = dbs.chat_template.render([{"role": "user", "content": "Hi"}])
    chat_cfg = DBSConfig.chat(max_new_tokens=6, **SMALL)              # the chat door starts from its preset
    assert _text(got["b"]) == dbs.generate(chat, ["enemy"], seed=3, config=chat_cfg).generated
    plain = got["p1"]["response"]["body"]
    assert plain["generated"] == dbs.generate("The city", "colony,enemy", seed=derived_seed(0, "p1"), config=cfg).generated
    assert plain["keywords"] == ["colony", "enemy"] and got["p1"]["response"]["status_code"] == 200


def test_csv_rows_and_the_exit_code(model_dir, tmp_path, capsys):
    inp, out = tmp_path / "in.csv", tmp_path / "out.jsonl"
    inp.write_text("id,keywords,context,seed\nr1,colony,It is,4\nr2,\"colony,enemy\",,\nr3,enemy,The,many\n")
    args = ["run-batch", "-i", str(inp), "-o", str(out), "--model", str(model_dir), "--max-rows", "140"]
    assert cli(args) == 1                                          # one line failed
    got = _lines(out)
    assert got["r3"]["error"]["param"] == "seed" and got["r1"]["response"]["status_code"] == 200
    assert got["r1"]["response"]["body"]["context"] == "It is" and got["r2"]["response"]["body"]["context"] == "It is"
    assert "2 answered, 1 failed, 0 done before" in capsys.readouterr().err
    # all done before: nothing written again, and the exit code still says the output holds an error line
    assert cli(args) == 1 and len(_lines(out)) == 3
    assert "0 answered, 0 failed, 3 done before" in capsys.readouterr().err
    assert cli(["run-batch", "-i", str(tmp_path / "none.jsonl"), "-o", str(out), "--model", str(model_dir)]) == 2


@pytest.mark.integration
def test_a_job_killed_three_times_ends_with_the_texts_of_an_uninterrupted_one(model_dir, tmp_path):
    """SIGKILL at three random points of a 60-line job, each followed by the same command again:
    60 answered custom_ids, none twice, no truncated line, the texts of the uninterrupted run.
    `--max-rows` fits one request, so every run batches alike: a continuous batch's composition
    follows timing, and a last-bit difference between batch shapes can flip a draw."""
    import numpy as np

    n = 60
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"id": f"r{i}", "keywords": "colony,enemy", "beams": 2, "candidates": 3,
                                       "chunk": 2, "max_new_tokens": 12, "stop": "max"}) + "\n"
                           for i in range(n)))
    cmd = [sys.executable, "-m", "dbs_fast.cli", "run-batch", "-i", str(inp), "--model", str(model_dir),
           "--max-rows", "6", "--max-queue", "4", "--seed", "11"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    whole, cut = tmp_path / "whole.jsonl", tmp_path / "cut.jsonl"
    assert subprocess.run(cmd + ["-o", str(whole)], env=env, cwd=ROOT, capture_output=True).returncode == 0
    marks = sorted(np.random.default_rng(0).choice(np.arange(n // 10, n - n // 10), 3, replace=False))
    for mark in marks:                                             # each run starts where the last was killed
        proc = subprocess.Popen(cmd + ["-o", str(cut)], env=env, cwd=ROOT, stderr=subprocess.DEVNULL)
        deadline = time.time() + 300
        while time.time() < deadline and (not cut.exists() or cut.read_text().count("\n") < mark):
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        assert cut.read_text().count("\n") < n                    # killed before the end
    with open(cut, "a") as f:
        f.write('{"id": "batch_req_x", "custom_id": "r3')          # what a kill inside a write leaves
    assert subprocess.run(cmd + ["-o", str(cut)], env=env, cwd=ROOT, capture_output=True).returncode == 0
    assert cut.read_text().endswith("\n")
    resumed, full = _lines(cut), _lines(whole)
    assert set(resumed) == set(full) == {f"r{i}" for i in range(n)}
    assert {k: _text(v) for k, v in resumed.items()} == {k: _text(v) for k, v in full.items()}


def test_a_file_with_a_tenth_of_bad_lines_answers_every_good_one(dbs, model_dir, tmp_path):
    """Bad JSON, unknown fields, bad values and unknown keywords: one error line each, naming the
    field where there is one, and a valid answer for every other line."""
    bad = {3: "{not json", 11: json.dumps({"keywords": "colony", "id": "u", "colour": "red"}),
           19: json.dumps({"keywords": "colony", "id": "v", "beams": 0}),
           27: json.dumps({"keywords": "colony,qzxvbnmw", "id": "w"})}
    lines = [bad.get(i) or json.dumps({"id": f"g{i}", "keywords": "colony", "max_new_tokens": 4, **SMALL})
             for i in range(40)]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("\n".join(lines) + "\n")
    counts = run_batch(inp, out, ServiceOptions(model=str(model_dir), max_rows=24), dbs=dbs)
    got = _lines(out)
    assert counts["ok"] == 36 and counts["failed"] == 4 and len(got) == 40
    assert {k: v["error"]["param"] for k, v in got.items() if v["error"]} == \
        {"line-4": None, "u": "colour", "v": "beams", "w": "keywords"}
    assert all(v["response"]["status_code"] == 200 and _text(v) is not None for v in got.values() if not v["error"])


@pytest.mark.integration
def test_on_ray_data_two_workers_write_what_the_local_run_writes(model_dir, tmp_path):
    """The same file on a local Ray cluster, an actor pool of two engines: every custom_id once,
    the texts of the local run, seed for seed; run again, it finds everything done."""
    pytest.importorskip("ray.data")
    import ray

    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"id": f"r{i}", "keywords": "colony,enemy", "beams": 2, "candidates": 2,
                                       "max_new_tokens": 8}) + "\n" for i in range(12))
                   + _openai("chat", "/v1/chat/completions", {"model": "gpt2", "max_tokens": 6, "keywords": "enemy",
                                                              "messages": [{"role": "user", "content": "Hi"}],
                                                              **SMALL}) + "\n{bad\n")
    local, on_ray = tmp_path / "local.jsonl", tmp_path / "ray.jsonl"
    opts = ServiceOptions(model=str(model_dir), max_rows=4, threads=1, timeout=float("inf"))   # one at a time
    run_batch(inp, local, opts, job_seed=5)
    from dbs_fast.serving.batch_jobs import run_batch_ray

    tmp = tempfile.mkdtemp(prefix="ray", dir="/tmp")              # Ray's socket paths must stay short
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _temp_dir=tmp,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
    try:
        counts = run_batch_ray(inp, on_ray, opts, job_seed=5, workers=2, cpus_per_worker=1, batch_size=3)
        assert counts["ok"] == 13 and counts["failed"] == 1
        got, want = _lines(on_ray), _lines(local)
        assert set(got) == set(want) and len(got) == 14
        assert {k: _text(v) for k, v in got.items() if v["response"]} == \
            {k: _text(v) for k, v in want.items() if v["response"]}
        again = run_batch_ray(inp, on_ray, opts, job_seed=5, workers=2)
        assert again["skipped"] == 14 and again["ok"] == again["failed"] == 0
    finally:
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
