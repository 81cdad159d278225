"""Two checkouts of dbs-fast generating in turns: a change's cost per generation, under the same load.

Each checkout runs in its own process, kept loaded (the engine of that checkout on the export in
its own DBS_FAST_HOME, re-exported there if its format differs); the two generate the same
request in turns, the order swapped every round, so the machine's load falls on both alike. The
paper's search (b=7, s=10, k=5), 40 new tokens, context "It is", keywords river, doctor, winter
(`--context`, `--keywords`, `--beams`, `--candidates`, `--tokens` to change); `--preset default`
or `--preset commongen` runs that preset instead (`config.preset`: its context, its budget, its
prompt and rules; the flags given apply on top). Reports each one's median seconds per generation (and of it,
decode), the median of the paired ratios B / A, and how many texts were the same; and per decode
step, where its time went: the graph (inside ONNX Runtime's run, timed around the session's own
call, so that any checkout is measured alike), the kernel (the search's "sample" stage: guidance
and the Numba draw) and the host's work (the rest of the generation, prefill included).

    python -m benchmarks.checkouts --a /path/to/old/checkout --a-home /tmp/home-a \\
        --b . --b-home /tmp/home-b [--rounds 8] [--out FILE.json]

A checkout of an older commit: `git worktree add /tmp/old COMMIT`.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from dbs_fast.bench.machine import machine

WORKER = """
import dataclasses, json, sys, time
from dbs_fast.api import DirectedBeamSearch
from dbs_fast.config import preset
name = sys.argv[3]
cfg, preset_context = preset("commongen") if name == "commongen" else preset(None, paper=name == "paper")
given = zip(("beams", "candidates", "max_new_tokens"), sys.argv[4:7])
cfg = dataclasses.replace(cfg, **{k: int(v) for k, v in given if v != "-"})
dbs = DirectedBeamSearch("default", config=cfg)
clock = {"graph": 0.0, "steps": 0}
if dbs.decoder is not None:         # ORT's run and the decode steps, timed and counted from outside
    dec, run, step = dbs.decoder, dbs.decoder.session.run_with_iobinding, dbs.decoder.step

    def timed_run(*a, **k):
        t0 = time.perf_counter()
        run(*a, **k)
        clock["graph"] += time.perf_counter() - t0

    def counted_step(*a, **k):
        clock["steps"] += 1
        return step(*a, **k)

    dec.session.run_with_iobinding, dec.step = timed_run, counted_step
context, keywords = sys.argv[1] or preset_context, sys.argv[2].split(",")
dbs.generate(context, keywords, seed=0)
print("ready", flush=True)
for line in sys.stdin:
    clock.update(graph=0.0, steps=0)
    r = dbs.generate(context, keywords, seed=int(line))
    print(json.dumps([r.seconds, r.seconds - r.timings.get("prefill", 0.0), r.generated, clock["graph"],
                      r.timings.get("sample", 0.0), clock["steps"]]), flush=True)
"""


def worker(checkout: Path, home: Path, context: str, keywords: str, preset: str = "paper",
           shape: tuple = (7, 10, 40)) -> subprocess.Popen:
    """A loaded worker of `checkout`: the `preset` ("paper", "default" or "commongen"; "" context: the
    preset's own) with `shape` (beams, candidates, new tokens; None: the preset's) on top."""
    env = dict(os.environ, PYTHONPATH=str(checkout.resolve()), DBS_FAST_HOME=str(home))
    given = ["-" if x is None else str(x) for x in shape]
    p = subprocess.Popen([sys.executable, "-c", WORKER, context, keywords, preset, *given], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True, env=env, cwd=str(checkout))
    if p.stdout.readline().strip() != "ready":
        raise SystemExit(f"the worker of {checkout} did not start")
    return p


def step_split(runs: list) -> dict:
    """Median ms per decode step of the graph, the kernel and the host's work (the rest)."""
    per = [(g, kernel, total - g - kernel, steps) for total, _, _, g, kernel, steps in runs if steps]
    return {s: statistics.median(1e3 * x[i] / x[3] for x in per) for i, s in enumerate(("graph", "kernel", "host"))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--a", type=Path, required=True, help="checkout A (the baseline)")
    ap.add_argument("--a-home", type=Path, required=True, help="DBS_FAST_HOME of A")
    ap.add_argument("--b", type=Path, required=True, help="checkout B (the change)")
    ap.add_argument("--b-home", type=Path, required=True, help="DBS_FAST_HOME of B")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--preset", default="paper", choices=["paper", "default", "commongen"],
                    help="the search: the paper's protocol, the default or the CommonGen task's")
    ap.add_argument("--context", default=None, help="default: the preset's (the paper's: \"It is\")")
    ap.add_argument("--keywords", default="river,doctor,winter")
    ap.add_argument("--beams", type=int, default=None, help="default: the preset's (7)")
    ap.add_argument("--candidates", type=int, default=None, help="default: the preset's (10)")
    ap.add_argument("--tokens", type=int, default=None,
                    help="new tokens per generation (default: 40 for the paper's, else the preset's budget)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.tokens is None and args.preset == "paper":
        args.tokens = 40
    shape = (args.beams, args.candidates, args.tokens)
    procs = {"A": worker(args.a, args.a_home, args.context or "", args.keywords, args.preset, shape),
             "B": worker(args.b, args.b_home, args.context or "", args.keywords, args.preset, shape)}
    runs = {"A": [], "B": []}
    for i in range(args.rounds):
        for k in ("A", "B") if i % 2 == 0 else ("B", "A"):
            procs[k].stdin.write(f"{i}\n")
            procs[k].stdin.flush()
            runs[k].append(json.loads(procs[k].stdout.readline()))
    for p in procs.values():
        p.stdin.close()
        p.wait()
    report = {"machine": machine(), "a": str(args.a), "b": str(args.b), "rounds": args.rounds,
              "preset": args.preset, "context": args.context, "keywords": args.keywords, "beams": args.beams,
              "candidates": args.candidates, "tokens": args.tokens,
              **{k: {"seconds_median": statistics.median(r[0] for r in v),
                     "decode_seconds_median": statistics.median(r[1] for r in v), "seconds_all": [r[0] for r in v],
                     "ms_per_step": step_split(v)}
                 for k, v in runs.items()},
              "paired_ratio_median": statistics.median(b[0] / a[0] for a, b in zip(runs["A"], runs["B"])),
              "same_texts": sum(a[2] == b[2] for a, b in zip(runs["A"], runs["B"]))}
    print(f"{report['machine']}: A {report['A']['seconds_median']:.2f} s/generation (decode "
          f"{report['A']['decode_seconds_median']:.2f}), B {report['B']['seconds_median']:.2f} (decode "
          f"{report['B']['decode_seconds_median']:.2f}); B / A paired, median of {args.rounds}: "
          f"{report['paired_ratio_median']:.3f}; same texts {report['same_texts']} of {args.rounds}")
    for k in ("A", "B"):
        print(f"  {k} per decode step (ms, median): " + ", ".join(f"{s} {v:.2f}" for s, v in report[k]["ms_per_step"].items()))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
