"""The returned beam by each rule of `--pick`, on the same generations. `dbs-fast eval` stores every
final beam of each set (text, Q score, finished, mean log-prob per token); this re-picks them with
the engine's own `dbs_fast.search.result.pick` (which only reads the final beams, so a re-pick is
what `--pick RULE` would have returned) and scores each rule's texts as `eval` does: success or
coverage, the judge's perplexity (a model other than the generator), rep-4, word loops, words
and, on CommonGen, BLEU-4 and CIDEr-D against all references. Three examples per rule are
picked by a fixed seed.

    dbs-fast eval --sets commongen-dev --limit 100 --runs guarantee --out runs/cg100
    python -m benchmarks.pick --eval runs/cg100 --run guarantee --out runs/pick-cg100
"""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import numpy as np

from benchmarks import write
from dbs_fast.config import PICKS
from dbs_fast.evaluation.metrics import rep_n, word_loop
from dbs_fast.evaluation.runs import builtin_refs, commongen_scores
from dbs_fast.search.result import pick
from dbs_fast.text.words import words

ORDERLESS = ("likelihood", "consensus")     # rules that read no place by Q (but to break ties)


def own_rule(r: dict) -> str:
    """The rule the run picked this row's text by (runs before `pick` existed: q)."""
    return r.get("config", {}).get("pick", "q")


def q_order(r: dict) -> list[int] | None:
    """The indices of a row's beams in their order by Q, which `pick` reads as their places: by
    each beam's `rank`; the stored order where the run picked by Q (the picked beam comes first
    and was the best by Q); None where neither holds (a run picked otherwise, without ranks)."""
    beams = r["beams"]
    if all("rank" in b for b in beams):
        return sorted(range(len(beams)), key=lambda j: beams[j]["rank"])
    return list(range(len(beams))) if own_rule(r) == "q" else None


def repick(rows: list[dict], rule: str) -> list[dict] | None:
    """The rows with `generated` as `rule` would have returned it (the run's own text where the
    rule picks the beam the run returned: that one may be trimmed back to a sentence end); None
    where the beams' order by Q, which the rule reads, is not known (the run's own rule is its text)."""
    out = []
    for r in rows:
        beams = [{**b, "score": -np.inf if b["score"] is None else b["score"],
                  "logprob": np.nan if b["logprob"] is None else b["logprob"]} for b in r["beams"]]
        order = q_order(r)
        if own_rule(r) == rule:
            j = 0                                       # the run's own pick
        elif order is None and rule not in ORDERLESS:
            return None
        else:
            order = order or list(range(len(beams)))
            j = order[pick(rule, [beams[o] for o in order])]
        out.append({**r, "generated": r["generated"] if j == 0 else beams[j]["text"], "picked": j})
    return out


def score(rows: list[dict], judge, refs) -> dict:
    ppl = [p for i in range(0, len(rows), 16) for p in judge.perplexity(
        [(r["context"], r["generated"]) for r in rows[i:i + 16]])] if judge else []
    s = {"sets": len(rows), "judge_ppl_median": float(np.median(ppl)) if ppl else None,
         "judge_ppl_mean": float(np.mean(ppl)) if ppl else None,
         "rep_4": float(np.mean([rep_n(r["generated"], 4) for r in rows])),
         "word_loops": float(np.mean([word_loop(r["generated"]) for r in rows])),
         "words": float(np.mean([len(words(r["generated"])) for r in rows])),
         "finished": float(np.mean([bool(r["beams"][r["picked"]]["finished"]) for r in rows])),
         "changed": float(np.mean([r["picked"] != 0 for r in rows]))}
    if refs is not None:
        s.update({k: v for k, v in commongen_scores(rows, refs).items() if k != "tokenisation"})
    else:
        from dbs_fast.evaluation.metrics import coverage
        s["success_rate"] = float(np.mean([coverage(r["generated"], r["keywords"]) for r in rows]))
    return s


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--eval", required=True, help="an eval's --out folder (results.jsonl, summary.json)")
    p.add_argument("--run", default="dbs", help="the eval's run to re-pick (default: dbs)")
    p.add_argument("--judge", default="auto", help="a model dir or embedded name (auto: the eval's own judge)")
    p.add_argument("--threads", type=int, default=None, help="the judge's threads (default: all cores)")
    p.add_argument("--start", type=int, default=0, help="only the sets from this index of the eval's on (default 0)")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    src = Path(a.eval)
    summary = json.loads((src / "summary.json").read_text())
    rows = [json.loads(line) for line in (src / "results.jsonl").read_text().splitlines()]
    rows = sorted((r for r in rows if r["mode"] == a.run and "beams" in r and r["set"] >= a.start),
                  key=lambda r: r["set"])
    if not rows:
        raise SystemExit(f"no rows of run {a.run!r} with their beams in {src}")
    first = summary.get("first_set", 0)
    refs = None
    if "commongen" in summary.get(a.run, {}):
        every = builtin_refs("commongen-dev")
        refs = every[first:]
    judge = None
    if a.judge != "none":
        from dbs_fast.evaluation.judge import Judge
        judge = Judge(summary["judge"] if a.judge == "auto" else a.judge, generator_dir=summary["model"],
                      threads=a.threads)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"eval": str(src), "run": a.run, "judge": judge.name if judge else None, "rules": {}}
    examples = sorted(random.Random(0).sample(range(len(rows)), min(3, len(rows))))
    lines = [f"{len(rows)} sets of `{src}` (run {a.run}{f', from its set {a.start}' if a.start else ''}), re-picked; "
             f"judge {report['judge']}.", "",
             "| pick | changed | finished | " + ("coverage | all concepts | BLEU-4 | CIDEr-D | " if refs else
                                                 "success | ") + "judge ppl (median / mean) | rep-4 | word loops | words |",
             "|---|---|---|" + ("---|---|---|---|" if refs else "---|") + "---|---|---|---|"]
    texts, rules = {}, []
    for rule in PICKS:
        picked = repick(rows, rule)
        if picked is None:
            lines.append(f"| {rule} | the beams' order by Q is not stored (a run picked by "
                         f"{own_rule(rows[0])} before beams had `rank`) |")
            continue
        rules.append(rule)
        s = score(picked, judge, refs)
        report["rules"][rule] = s
        texts[rule] = [picked[i]["generated"] for i in examples]
        mid = (f"{s['coverage']:.3f} | {s['all_covered']:.3f} | {s['bleu4']:.1f} | {s['cider']:.2f} | " if refs
               else f"{s['success_rate']:.3f} | ")
        judged = f"{s['judge_ppl_median']:.1f} / {s['judge_ppl_mean']:.1f}" if judge else "-"
        lines.append(f"| {rule} | {s['changed']:.2f} | {s['finished']:.2f} | {mid}{judged} | {s['rep_4']:.3f} | "
                     f"{s['word_loops']:.3f} | {s['words']:.1f} |")
    lines += ["", "Examples (sets picked by seed 0):", ""]
    for n, i in enumerate(examples):
        lines.append(f"- set {first + rows[i]['set']} ({', '.join(rows[i]['keywords'])}):")
        lines += [f"  - {rule}: {json.dumps(texts[rule][n].strip())}" for rule in rules]
    report["examples"] = {rule: texts[rule] for rule in rules}
    write(out, "pick", report, lines)


if __name__ == "__main__":
    main()
