"""Word loops after a long context: N generations, each after its own window of about T tokens of
English text (the packaged CommonGen dev references, one sentence after another) with one of the
paper's keyword sets, with
the word-loop rule (the default) and without it (`no_repeat_word_window=0`), the same seeds.
Reported per arm: texts with a word loop (a word three times within five words), texts that
stopped at a sentence end that is none (after an abbreviation or an initial:
`dbs_fast.evaluation.metrics.false_end`) and those that stopped after a number (a year, or a
decimal point: read them), success, new tokens, the judge's perplexity (a model
other than the generator) and rep-4, and the texts.

    python -m benchmarks.loops --tokens 2000 --n 25 --out runs/loops-long

`--pool NAME=DIR,DIR,... NAME=...` instead pools the texts of `dbs-fast eval` runs (several seeds
of one arm) into one row per arm: success, the judge's perplexity, rep-4, texts with a word loop,
new tokens, false sentence ends. For the paper's 50 sets at 4 seeds, with the rule and without:

    for s in 0 100 200 300; do
      dbs-fast eval --sets paper --runs dbs --prompt-style none --seed $s --out runs/loops-paper-on-s$s
      dbs-fast eval --sets paper --runs dbs --prompt-style none --seed $s --no-repeat-word-window 0 \
        --out runs/loops-paper-off-s$s
    done
    python -m benchmarks.loops --pool "rule=runs/loops-paper-on-s0,...;without=runs/loops-paper-off-s0,..." \
        --out runs/loops-paper
"""
from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

import numpy as np

from dbs_fast.api import DirectedBeamSearch
from dbs_fast.evaluation.metrics import false_end, number_end, rep_n, word_loop
from dbs_fast.evaluation.runs import builtin_refs, builtin_sets


def contexts(tokenizer, n: int, tokens: int, stride: int) -> list[str]:
    """`n` windows of `tokens` tokens of the packaged English text, `stride` tokens apart."""
    text = " ".join(ref for refs in builtin_refs("commongen-dev") for ref in refs)
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    if len(ids) < tokens + (n - 1) * stride:
        raise SystemExit(f"the packaged text has {len(ids)} tokens: too few for {n} windows of {tokens}")
    return [tokenizer.decode(ids[i * stride: i * stride + tokens]) for i in range(n)]


def false_ends(rows, rule=false_end) -> int:
    """Texts (dicts of `generated`, `stopped`) that stopped at a sentence end that is none (or that
    `rule` finds)."""
    return int(sum(rule(r["generated"]) for r in rows if r["stopped"] in ("sentence", "trimmed")))


def pool(spec: str, out: Path) -> None:
    """One row per arm of the pooled eval runs (`--pool`)."""
    lines = ["| arm | texts | success | judge ppl (mean / median) | rep-4 | texts with a word loop | "
             "false sentence ends (after a number) | new tokens | sets whose text changed |", "|---|---|---|---|---|---|---|---|---|"]
    report, first = {}, None
    for part in spec.split(";"):
        name, dirs = part.split("=", 1)
        rows = [r for d in dirs.split(",") for r in sorted((json.loads(line) for line in (
            Path(d) / "results.jsonl").read_text().splitlines()), key=lambda r: r["set"])]
        ppl = [r["judge_ppl"] for r in rows if r.get("judge_ppl") is not None]
        a = {"texts": len(rows), "success_rate": float(np.mean([r["success_rate"] for r in rows])),
             "judge_ppl_mean": float(np.mean(ppl)), "judge_ppl_median": float(np.median(ppl)),
             "rep_4": float(np.mean([rep_n(r["generated"], 4) for r in rows])),
             "word_loops": int(sum(word_loop(r["generated"]) for r in rows)),
             "false_ends": false_ends(rows), "number_ends": false_ends(rows, number_end), "new_tokens": float(np.mean([r["new_tokens"] for r in rows])),
             "generated": [r["generated"] for r in rows]}
        changed = "" if first is None else f"{sum(x != y for x, y in zip(first, a['generated']))} of {len(rows)}"
        first = a["generated"] if first is None else first
        report[name] = a
        lines.append(f"| {name} | {a['texts']} | {a['success_rate']:.3f} | {a['judge_ppl_mean']:.1f} / "
                     f"{a['judge_ppl_median']:.1f} | {a['rep_4']:.3f} | {a['word_loops']} | {a['false_ends']} ({a['number_ends']}) | "
                     f"{a['new_tokens']:.1f} | "
                     f"{changed} |")
    out.mkdir(parents=True, exist_ok=True)
    (out / "pooled.json").write_text(json.dumps(report, indent=2))
    (out / "pooled.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pool", default=None, help='"NAME=DIR,DIR;NAME=DIR,...": pool eval runs per arm instead')
    p.add_argument("--tokens", type=int, default=2000, help="context tokens (default 2000)")
    p.add_argument("--n", type=int, default=25, help="generations per arm (default 25)")
    p.add_argument("--arms", default="both", choices=("both", "word-loop", "without"),
                   help="both arms (default), or the rule's (word-loop) or the one without it alone")
    p.add_argument("--batch", type=int, default=5, help="generations decoded together (default 5)")
    p.add_argument("--judge", default="gemma3-270m", help="the judge model, or none (default gemma3-270m)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    if a.pool:
        return pool(a.pool, Path(a.out))
    dbs = DirectedBeamSearch("default", threads=a.threads)
    ctxs = contexts(dbs.backend.tokenizer, a.n, a.tokens, stride=1000)
    sets = builtin_sets("paper")
    jobs = [(ctxs[i], sets[i % len(sets)]) for i in range(a.n)]
    arms = {"word-loop rule": dbs.config, "without it": replace(dbs.config, no_repeat_word_window=0)}
    arms = {name: cfg for name, cfg in arms.items() if a.arms == "both" or name.startswith(a.arms)}
    judge = None
    if a.judge != "none":
        from dbs_fast.evaluation.judge import Judge
        judge = Judge(a.judge, generator_dir=dbs.model_dir, threads=a.threads)
    report = {"tokens": a.tokens, "n": a.n, "judge": a.judge, "arms": {}}
    for name, cfg in arms.items():
        res = []
        for s in range(0, a.n, a.batch):
            res += dbs.generate_batch(jobs[s:s + a.batch], seeds=list(range(s, min(s + a.batch, a.n))), config=cfg)
        gen = [r.generated for r in res]
        ppl = [q for i in range(0, len(res), 8) for q in judge.perplexity(
            [(c, g) for (c, _), g in zip(jobs[i:i + 8], gen[i:i + 8])])] if judge else []
        report["arms"][name] = {
            "word_loops": int(sum(map(word_loop, gen))),
            "false_ends": false_ends(ended := [{"generated": g, "stopped": r.stopped} for g, r in zip(gen, res)]),
            "number_ends": false_ends(ended, number_end),
            "success_rate": float(np.mean([r.success_rate for r in res])),
            "new_tokens": float(np.mean([r.new_tokens for r in res])),
            "rep_4": float(np.mean([rep_n(g, 4) for g in gen])),
            "judge_ppl_median": float(np.median(ppl)) if ppl else None,
            "prompt_tokens": float(np.mean([r.prompt_tokens for r in res])), "texts": gen}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "loops.json").write_text(json.dumps(report, indent=2))
    lines = [f"{a.n} generations after about {a.tokens} tokens of English text each; judge {a.judge}.", "",
             "| arm | texts with a word loop | false sentence ends (after a number) | success | new tokens | rep-4 | judge ppl (median) |",
             "|---|---|---|---|---|---|---|"]
    for name, r in report["arms"].items():
        judged = f"{r['judge_ppl_median']:.1f}" if r["judge_ppl_median"] is not None else "-"
        lines.append(f"| {name} | {r['word_loops']} of {a.n} | {r['false_ends']} ({r['number_ends']}) | {r['success_rate']:.3f} | {r['new_tokens']:.1f} | "
                     f"{r['rep_4']:.3f} | {judged} |")
    (out / "loops.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
