"""ONNX Runtime's thread spinning, A/B on whole generations (the choice in `session.session_options`).

Arms, each its own DirectedBeamSearch in this process, generations alternated between them:
  off        workers sleep between parallel sections (`allow_spinning=0`, the setting before)
  run-only   workers spin inside a run and stop when it ends (`force_spinning_stop=1`, the default)

    python -m dbs_fast.benchmarks.spinning --model DIR [--generations 2] [--out FILE]

Paper setting, context "It is", the bench's keyword sets; prints seconds per generation and the
model / kernel milliseconds per step of each arm.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

ARMS = {"off": {"session.intra_op.allow_spinning": "0"},
        "run-only": {"session.intra_op.allow_spinning": "1", "session.force_spinning_stop": "1"}}


def engine(model: str, entries: dict):
    import dbs_fast.session as S
    from dbs_fast import DBSConfig, DirectedBeamSearch

    base = S.session_options

    def options(threads):
        so = base(threads)
        for k, v in entries.items():
            so.add_session_config_entry(k, v)      # the last value set for a key wins
        return so

    S.session_options = options
    try:
        return DirectedBeamSearch(model, config=DBSConfig.paper(max_new_tokens=90))
    finally:
        S.session_options = base


def main(argv=None) -> int:
    from dbs_fast.benchmarks.bench import CONTEXT, KEYWORD_SETS
    from dbs_fast.benchmarks.host import machine

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--generations", type=int, default=2)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    engines = {arm: engine(a.model, e) for arm, e in ARMS.items()}
    for d in engines.values():
        d.generate(CONTEXT, KEYWORD_SETS[0], seed=0)              # warm-up
    runs = {arm: [] for arm in ARMS}
    for i in range(a.generations):
        for arm, d in engines.items():
            r = d.generate(CONTEXT, KEYWORD_SETS[i % len(KEYWORD_SETS)], seed=i)
            runs[arm].append({"seconds": r.seconds, **{f"{k}_ms_per_step": 1e3 * v / 90 for k, v in r.timings.items()}})
    out = {"machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M %Z"), "model": a.model, "arms": ARMS,
           "runs": runs}
    for arm, rs in runs.items():
        print(f"{arm:9s} {statistics.median(r['seconds'] for r in rs):6.2f} s/generation "
              f"({', '.join('%.2f' % r['seconds'] for r in rs)}); model "
              f"{statistics.median(r['model_ms_per_step'] for r in rs):.0f} ms/step, kernel "
              f"{statistics.median(r['kernel_ms_per_step'] for r in rs):.1f} ms/step")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
