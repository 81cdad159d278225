"""What the guide words cost the judge, by where the answer places them.

For each results file of `dbs-fast eval --sets chat` (`results.jsonl`), over the answers of one
kind (`--kind`, default leaves_out: the messages that do not ask for the words) of the first
`--n` requests common to all files: each guide word's first occurrence (by lemma), the judge's
negative log-prob of the token where it starts (the answer after its message, in the judge's chat
template, as the evaluation reads it), and the median of those, for the words that start within
the answer's first `--first` judge tokens and for the later ones.

    python -m benchmarks.word_cost docs/results/chat/results.jsonl runs/other/results.jsonl --n 32
"""
from __future__ import annotations

import argparse
import json

import numpy as np

from dbs_fast.evaluation.chat import judge_contexts
from dbs_fast.evaluation.judge import Judge, judge_for
from dbs_fast.text import occurrence
from dbs_fast.text.constraints import parse_keyword


def word_costs(judge, rows: list[dict]) -> list[tuple[int, float]]:
    """(judge token index, nll) of each guide word's first occurrence in each row's answer."""
    contexts = judge_contexts(judge, [r["message"] for r in rows])
    out = []
    for r, lp in zip(rows, judge.token_logprobs([(c, r["answer"]) for c, r in zip(contexts, rows)])):
        offsets = judge.offsets(r["answer"])
        offsets = offsets[len(offsets) - len(lp):]                 # the scored tokens'
        for k in r["keywords"]:
            spans = occurrence.spans(r["answer"], parse_keyword(k), "lemma")
            i = next((i for i, (a, b) in enumerate(offsets) if spans and a <= spans[0][0] < b), None)
            if i is not None:
                out.append((i, float(-lp[i])))
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="+", help="results.jsonl files of eval --sets chat")
    ap.add_argument("--n", type=int, default=None, help="the first n requests (default: those common to all)")
    ap.add_argument("--kind", default="leaves_out", choices=["leaves_out", "names"])
    ap.add_argument("--first", type=int, default=20, help="judge tokens that count as the answer's opening")
    ap.add_argument("--judge", default=judge_for("default"))
    a = ap.parse_args(argv)
    files = [[json.loads(line) for line in open(f, encoding="utf-8") if line.strip()] for f in a.results]
    n = min([len(f) for f in files] + ([a.n] if a.n else []))
    judge = Judge(a.judge)
    print(f"judge {a.judge}; the first {n} requests, kind {a.kind}; a word's cost: the judge's nll of its first token")
    print("| results | words | median cost | in the first {0} tokens: words, median | later: words, median |".format(a.first))
    print("|---|---|---|---|---|")
    for name, rows in zip(a.results, files):
        w = np.array(word_costs(judge, [r for r in rows[:n] if r["kind"] == a.kind])).reshape(-1, 2)
        early = w[:, 0] < a.first

        def med(x):
            return f"{np.median(x):.2f}" if len(x) else "-"

        print(f"| {name} | {len(w)} | {med(w[:, 1])} | {early.sum()}, {med(w[early, 1])} | "
              f"{(~early).sum()}, {med(w[~early, 1])} |")


if __name__ == "__main__":
    main()
