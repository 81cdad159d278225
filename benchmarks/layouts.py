"""A model on its two KV layouts, in one process, taking turns: the shared-context decode graph
(`--kv-layout prefix`: each request's context once, each beam's prefix once) against one cache row
per candidate (`--kv-layout rows`, model.onnx). The same requests and seeds on both: the paper's
keyword sets after "It is", the `generate` defaults. Reported: seconds per generation of each
layout (median over the rounds, each round every request once), their ratio pair by pair, and how
many texts are the same on both.

    python -m benchmarks.layouts --model gemma3-270m --sets 6 --rounds 2 --out runs/layouts-gemma
"""
from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

from dbs_fast.api import DirectedBeamSearch
from dbs_fast.evaluation.runs import builtin_sets

from .turns import in_turns, summary


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gemma3-270m", help="an exported model dir or an embedded name")
    p.add_argument("--sets", type=int, default=6, help="the paper's first N keyword sets (default 6)")
    p.add_argument("--rounds", type=int, default=2, help="timed rounds after a cold one (default 2)")
    p.add_argument("--max-new-tokens", type=int, default=40)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    engines = {lay: DirectedBeamSearch(a.model, kv_layout=lay, threads=a.threads) for lay in ("prefix", "rows")}
    if engines["prefix"].decoder is None:
        raise SystemExit(f"{a.model} has no shared-context decode graph (its manifest's prefix_decode says why)")
    cfg = replace(engines["prefix"].config, max_new_tokens=a.max_new_tokens)
    jobs = builtin_sets("paper")[:a.sets]
    seconds, results = in_turns(("prefix", "rows"), lambda lay: [
        engines[lay].generate("It is", kws, seed=i, config=cfg) for i, kws in enumerate(jobs)], a.rounds, len(jobs))
    texts = {lay: [r.generated for r in res[-1]] for lay, res in results.items()}
    report = summary(("prefix", "rows"), seconds, texts, model=a.model, sets=a.sets, rounds=a.rounds,
                     max_new_tokens=a.max_new_tokens)
    pairs = report["pairs"]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "layouts.json").write_text(json.dumps(report, indent=2))
    s = report["seconds_per_generation"]
    print(f"{a.model}: prefix {s['prefix']:.2f} s/generation, rows {s['rows']:.2f}; rows / prefix "
          f"{report['rows_over_prefix']:.2f}x (pairs {', '.join(f'{x:.2f}' for x in pairs)}); same texts "
          f"{report['same_texts']} of {a.sets}")


if __name__ == "__main__":
    main()
