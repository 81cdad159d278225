"""This logits kernel against another kernels.py on whole generations, alternated in one process.

The engine's backend calls `kernels.sample` through the module, so each generation runs with one
arm's `sample` put in its place; the arms take turns (ABBA order), on the same engine, cache and
machine load. Paper setting, context "It is", the bench's keyword sets.

    git show REV:dbs_fast/kernels.py > /tmp/kernels_REV.py
    python -m dbs_fast.benchmarks.kernel_generation --model DIR --against /tmp/kernels_REV.py \\
        [--generations 4] [--out FILE]

Prints seconds per generation and the model / kernel milliseconds per step of each arm.
"""
from __future__ import annotations

import argparse
import functools
import inspect
import statistics

NEW_TOKENS = 90


def _without_boost_exp(sample, *args, boost_exp=None, **kw):
    return sample(*args, **kw)


def run(model: str, against: str, generations: int = 4, new_tokens: int = NEW_TOKENS) -> dict:
    from dbs_fast.benchmarks.bench import CONTEXT, KEYWORD_SETS
    from dbs_fast.benchmarks.host import machine
    from dbs_fast.benchmarks.kernel import load_other

    from dbs_fast import DBSConfig, DirectedBeamSearch, kernels

    other = load_other(against).sample
    if "boost_exp" not in inspect.signature(other).parameters:      # a kernel from before the backend kept it
        other = functools.partial(_without_boost_exp, other)
    arms = {"this": kernels.sample, "against": other}
    dbs = DirectedBeamSearch(model, config=DBSConfig.paper(max_new_tokens=new_tokens))
    res = {arm: [] for arm in arms}
    try:
        for sample in arms.values():                      # warm-up: compile both
            kernels.sample = sample
            dbs.generate(CONTEXT, KEYWORD_SETS[0], seed=0)
        for i in range(generations):
            for arm in (list(arms) if i % 2 == 0 else list(reversed(list(arms)))):
                kernels.sample = arms[arm]
                r = dbs.generate(CONTEXT, KEYWORD_SETS[i % len(KEYWORD_SETS)], seed=i)
                res[arm].append({"seconds": r.seconds, "text": r.text,
                                 "model_ms": 1e3 * r.timings.get("model", 0.0) / new_tokens,
                                 "kernel_ms": 1e3 * r.timings.get("kernel", 0.0) / new_tokens})
    finally:
        kernels.sample = arms["this"]
    out = {"machine": machine(), "model": str(model), "against": str(against), "generations": generations,
           "new_tokens": new_tokens, "arms": res,
           "same_texts": [a["text"] == b["text"] for a, b in zip(res["this"], res["against"])]}
    for arm, rs in res.items():
        out[arm] = {k: statistics.median(r[k] for r in rs) for k in ("seconds", "model_ms", "kernel_ms")}
    out["against_over_this"] = out["against"]["seconds"] / out["this"]["seconds"]
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--against", required=True, help="another kernels.py")
    ap.add_argument("--generations", type=int, default=4)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    from dbs_fast.benchmarks.host import report_arms

    res = run(a.model, a.against, a.generations)
    report_arms(res, ("this", "against"), f"against / this = {res['against_over_this']:.3f}; same texts "
                f"{res['same_texts']}", a.out)
    return 0


if __name__ == "__main__":
    main()
