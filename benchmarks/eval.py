"""`dbs-fast eval`: the paper's keyword-to-phrase evaluation (SPEC, "Evaluation").

Keyword sets: English words ranked 501-1000 by frequency (wordfreq), stop words removed,
5 per set, sampled with a fixed seed (or read from a file, one comma-separated set per line).
Each set runs DBS and the unguided baseline (b = s = 1, no boosts); results are appended to
results.jsonl as they finish (a re-run skips finished sets), then summary.json + summary.md.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from dbs_fast.errors import DBSError

# NLTK's English stop-word list (the corpus download is not available offline).
STOP_WORDS = set("""i me my myself we our ours ourselves you you're you've you'll you'd your yours yourself
yourselves he him his himself she she's her hers herself it it's its itself they them their theirs
themselves what which who whom this that that'll these those am is are was were be been being have has
had having do does did doing a an the and but if or because as until while of at by for with about
against between into through during before after above below to from up down in out on off over under
again further then once here there when where why how all any both each few more most other some such
no nor not only own same so than too very s t can will just don don't should should've now d ll m o re
ve y ain aren aren't couldn couldn't didn didn't doesn doesn't hadn hadn't hasn hasn't haven haven't isn
isn't ma mightn mightn't mustn mustn't needn needn't shan shan't shouldn shouldn't wasn wasn't weren
weren't won won't wouldn wouldn't""".split())


def candidate_words() -> list[str]:
    from wordfreq import top_n_list

    words = top_n_list("en", 1000)[500:1000]                     # frequency ranks 501-1000
    return [str(w) for w in words if w.isalpha() and len(w) >= 3 and w not in STOP_WORDS]


def sample_sets(n: int, seed: int, size: int = 5) -> list[list[str]]:
    rng = np.random.default_rng(seed)
    words = candidate_words()
    return [[str(w) for w in rng.choice(words, size=size, replace=False)] for _ in range(n)]


def read_sets(path: str) -> list[list[str]]:
    p = Path(path)
    if not p.is_file():
        raise DBSError(f"keyword file not found: {path}")
    return [[w.strip() for w in line.split(",")] for line in p.read_text().splitlines() if line.strip()]


def _row(i, kws, mode, r, n_batch) -> dict:
    # r.seconds is the wall time of the whole batch; a set's share is that over the batch size
    return {"set": i, "mode": mode, "keywords": kws, "success_rate": r.success_rate,
            "perplexity": r.perplexity, "success_length": r.success_length, "seconds": r.seconds / n_batch,
            "batch_seconds": r.seconds, "batch_sets": n_batch,
            "text": r.text, "found": r.found}


def run_eval(dbs, sets, out: Path, context="It is", batch=4, seed=0, unguided_cfg=None, quiet=False) -> dict:
    from tqdm import tqdm

    out.mkdir(parents=True, exist_ok=True)
    path = out / "results.jsonl"
    done = set()
    if path.is_file():
        done = {(d["set"], d["mode"]) for d in map(json.loads, path.read_text().splitlines())}
    cfgs = {"dbs": dbs.config, "unguided": unguided_cfg}
    todo = [(i, m) for m in cfgs for i in range(len(sets)) if (i, m) not in done]
    with open(path, "a") as f, tqdm(total=len(todo), desc="eval", unit="set", disable=quiet) as bar:
        for mode in cfgs:
            idx = [i for i, m in todo if m == mode]
            for start in range(0, len(idx), batch):
                part = idx[start:start + batch]
                res = dbs.generate_batch([(context, sets[i]) for i in part], seeds=[seed + i for i in part],
                                         config=cfgs[mode])
                for i, r in zip(part, res):
                    f.write(json.dumps(_row(i, sets[i], mode, r, len(part))) + "\n")
                f.flush()
                bar.update(len(part))
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    summary = {"scorer": dbs.scorer_name, "model": str(dbs.model_dir), "sets": len(sets),
               "config": dbs.config.to_dict(), "date": time.strftime("%Y-%m-%d")}
    for mode in cfgs:
        rs = [r for r in rows if r["mode"] == mode and r["set"] < len(sets)]
        summary[mode] = {m: {"mean": float(np.mean([r[m] for r in rs])), "std": float(np.std([r[m] for r in rs]))}
                         for m in ("success_rate", "perplexity", "success_length", "seconds")}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    lines = ["| run | success rate | perplexity | success length | seconds/set (amortised over a batch) |", "|---|---|---|---|---|"]
    for mode in cfgs:
        s = summary[mode]
        lines.append(f"| {mode} | {s['success_rate']['mean']:.2f} ± {s['success_rate']['std']:.2f} | "
                     f"{s['perplexity']['mean']:.1f} ± {s['perplexity']['std']:.1f} | "
                     f"{s['success_length']['mean']:.1f} | {s['seconds']['mean']:.1f} |")
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    return summary
