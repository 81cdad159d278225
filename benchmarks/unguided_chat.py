"""The chat door without guide words: what `/v1/chat/completions` answers a request that gives no
keywords, judged.

Each message of the chat set (`dbs_fast/data/chat_requests.tsv`) is answered at the chat door's
preset (`DBSConfig.chat()`) with no keywords, seed i for message i, and the judge reads each answer
after its message in the judge's chat template, as `dbs-fast eval --sets chat` does. Writes
`results.jsonl` (message, answer, how it stopped, judge perplexity) and prints the median judge
perplexity, the mean words and the stops; with `--base`, another run's `results.jsonl`, the
answers paired request by request (the geometric mean of this run's perplexity over the base's,
and how many read more fluent, less, or are the same text).

    python -m benchmarks.unguided_chat --out runs/unguided --limit 100 [--base OTHER/results.jsonl]
"""
from __future__ import annotations

import argparse
import collections
import json
import statistics
from pathlib import Path


def paired(base: list[dict], new: list[dict]) -> dict:
    from benchmarks.chat_pairs import judged_pairs

    pairs = list(zip(base, new))
    assert all(a["message"] == b["message"] for a, b in pairs), "the files answer different messages"
    return {"requests": len(pairs), **judged_pairs(pairs)}


def main(argv=None) -> dict:
    from dbs_fast import DBSConfig, DirectedBeamSearch
    from dbs_fast.evaluation.chat import chat_requests, judge_contexts
    from dbs_fast.evaluation.judge import Judge

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--limit", type=int, default=100)
    ap.add_argument("--model", default="default")
    ap.add_argument("--base", type=Path, help="another run's results.jsonl, to pair with")
    args = ap.parse_args(argv)
    dbs = DirectedBeamSearch(args.model)
    cfg = DBSConfig.chat()
    rows = []
    for i, (_, _, message) in enumerate(chat_requests()[:args.limit]):
        r = dbs.generate(dbs.chat_template.render([{"role": "user", "content": message}]), None, seed=i, config=cfg)
        rows.append({"message": message, "answer": r.generated.strip(), "stopped": r.stopped})
    judge = Judge("gemma3-270m", generator_dir=dbs.model_dir)
    ctx = judge_contexts(judge, [r["message"] for r in rows])
    for r, p in zip(rows, judge.perplexity([(c, r["answer"]) for c, r in zip(ctx, rows)])):
        r["judge_ppl"] = p
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = {"requests": len(rows), "judge_ppl_median": round(statistics.median(r["judge_ppl"] for r in rows), 2),
               "words": round(sum(len(r["answer"].split()) for r in rows) / len(rows), 1),
               "stopped": dict(collections.Counter(r["stopped"] for r in rows))}
    if args.base:
        summary["paired"] = paired([json.loads(line) for line in args.base.read_text().splitlines()], rows)
    print(json.dumps(summary, indent=1))
    return summary


if __name__ == "__main__":
    main()
