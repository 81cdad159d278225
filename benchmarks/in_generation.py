"""Does a decode call cost more inside a generation than on its own? Each call of the decode graph
in one generation (the engine's IO binding, between the kernel, the text and the scheduler's
Python) is timed, then run again at once on the same binding, back to back, and timed again.

The repeat computes the same thing: the same inputs, and the outputs (the logits and the new
K/V, written in place into the chunk slot the call just wrote) get the same values, so the
generation goes on unchanged. The difference between the two columns is what the rest of the
engine costs the graph (caches it evicts, threads it leaves spinning); the graph's own speed at
the generation's shapes is the repeat's.

    python -m benchmarks.in_generation --model DIR [--max-new-tokens 90] [--out FILE.json]

One cold generation first (not timed), then one timed at the paper's setting.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from dbs_fast.bench.machine import decode_graph_export, machine
from dbs_fast.bench.suite import CONTEXT, KEYWORD_SETS
from dbs_fast.config import DBSConfig


def run(model_dir: Path, max_new_tokens: int = 90, threads: int | None = None) -> dict:
    from dbs_fast import DirectedBeamSearch

    dbs = DirectedBeamSearch(str(model_dir), config=DBSConfig.paper(max_new_tokens=max_new_tokens),
                             threads=threads, context_cache_mb=0)     # every call, the prefill's too
    sess = dbs.decoder.session
    dbs.generate(CONTEXT, KEYWORD_SETS[0], seed=0)                 # cold: sessions, kernel, caches
    inside, again = [], []
    run_bound = sess.run_with_iobinding

    def timed(io, *args, **kw):
        t0 = time.perf_counter()
        run_bound(io, *args, **kw)
        t1 = time.perf_counter()
        run_bound(io, *args, **kw)
        inside.append(t1 - t0)
        again.append(time.perf_counter() - t1)

    sess.run_with_iobinding = timed
    try:
        r = dbs.generate(CONTEXT, KEYWORD_SETS[1], seed=1)
    finally:
        del sess.run_with_iobinding                                # the session's own method again
    ms = lambda xs: {"median": 1e3 * statistics.median(xs), "mean": 1e3 * statistics.mean(xs)}
    return {"machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M %Z"), "model": str(model_dir),
            "max_new_tokens": max_new_tokens, "calls": len(inside), "in_generation_ms": ms(inside),
            "back_to_back_ms": ms(again), "in_over_back_to_back": sum(inside) / sum(again),
            "generation_seconds_with_repeats": r.seconds, "text": r.generated}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="an export with decode.onnx")
    ap.add_argument("--max-new-tokens", type=int, default=90)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if a.max_new_tokens < 1:
        ap.error("--max-new-tokens must be >= 1")
    model = decode_graph_export(ap, a.model)
    r = run(model, a.max_new_tokens, a.threads)
    print(f"{r['calls']} decode calls: in the generation {r['in_generation_ms']['median']:.1f} ms (median), "
          f"{r['in_generation_ms']['mean']:.1f} (mean); again at once {r['back_to_back_ms']['median']:.1f} / "
          f"{r['back_to_back_ms']['mean']:.1f} ms; ratio of sums {r['in_over_back_to_back']:.3f}")
    if a.out:
        Path(a.out).write_text(json.dumps(r, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
