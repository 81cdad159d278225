"""Two runs of the chat set answer by answer: the same requests' judge perplexities paired.

For two results files of `dbs-fast eval --sets chat` (`results.jsonl`), over the first requests
common to both (`--n`), per kind of message: coverage and mean words of each, the geometric mean
of the second's judge perplexity over the first's for the same request, and how many of the
second's answers read as more fluent, less, or are the same text.

    python -m benchmarks.chat_pairs docs/results/chat/no-openings/results.jsonl docs/results/chat/results.jsonl
"""
from __future__ import annotations

import argparse
import json
import math

from dbs_fast.evaluation.chat import KINDS


def paired(base: list[dict], new: list[dict]) -> dict:
    """Per kind: requests, coverage (the run's `found`) and mean words of both, the geometric
    mean of new / base judge perplexity, and the counts of new answers more fluent, less, the same."""
    out = {}
    for kind in KINDS:
        pairs = [(a, b) for a, b in zip(base, new) if a["kind"] == kind]
        if not pairs:
            continue
        assert all(a["message"] == b["message"] for a, b in pairs), "the files answer different requests"
        out[kind] = {"requests": len(pairs),
                     "coverage": [round(sum(p[i]["found"] for p in pairs) / len(pairs), 3) for i in (0, 1)],
                     "words": [round(sum(len(p[i]["answer"].split()) for p in pairs) / len(pairs), 1) for i in (0, 1)],
                     **judged_pairs(pairs)}
    return out


def judged_pairs(pairs: list[tuple[dict, dict]]) -> dict:
    """For pairs of answers to the same message (dicts with `answer` and `judge_ppl`): the geometric
    mean of the second's judge perplexity over the first's, and the counts of second answers more
    fluent, less, and the same text."""
    same = [a["answer"] == b["answer"] for a, b in pairs]
    ratio = [b["judge_ppl"] / a["judge_ppl"] for a, b in pairs]
    return {"paired": round(math.exp(sum(map(math.log, ratio)) / len(ratio)), 3),
            "better": sum(r < 1 and not s for r, s in zip(ratio, same)),
            "worse": sum(r > 1 and not s for r, s in zip(ratio, same)),
            "same": sum(same)}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("base", help="results.jsonl of the first run")
    ap.add_argument("new", help="results.jsonl of the second run")
    ap.add_argument("--n", type=int, default=None, help="the first n requests (default: those common to both)")
    a = ap.parse_args(argv)
    base, new = ([json.loads(line) for line in open(f, encoding="utf-8") if line.strip()] for f in (a.base, a.new))
    n = min(len(base), len(new), a.n or len(base))
    out = paired(base[:n], new[:n])
    print("| kind | requests | coverage: first, second | words: first, second | second / first (paired) | more fluent, less, same |")
    print("|---|---|---|---|---|---|")
    for kind, r in out.items():
        print(f"| {kind} | {r['requests']} | {r['coverage'][0]}, {r['coverage'][1]} | {r['words'][0]}, {r['words'][1]} | "
              f"{r['paired']}x | {r['better']}, {r['worse']}, {r['same']} |")
    return out


if __name__ == "__main__":
    main()
