"""One decode step of an export on each cache layout, alternated: engine v2's `decode.onnx`
(one prefix per beam) against `model.onnx` (one cache row per candidate), same rows and prefix
length, random inputs (`export/timing.py`). Alternating rounds put both under the same machine
load, which a bench run (one contender after the other) cannot.

    python -m dbs_fast.benchmarks.layouts --model DIR [--rounds 4 --beams 7 --candidates 10
        --prefix 47 --used 2] [--against DIR2] [--out FILE.json]

`--against DIR2`: DIR's decode.onnx against DIR2's (two exports of one model, say before and
after a change of the graph) instead of against DIR's model.onnx.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from dbs_fast.benchmarks.host import decode_graph_export, machine
from dbs_fast.export.timing import feeds, median_run
from dbs_fast.prefix import DECODE_GRAPH


def run(model_dir: Path, rounds: int = 4, b: int = 7, s: int = 10, T: int = 47, threads: int | None = None,
        against: Path | None = None, used: int = 2) -> dict:
    from dbs_fast.session import make_session, read_manifest

    other = ("against", against / DECODE_GRAPH) if against else ("rows", model_dir / read_manifest(model_dir)["onnx"])
    graphs = {"v2": model_dir / DECODE_GRAPH, other[0]: other[1]}
    sessions = {k: make_session(p, "cpu", threads) for k, p in graphs.items()}
    x = {k: feeds(sess, b, s, T, used=used) for k, sess in sessions.items()}
    ms = {k: [] for k in graphs}
    for _ in range(rounds):
        for k, sess in sessions.items():
            ms[k].append(1e3 * median_run(sess, x[k], 3))
    med = {k: statistics.median(v) for k, v in ms.items()}
    return {"machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M %Z"), "model": str(model_dir),
            "against": str(against) if against else None, "beams": b, "candidates": s, "prefix": T, "used": used,
            "step_ms_per_round": ms, "step_ms_median": med, f"{other[0]}_over_v2": med[other[0]] / med["v2"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="an export with decode.onnx")
    for name, default in (("rounds", 4), ("beams", 7), ("candidates", 10), ("prefix", 47), ("used", 2),
                          ("threads", None)):
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--against", default=None, help="another export with decode.onnx, instead of model.onnx")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    model = decode_graph_export(ap, a.model)
    against = decode_graph_export(ap, a.against) if a.against else None
    if not 0 <= a.used <= 5:
        ap.error(f"--used {a.used}: the chunk's decoded slots are 0 to 5")
    r = run(model, a.rounds, a.beams, a.candidates, a.prefix, a.threads, against, a.used)
    other = "against" if against else "rows"
    print(f"{r['machine']}, {r['date']}, {model}: step ms per round {r['step_ms_per_round']}; "
          f"{other} / v2 = {r[other + '_over_v2']:.2f}")
    if a.out:
        Path(a.out).write_text(json.dumps(r, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
