"""The distinct-row schedule against the plain one: the same texts, the model rows each computes,
and the time per generation, in one process with the two arms taking turns on every request.

Settings: `default` (the `generate` defaults on the paper's 50 keyword sets), `paper` (`--paper`
on the same sets) and `commongen` (the CommonGen preset with `--guarantee` on the first N dev
concept sets). Request i takes seed i; the arms alternate which goes first. Per setting: texts
equal both ways, model rows over the plain schedule's row-steps, and the median ratio of the
seconds per generation (plain / distinct), pair by pair.

    python -m benchmarks.distinct --settings default,paper,commongen --sets 50 --commongen 100 --out runs/distinct

`--step-rows 70,40,7,1` also times one decode step of the default at b = 7, s = 10 (70 attention
slots, a prefix of 41 columns) computing that many distinct rows (median of 7): what a step
costs before its first row and per row.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

from dbs_fast.api import DirectedBeamSearch
from dbs_fast.bench.machine import machine
from dbs_fast.config import preset

EVAL = Path(__file__).resolve().parents[2] / "shared" / "data" / "eval"


def workload(setting: str, n: int) -> tuple[list[list[str]], object, str]:
    """(keyword sets, config, context) of a setting."""
    if setting == "commongen":
        sets = [line.split() for line in (EVAL / "commongen_dev.txt").read_text().splitlines()[:n]]
        cfg, ctx = preset("commongen")
        return sets, replace(cfg, guarantee=True), ctx
    sets = [line.strip().split(",") for line in (EVAL / "paper_50_keyword_sets.txt").read_text().splitlines()[:n]]
    cfg, ctx = preset(None, setting == "paper")
    return sets, cfg, ctx


def run_setting(arms: dict, setting: str, n: int, log) -> dict:
    sets, cfg, ctx = workload(setting, n)
    rows = []
    for i, kws in enumerate(sets):
        order = ("distinct", "plain") if i % 2 == 0 else ("plain", "distinct")
        got = {a: arms[a].generate(ctx, kws, seed=i, config=cfg) for a in order}
        d, p = got["distinct"], got["plain"]
        rows.append({"set": ",".join(kws), "same": d.generated == p.generated, "seconds": [d.seconds, p.seconds],
                     "model_rows": [d.timings["model_rows"], p.timings["model_rows"]],
                     "plain_row_steps": d.timings["plain_row_steps"]})
        log(f"[{setting}] {i}: same={rows[-1]['same']} rows {d.timings['model_rows']}/{p.timings['model_rows']} "
            f"{d.seconds:.2f} s / {p.seconds:.2f} s")
    return {"config": cfg.to_dict(), "n": len(rows),
            "same": sum(r["same"] for r in rows),
            "rows_ratio": sum(r["model_rows"][0] for r in rows) / sum(r["plain_row_steps"] for r in rows),
            "time_ratio_median": statistics.median(r["seconds"][1] / r["seconds"][0] for r in rows),
            "seconds_median": [statistics.median(r["seconds"][k] for r in rows) for k in (0, 1)],
            "requests": rows}


def step_rows(dbs, counts: list[int], repeats: int = 7) -> dict:
    """Seconds of one decode step at 70 slots, computing `n` distinct rows, for n in `counts`."""
    import numpy as np

    dec, m = dbs.decoder, dbs.backend.model
    ids = np.array([m.encode("It is")])
    _, cache = dec.prefill(ids, np.ones_like(ids), m.kv_heads, m.head_dim, 10, 5, 90)
    cache.regroup(np.zeros(7, np.int64))
    rng = np.random.default_rng(0)
    for _ in range(8):                                         # eight chunks: a prefix of 41 columns
        for _ in range(5):
            dec.step(rng.integers(100, 5000, cache.chunk_mask.shape[0]), cache)
        cache.keep(rng.choice(cache.chunk_mask.shape[0], 7, replace=False))
    for _ in range(2):
        dec.step(rng.integers(100, 5000, 70), cache)

    def fresh():
        c = copy.copy(cache)
        c.chunk, c.chunk_mask = [x.copy() for x in cache.chunk], cache.chunk_mask.copy()
        return c

    out = {}
    for n in counts:
        secs = []
        for _ in range(repeats):
            c, t0 = fresh(), time.perf_counter()
            dec.step(rng.integers(100, 5000, n), c, rows=(np.arange(70) % n, np.arange(n)))
            secs.append(time.perf_counter() - t0)
        out[n] = statistics.median(secs)
        print(f"step at {n} computed rows of 70 slots: {1e3 * out[n]:.1f} ms", flush=True)
    return {"prefix_columns": int(cache.mask.shape[1]), "seconds": out}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--settings", default="default,paper,commongen")
    ap.add_argument("--sets", type=int, default=50, help="paper keyword sets for default and paper")
    ap.add_argument("--commongen", type=int, default=100, help="CommonGen dev sets")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--step-rows", default="", help="comma-separated computed-row counts to time one step at")
    ap.add_argument("--out", default="runs/distinct")
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    arms = {s: DirectedBeamSearch(a.model, schedule=s, threads=a.threads) for s in ("distinct", "plain")}
    for dbs in arms.values():                                  # warm-up: kernels compiled, pages in
        dbs.generate("A", "day", seed=0)
    res = {"machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M %Z"), "model": a.model, "settings": {}}
    if a.step_rows:
        res["step_rows"] = step_rows(arms["distinct"], [int(n) for n in a.step_rows.split(",")])
        (out / "distinct.json").write_text(json.dumps(res, indent=2))
    for setting in filter(None, a.settings.split(",")):
        r = run_setting(arms, setting, a.commongen if setting == "commongen" else a.sets,
                        lambda m: print(m, file=sys.stderr, flush=True))
        res["settings"][setting] = r
        print(f"{setting}: same texts {r['same']}/{r['n']}, model rows {r['rows_ratio']:.3f} of the plain schedule, "
              f"plain/distinct time {r['time_ratio_median']:.2f}x (median of pairs; {r['seconds_median'][0]:.2f} vs "
              f"{r['seconds_median'][1]:.2f} s)", flush=True)
        (out / "distinct.json").write_text(json.dumps(res, indent=2))
    print(res["machine"])
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
