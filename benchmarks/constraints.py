"""Constraint checks on the embedded default, as a benchmark (not a test): the ban rate and the
cost of `--order any` / phrases against `--order next` at the paper setting.

    python -m benchmarks.constraints --out runs/constraints [--n 100] [--sets 5]

ban: N generations (seeds 0..N-1) of a context and keywords that make the banned word likely,
without and with `ban`; the word's rate (whole words, case-insensitive, any inflection the ban
lists) in each. speed: the first `--sets` paper keyword sets, one process, the paper setting
(b = 7, s = 10, k = 5, 90 tokens, fixed length), seconds per generation for next, any, and a
phrase set; interleaved, best of --repeats.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from dbs_fast import DBSConfig, DirectedBeamSearch
from dbs_fast.bench.machine import machine
from dbs_fast.evaluation.runs import builtin_sets
from dbs_fast.text.words import words

BAN_CASE = {"context": "World War II was", "keywords": ["army", "conflict"], "ban": ["war", "wars"]}


def ban_rate(dbs, n: int, cfg: DBSConfig) -> dict:
    banned = set(BAN_CASE["ban"])
    out = {}
    for name, ban in (("without", None), ("with", BAN_CASE["ban"])):
        hits = 0
        for seed in range(n):
            r = dbs.generate(BAN_CASE["context"], BAN_CASE["keywords"], seed=seed, config=cfg, ban=ban)
            hits += bool(banned & set(words(r.generated)))
        out[name] = hits / n
    return {**BAN_CASE, "n": n, "rate_without_ban": out["without"], "rate_with_ban": out["with"]}


def speed(dbs, n_sets: int, repeats: int) -> dict:
    sets = builtin_sets("paper")[:n_sets]
    phrase_sets = [[f"{a} {b}"] + rest for a, b, *rest in sets]      # first two words as one phrase
    runs = {"next": (DBSConfig.paper(), sets), "any": (DBSConfig.paper(order="any"), sets),
            "next+phrase": (DBSConfig.paper(), phrase_sets)}
    best = {k: [float("inf")] * len(sets) for k in runs}
    for _ in range(repeats):
        for name, (cfg, ss) in runs.items():                          # interleaved: drift hits all alike
            for i, kws in enumerate(ss):
                t = time.perf_counter()
                dbs.generate("It is", kws, seed=i, config=cfg)
                best[name][i] = min(best[name][i], time.perf_counter() - t)
    per = {k: sum(v) / len(v) for k, v in best.items()}
    return {"seconds_per_generation": per, "any_over_next": per["any"] / per["next"],
            "phrase_over_next": per["next+phrase"] / per["next"], "sets": len(sets), "repeats": repeats}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="constraints_out")
    ap.add_argument("--n", type=int, default=100, help="generations per ban arm")
    ap.add_argument("--sets", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--skip", default="", help="ban and/or speed")
    a = ap.parse_args(argv)
    dbs = DirectedBeamSearch("default")
    res = {"date": time.strftime("%Y-%m-%d"), "machine": machine(),
           "model": str(dbs.model_dir)}
    if "ban" not in a.skip:
        res["ban"] = ban_rate(dbs, a.n, DBSConfig(beams=3, candidates=3, max_new_tokens=40))
        print(json.dumps(res["ban"]))
    if "speed" not in a.skip:
        res["speed"] = speed(dbs, a.sets, a.repeats)
        print(json.dumps(res["speed"]))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "constraints.json").write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
