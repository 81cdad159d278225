"""A second model as the scorer against the generator scoring itself, in one process, taking turns.

DBS keeps the best candidates by a quality score Q whose perplexity comes from a scorer: the
generator's own unguided log-probs (`--scorer self`, free: the kernel returns them) or a second
exported LM that shares the tokenizer (`--scorer DIR`: the paper's Distil-GPT-2 beside GPT-2
large), which reads every candidate's chunk once more. The same requests and seeds on both:
CommonGen dev's first N concept sets with the task preset and `--guarantee`. Reported: seconds per
generation of each (median over the rounds, each round every request once), their ratio pair by
pair, the scorer's share of the time, and how many texts are the same. What a scorer buys in
quality is `dbs-fast eval --scorer DIR`'s to say (judge, BLEU-4, CIDEr-D against all references).

    dbs-fast export --model default --quantize int8-block --out runs/default-int8b
    python -m benchmarks.scorer --scorer runs/default-int8b --sets 8 --rounds 2 --out runs/scorer
"""
from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import replace
from pathlib import Path

from dbs_fast.api import DirectedBeamSearch
from dbs_fast.config import preset
from dbs_fast.evaluation.runs import builtin_sets

from .turns import in_turns, summary


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default", help="the generator: an exported model dir or an embedded name")
    p.add_argument("--scorer", required=True, help="the second model: an exported dir sharing the tokenizer")
    p.add_argument("--sets", type=int, default=8, help="CommonGen dev's first N concept sets (default 8)")
    p.add_argument("--rounds", type=int, default=2, help="timed rounds after a cold one (default 2)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    engines = {name: DirectedBeamSearch(a.model, scorer=name if name == "self" else a.scorer, threads=a.threads)
               for name in ("self", "scorer")}
    task, context = preset("commongen")
    cfg = replace(task, guarantee=True)
    jobs = builtin_sets("commongen-dev")[:a.sets]
    seconds, results = in_turns(("self", "scorer"), lambda name: [
        engines[name].generate(context, kws, seed=i, config=cfg) for i, kws in enumerate(jobs)], a.rounds, len(jobs))
    share = {name: [r.timings.get("scorer", 0.0) / r.seconds for res in runs[1:] for r in res]
             for name, runs in results.items()}
    texts = {name: [r.generated for r in runs[-1]] for name, runs in results.items()}
    report = summary(("self", "scorer"), seconds, texts, model=a.model, scorer=a.scorer, sets=a.sets,
                     rounds=a.rounds, scorer_share_of_time={k: statistics.median(v) for k, v in share.items()})
    pairs = report["pairs"]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "scorer.json").write_text(json.dumps(report, indent=2))
    s, f = report["seconds_per_generation"], report["scorer_share_of_time"]
    print(f"self {s['self']:.2f} s/generation, scorer {a.scorer} {s['scorer']:.2f}; scorer / self "
          f"{report['scorer_over_self']:.2f}x (pairs {', '.join(f'{x:.2f}' for x in pairs)}); the scorer's stage "
          f"{f['scorer']:.0%} of a generation (self: {f['self']:.0%}); same texts {report['same_texts']} of {a.sets}")


if __name__ == "__main__":
    main()
