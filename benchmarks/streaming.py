"""Streams with a fixed lag (`stream_lag`): when the first text arrives, and what the lag costs.

Requests of the chat set (`dbs-fast eval --sets chat`; `--start`, `--n`, then `--kinds`), each user
message rendered by the default model's chat template with its guide words as keywords, at the
chat door's settings (`DBSConfig.chat()`) and the chat evaluation's seeds, streamed as the service
streams them: after every chunk the certain text (`Batch.certain`), whose first non-empty value is
the first content a client sees. Per lag in chunks (0 = off: the chat evaluation's answers; a
fraction holds back part of a chunk) and per kind of message: the median and p90 of that time
over the answer's total time, and what the chat evaluation reports of the answers (coverage of
the guide words by lemma; the judge's median perplexity, gemma3-270m reading the answer after the
message in its chat template, against the reference: the model's own answer with no guide words,
cut to as many sentences as the streamed answer has; the words of both, rep-4, word loops); how
many answers are the same as at lag 0; three answers picked by numpy default_rng(0).

    python -m benchmarks.streaming --n 100 --lags 0.8 --out runs/streaming
    python -m benchmarks.streaming --n 40 --lags 0,0.4,0.8,1 --out runs/streaming-sweep
    python -m benchmarks.streaming --kinds leaves_out --lags 2,4 --out runs/streaming-long
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
from dbs_fast.evaluation.chat import (
    KINDS,
    aggregate,
    chat_requests,
    cut_like,
    judge_rows,
    own_answer,
)
from dbs_fast.evaluation.judge import Judge


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
    p.add_argument("--n", type=int, default=100)
    p.add_argument("--start", type=int, default=0)
    p.add_argument("--kinds", default=",".join(KINDS), help="the kinds of message kept: names, leaves_out")
    p.add_argument("--lags", default="0.8")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--threads", type=int, default=None, help="the engine's threads (default: the machine's)")
    p.add_argument("--options", type=json.loads, default={},
                   help='settings on top of the chat door\'s, as JSON by config field (\'{"inflect": false}\')')
    a = p.parse_args(argv)
    kinds = a.kinds.split(",")
    dbs, base = DirectedBeamSearch("default", threads=a.threads), DBSConfig.chat(**a.options)    # the chat door's settings
    reqs = [(seed, kind, kws, m) for seed, (kind, kws, m) in enumerate(chat_requests())    # the eval's seeds
            if a.start <= seed < a.start + a.n and kind in kinds]
    contexts = [dbs.chat_template.render([{"role": "user", "content": m}]) for *_, m in reqs]
    own = [own_answer(dbs, c, seed, base) for c, (seed, *_) in zip(contexts, reqs)]
    lags = [float(x) for x in a.lags.split(",")]
    runs = {}
    for lag in lags:
        cfg = replace(base, stream_lag=lag)
        runs[lag] = [stream(dbs, cfg, c, kws, seed) for c, (seed, _, kws, _) in zip(contexts, reqs)]
        print(f"lag {lag}: done", flush=True)
    judge = Judge("gemma3-270m", generator_dir=dbs.model_dir)
    report = {"machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M %Z"), "sets": [a.start, a.start + a.n],
              "kinds": kinds, "config": base.to_dict(), "lags": {}}
    lines = [f"{len(reqs)} requests of the chat set ({a.start}-{a.start + a.n - 1}; {', '.join(kinds)}), the chat "
             "door's settings, streamed; judge gemma3-270m (median perplexity of the answer after the message, in the "
             "judge's chat template) against the model's own answer cut to as many sentences.", "",
             "| stream_lag | messages | first text / total (median, p90) | seconds (median total) | coverage | "
             "judge ppl (median): answer / reference = ratio | words: answer / reference | rep-4 | same answer as off |",
             "|---|---|---|---|---|---|---|---|---|"]
    for lag, rs in runs.items():
        rows = [{"kind": kind, "keywords": kws, "message": m, "answer": r["text"].strip(),
                 "reference": cut_like(o, r["text"]), "seconds": r["total"], "first": r["first"]}
                for (_, kind, kws, m), r, o in zip(reqs, rs, own)]
        judge_rows(judge, rows)
        same = [r["text"] == o["text"] for r, o in zip(rs, runs[0.0])] if 0.0 in runs else None
        row = {}
        for kind in (*kinds, "all") if len(kinds) > 1 else kinds:
            sub = [i for i, r in enumerate(rows) if kind in ("all", r["kind"])]
            share = [rows[i]["first"] / rows[i]["seconds"] for i in sub]
            agg = row[kind] = {**aggregate([rows[i] for i in sub]), "first_share_median": statistics.median(share),
                               "first_share_p90": float(np.percentile(share, 90)),
                               "same_as_off": None if same is None else sum(same[i] for i in sub)}
            same_txt = "" if same is None else f"{agg['same_as_off']} of {agg['requests']}"
            lines.append(f"| {label(lag)} | {kind.replace('_', ' ')} ({agg['requests']}) | "
                         f"{agg['first_share_median']:.2f}, {agg['first_share_p90']:.2f} | "
                         f"{agg['seconds_median']:.1f} | {agg['coverage']:.3f} | {agg['judge_ppl_median']:.1f} / "
                         f"{agg['reference_judge_ppl_median']:.1f} = {agg['judge_ratio']:.2f}x | "
                         f"{agg['words']:.1f} / {agg['reference_words']:.1f} | {agg['rep_4']:.3f} | "
                         f"{same_txt} |")
        report["lags"][f"{lag:g}"] = {**row, "texts": rows}
    lines += ["", "Answers (requests picked by numpy default_rng(0), unedited):", ""]
    for i in sorted(np.random.default_rng(0).choice(len(reqs), size=min(3, len(reqs)), replace=False).tolist()):
        lines.append(f"- {reqs[i][3]}")
        lines += [f"  - stream_lag {label(lag)}: {json.dumps(runs[lag][i]['text'])}" for lag in lags]
    write(a.out, "streaming", report, lines)


if __name__ == "__main__":
    main()
