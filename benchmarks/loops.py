"""Word loops after a long context: N generations, each after its own window of about T tokens of
English text (sentences of CommonGen train, packaged) with one of the paper's keyword sets, with
the word-loop rule (the default) and without it (`no_repeat_word_window=0`), the same seeds.
Reported per arm: texts with a word loop (a word three times within five words), success,
new tokens, the judge's perplexity (a model other than the generator) and rep-4, and the texts.

    python -m benchmarks.loops --tokens 2000 --n 25 --out runs/loops-long
"""
from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

import numpy as np

from dbs_fast.api import DirectedBeamSearch
from dbs_fast.evaluation.metrics import rep_n, word_loop
from dbs_fast.evaluation.runs import builtin_sets
from dbs_fast.text.prompt import train_pool


def contexts(tokenizer, n: int, tokens: int, stride: int) -> list[str]:
    """`n` windows of `tokens` tokens of the packaged English text, `stride` tokens apart."""
    ids = tokenizer.encode(" ".join(s for _, s in train_pool()), add_special_tokens=False).ids
    if len(ids) < tokens + (n - 1) * stride:
        raise SystemExit(f"the packaged text has {len(ids)} tokens: too few for {n} windows of {tokens}")
    return [tokenizer.decode(ids[i * stride: i * stride + tokens]) for i in range(n)]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=2000, help="context tokens (default 2000)")
    p.add_argument("--n", type=int, default=25, help="generations per arm (default 25)")
    p.add_argument("--batch", type=int, default=5, help="generations decoded together (default 5)")
    p.add_argument("--judge", default="gemma3-270m", help="the judge model, or none (default gemma3-270m)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    dbs = DirectedBeamSearch("default", threads=a.threads)
    ctxs = contexts(dbs.backend.tokenizer, a.n, a.tokens, stride=200)
    sets = builtin_sets("paper")
    jobs = [(ctxs[i], sets[i % len(sets)]) for i in range(a.n)]
    arms = {"word-loop rule": dbs.config, "without it": replace(dbs.config, no_repeat_word_window=0)}
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
            "word_loops": int(sum(map(word_loop, gen))), "success_rate": float(np.mean([r.success_rate for r in res])),
            "new_tokens": float(np.mean([r.new_tokens for r in res])),
            "rep_4": float(np.mean([rep_n(g, 4) for g in gen])),
            "judge_ppl_median": float(np.median(ppl)) if ppl else None,
            "prompt_tokens": float(np.mean([r.prompt_tokens for r in res])), "texts": gen}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "loops.json").write_text(json.dumps(report, indent=2))
    lines = [f"{a.n} generations after about {a.tokens} tokens of English text each; judge {a.judge}.", "",
             "| arm | texts with a word loop | success | new tokens | rep-4 | judge ppl (median) |", "|---|---|---|---|---|---|"]
    for name, r in report["arms"].items():
        judged = f"{r['judge_ppl_median']:.1f}" if r["judge_ppl_median"] is not None else "-"
        lines.append(f"| {name} | {r['word_loops']} of {a.n} | {r['success_rate']:.3f} | {r['new_tokens']:.1f} | "
                     f"{r['rep_4']:.3f} | {judged} |")
    (out / "loops.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
