"""Keywords the word vectors lack: which of the ways around it writes text worth keeping.

A word outside GloVe has no guide vector, so the request is refused with a suggestion. This measures
the suggestions on real words GloVe 6B lacks (selfie, covid, blockchain, ...), each beside a common
word, after "It is", at the default settings: `--subword-fallback` (the word's own tokens' vectors
guide), `--guarantee` (no guidance for it; the word is forced in before the deadline) and both.
Per way: success (both words in the text), refusals (subword fallback still finds no vector), the judge's median perplexity (gemma3-270m, the text
after the context), rep-4, words, and the texts.

    python -m benchmarks.unknown_words --out runs/unknown-words
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace
from pathlib import Path

from benchmarks import write
from dbs_fast.api import DirectedBeamSearch
from dbs_fast.bench.machine import machine
from dbs_fast.errors import DBSError
from dbs_fast.evaluation.judge import Judge
from dbs_fast.evaluation.metrics import rep_n, words

# GloVe 6B (the default embeddings) lacks each first word; the second it has
PAIRS = [("selfie", "beach"), ("covid", "hospital"), ("doomscrolling", "night"), ("cryptocurrency", "bank"),
         ("smartwatch", "run"), ("emoji", "friend"), ("blockchain", "money"), ("unfriend", "party"),
         ("photobomb", "wedding"), ("chatbot", "question"), ("deepfake", "video"), ("microplastic", "ocean"),
         ("upcycle", "chair"), ("ebike", "city")]
WAYS = {"subword-fallback": {"subword_fallback": True}, "guarantee": {"guarantee": True},
        "both": {"subword_fallback": True, "guarantee": True}}


def answer(dbs, pair, seed: int, cfg):
    """The request's result, or None where it is refused (a word no vector covers)."""
    try:
        return dbs.generate("It is", list(pair), seed=seed, config=cfg)
    except DBSError:
        return None


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args(argv)
    judge, report = None, {"machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M %Z"), "ways": {}}
    lines = [f"{len(PAIRS)} pairs (a word GloVe 6B lacks, a common word), context \"It is\", default settings; "
             "judge gemma3-270m.", "", "| way | success | refused | judge ppl (median, of those answered) | rep-4 | words |", "|---|---|---|---|---|---|"]
    for way, opts in WAYS.items():
        dbs = DirectedBeamSearch("default", subword_fallback=opts.get("subword_fallback", False))
        judge = judge or Judge("gemma3-270m", generator_dir=dbs.model_dir)
        cfg = replace(dbs.config, guarantee=opts.get("guarantee", False))
        rs = [answer(dbs, pair, i, cfg) for i, pair in enumerate(PAIRS)]
        done = [r for r in rs if r is not None]
        ppl = judge.perplexity([("It is", r.generated) for r in done])
        row = {"success": sum(r is not None and r.success_rate == 1.0 for r in rs) / len(rs),
               "refused": len(rs) - len(done), "judge_ppl_median": statistics.median(ppl),
               "words": statistics.mean(len(words(r.generated)) for r in done),
               "rep_4": statistics.mean(rep_n(r.generated, 4) for r in done),
               "texts": [r.text if r is not None else None for r in rs]}
        report["ways"][way] = row
        lines.append(f"| {way} | {row['success']:.2f} | {row['refused']} | {row['judge_ppl_median']:.1f} | "
                     f"{row['rep_4']:.3f} | {row['words']:.1f} |")
    lines += ["", "Texts:", ""]
    for i, pair in enumerate(PAIRS):
        lines.append(f"- {', '.join(pair)}")
        lines += [f"  - {way}: {json.dumps(report['ways'][way]['texts'][i])}" for way in WAYS]
    write(a.out, "unknown_words", report, lines)


if __name__ == "__main__":
    main()
