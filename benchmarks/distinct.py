"""The distinct-row schedule against the plain one: the same texts, the model rows each computes,
and the time per generation, in one process with the two arms taking turns on every request.

Settings: `default` (the `generate` defaults on the paper's 50 keyword sets), `paper` (`--paper`
on the same sets) and `commongen` (the CommonGen preset with `--guarantee` on the first N dev
concept sets). Request i takes seed i; the arms alternate which goes first. Per setting: texts
equal both ways, model rows over the plain schedule's row-steps, and the median ratio of the
seconds per generation (plain / distinct), pair by pair.

    python -m benchmarks.distinct --settings default,paper,commongen --sets 50 --commongen 100 --out runs/distinct
"""
from __future__ import annotations

import argparse
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--settings", default="default,paper,commongen")
    ap.add_argument("--sets", type=int, default=50, help="paper keyword sets for default and paper")
    ap.add_argument("--commongen", type=int, default=100, help="CommonGen dev sets")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default="runs/distinct")
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    arms = {s: DirectedBeamSearch(a.model, schedule=s, threads=a.threads) for s in ("distinct", "plain")}
    for dbs in arms.values():                                  # warm-up: kernels compiled, pages in
        dbs.generate("A", "day", seed=0)
    res = {"machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M %Z"), "model": a.model, "settings": {}}
    for setting in a.settings.split(","):
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
