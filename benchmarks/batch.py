"""`dbs-fast run-batch` measured: throughput against one-at-a-time generation, and peak memory
against the input's length.

- throughput: the service load test's small requests (b = s = 2, CommonGen concept sets,
  `--order any`, 32 tokens, context "A"), N of them, generated one at a time in one process
  (`DirectedBeamSearch.generate`, each after the last) and by `run_batch` (continuous batching,
  `--max-rows 140`), in the same run, taking turns twice; requests per second of each.
- memory: `dbs-fast run-batch` in a child process over a short and a long file of tiny requests
  (b = s = 1, 2 tokens; lines repeat), its peak RSS for each.

    python -m benchmarks.batch --requests 200 --memory-lines 200,20000 --out runs/batch
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from benchmarks.load import SMALL, bodies
from dbs_fast.api import DirectedBeamSearch
from dbs_fast.bench.machine import machine
from dbs_fast.config import DBSConfig
from dbs_fast.serving.batch_jobs import run_batch
from dbs_fast.serving.service import ServiceOptions


def one_at_a_time(dbs, work: list[dict]) -> float:
    cfg = replace(DBSConfig(), **{k: v for k, v in SMALL.items() if k != "context"})
    t0 = time.perf_counter()
    for b in work:
        dbs.generate(SMALL["context"], b["keywords"], seed=b["seed"], config=cfg)
    return time.perf_counter() - t0


def batched(dbs, work: list[dict], model: str, tmp: Path) -> float:
    inp, out = tmp / "in.jsonl", tmp / "out.jsonl"
    inp.write_text("".join(json.dumps({**b, "id": f"r{i}"}) + "\n" for i, b in enumerate(work)))
    out.unlink(missing_ok=True)
    t0 = time.perf_counter()
    counts = run_batch(inp, out, ServiceOptions(model=model, max_rows=140, timeout=float("inf")), dbs=dbs)
    assert counts["ok"] == len(work) and counts["failed"] == 0, counts
    return time.perf_counter() - t0


def peak_rss(lines: int, model: str, tmp: Path) -> dict:
    """run-batch over `lines` tiny requests in a child process: its peak RSS (bytes) and seconds."""
    inp, out = tmp / f"tiny{lines}.jsonl", tmp / f"tiny{lines}.out.jsonl"
    sets = [b["keywords"] for b in bodies("small", 50)]
    inp.write_text("".join(json.dumps({"id": f"t{i}", "keywords": sets[i % 50], "beams": 1, "candidates": 1,
                                       "max_new_tokens": 2, "stop": "max"}) + "\n" for i in range(lines)))
    out.unlink(missing_ok=True)
    probe = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); "
             "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(r.returncode)")
    cmd = [sys.executable, "-c", probe, sys.executable, "-m", "dbs_fast.cli", "run-batch", "-i", str(inp), "-o",
           str(out), "--model", model]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(p.stderr[-2000:])
    assert sum(1 for _ in open(out)) == lines
    return {"lines": lines, "peak_rss_bytes": int(p.stdout.split()[-1]) * 1024, "seconds": time.perf_counter() - t0}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--memory-lines", default="200,20000")
    ap.add_argument("--skip", default="", help="comma-separated: throughput, memory")
    ap.add_argument("--out", default="runs/batch")
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    res = {"machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M %Z"), "requests": a.requests, "small": SMALL}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        if "throughput" not in a.skip:
            dbs = DirectedBeamSearch(a.model, quiet=True)
            work = bodies("small", a.requests)
            one_at_a_time(dbs, work[:4])                                        # warm-up: kernels compiled
            runs = []
            for turn in range(2):                                               # taking turns: A B, B A
                pair = {}
                for arm in (("alone", "batch") if turn == 0 else ("batch", "alone")):
                    secs = one_at_a_time(dbs, work) if arm == "alone" else batched(dbs, work, a.model, tmp)
                    pair[arm] = a.requests / secs
                    print(f"[batch] {arm}: {pair[arm]:.2f} req/s", flush=True)
                runs.append({**pair, "ratio": pair["batch"] / pair["alone"]})
            res["throughput"] = runs
        if "memory" not in a.skip:
            res["memory"] = [peak_rss(int(n), a.model, tmp) for n in a.memory_lines.split(",")]
            for m in res["memory"]:
                print(f"[batch] {m['lines']} lines: peak RSS {m['peak_rss_bytes'] / 2**20:.0f} MiB, "
                      f"{m['seconds']:.0f} s", flush=True)
    (out / "batch.json").write_text(json.dumps(res, indent=2))
    print(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
