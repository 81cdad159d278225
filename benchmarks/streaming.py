"""Streams with a fixed lag (`stream_lag`): when the first text arrives, and what the lag costs.

Requests of the chat set (`dbs-fast eval --sets chat`; `--start`, `--n`), each user message
rendered by the default model's chat template with its guide words as keywords, at the chat
door's settings (`DBSConfig.chat()`), streamed as the service streams them: after every chunk
the certain text (`Batch.certain`), whose first non-empty value is the first content a client
sees. Per lag in chunks (0 = off; a fraction holds back part of a chunk): the median and p90 of
that time over the answer's total time, the coverage of the guide words (by lemma), the judge's
median perplexity of the answer after the message in the judge's chat template (the other
embedded model, gemma3-270m), rep-4, the mean words, and how many answers are the same as at
lag 0; three answers picked by numpy default_rng(0).

    python -m benchmarks.streaming --n 40 --lags 0,0.2,0.4,0.6,0.8,1 --out runs/streaming
    python -m benchmarks.streaming --n 100 --lags 0.8 --options '{"inflect": false}' --out runs/streaming-off
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from benchmarks import write
from dbs_fast.api import DirectedBeamSearch
from dbs_fast.bench.machine import machine
from dbs_fast.config import DBSConfig
from dbs_fast.evaluation.chat import chat_requests, judge_contexts
from dbs_fast.evaluation.judge import Judge
from dbs_fast.evaluation.metrics import coverage, rep_n, words


def stream(dbs, cfg, context: str, keywords, seed: int) -> dict:
    """One request alone in a batch, its certain text read after every chunk: the answer, the
    seconds to its first text and in all."""
    batch = dbs.batch(cfg)
    t0 = time.perf_counter()
    batch.admit([dbs.request(context, keywords, None, seed, cfg)])
    first = None
    while True:
        done = batch.decode_chunk()
        if done:
            total = time.perf_counter() - t0
            result = done[0][1]
            return {"text": result.generated, "first": total if first is None else first, "total": total}
        if first is None and batch.certain()[0][1]:
            first = time.perf_counter() - t0


def label(lag: float) -> str:
    return f"{lag:g}" if lag else "off"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=40)
    p.add_argument("--start", type=int, default=0)
    p.add_argument("--lags", default="0,0.4,0.6,0.8,1")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--options", type=json.loads, default={},
                   help='settings on top of the chat door\'s, as JSON by config field (\'{"inflect": false}\')')
    a = p.parse_args(argv)
    dbs, base = DirectedBeamSearch("default"), DBSConfig.chat(**a.options)    # the chat door's settings
    reqs = chat_requests()[a.start:a.start + a.n]
    sets, messages = [kws for _, kws, _ in reqs], [m for _, _, m in reqs]
    contexts = [dbs.chat_template.render([{"role": "user", "content": m}]) for m in messages]
    lags = [float(x) for x in a.lags.split(",")]
    runs = {}
    for lag in lags:
        cfg = replace(base, stream_lag=lag)
        runs[lag] = [stream(dbs, cfg, c, s, seed) for seed, (c, s) in enumerate(zip(contexts, sets))]
        print(f"lag {lag}: done", flush=True)
    judge = Judge("gemma3-270m", generator_dir=dbs.model_dir)
    judged = judge_contexts(judge, messages)
    report = {"machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M %Z"), "sets": [a.start, a.start + a.n],
              "config": base.to_dict(), "lags": {}}
    lines = [f"{a.n} requests of the chat set ({a.start}-{a.start + a.n - 1}: half name their words), the chat "
             "door's settings, streamed; judge gemma3-270m (median perplexity of the answer after the message, in the "
             "judge's chat template).", "",
             "| stream_lag | first text / total (median, p90) | seconds (median total) | coverage | judge ppl "
             "(median) | rep-4 | words | same answer as off |", "|---|---|---|---|---|---|---|---|"]
    for lag, rs in runs.items():
        share = [r["first"] / r["total"] for r in rs]
        ppl = judge.perplexity([(m, r["text"]) for m, r in zip(judged, rs)])
        row = {"first_share_median": statistics.median(share), "first_share_p90": float(np.percentile(share, 90)),
               "seconds_median": statistics.median(r["total"] for r in rs),
               "coverage": float(np.mean([coverage(r["text"], s) for r, s in zip(rs, sets)])),
               "judge_ppl_median": statistics.median(ppl), "rep_4": float(np.mean([rep_n(r["text"], 4) for r in rs])),
               "words": float(np.mean([len(words(r["text"])) for r in rs])),
               "same_as_off": sum(r["text"] == o["text"] for r, o in zip(rs, runs[0.0])) if 0.0 in runs else None,
               "texts": rs}
        report["lags"][f"{lag:g}"] = row
        same = "" if row["same_as_off"] is None else f"{row['same_as_off']} of {a.n}"    # off among the lags
        lines.append(f"| {label(lag)} | {row['first_share_median']:.2f}, {row['first_share_p90']:.2f} | "
                     f"{row['seconds_median']:.1f} | {row['coverage']:.3f} | {row['judge_ppl_median']:.1f} | "
                     f"{row['rep_4']:.3f} | {row['words']:.1f} | {same} |")
    lines += ["", "Answers (sets picked by numpy default_rng(0), unedited):", ""]
    for i in sorted(np.random.default_rng(0).choice(a.n, size=min(3, a.n), replace=False).tolist()):
        lines.append(f"- {messages[i]}")
        lines += [f"  - stream_lag {label(lag)}: {json.dumps(runs[lag][i]['text'])}" for lag in lags]
    write(a.out, "streaming", report, lines)


if __name__ == "__main__":
    main()
