"""Numba's OpenMP workers spinning or sleeping when idle, A/B/C on whole generations
(`kernels.start_threads`).

libgomp reads its wait policy once, when it loads, so each arm is its own process, kept alive
for the whole run; the parent lets them generate in turns (one process runs while the others
wait on their pipes), so all see the same machine load:
  spin     libgomp's default: workers spin 300000 times after each parallel region (before)
  passive  OMP_WAIT_POLICY=PASSIVE at load: workers sleep at once
  brief    GOMP_SPINCOUNT=20000 at load: a brief spin, then sleep (the engine's default)

    python -m dbs_fast.benchmarks.idle_wait --model DIR [--generations 3] [--out FILE]

Paper setting, context "It is", the bench's keyword sets; prints seconds per generation and the
model / kernel milliseconds per step of each arm.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics

ARMS = {"spin": {}, "passive": {"OMP_WAIT_POLICY": "PASSIVE"}, "brief": None}   # None: the engine's own
NEW_TOKENS = 90


def _worker(model: str, env: dict | None, new_tokens: int, conn) -> None:
    import os

    from dbs_fast import DBSConfig, DirectedBeamSearch, kernels
    from dbs_fast.benchmarks.bench import CONTEXT, KEYWORD_SETS

    os.environ.update(env or {})
    kernels.start_threads(env is None)                # before the engine's own call, which is then a no-op
    dbs = DirectedBeamSearch(model, config=DBSConfig.paper(max_new_tokens=new_tokens))
    dbs.generate(CONTEXT, KEYWORD_SETS[0], seed=0)    # warm-up
    conn.send("ready")
    while (i := conn.recv()) is not None:
        r = dbs.generate(CONTEXT, KEYWORD_SETS[i % len(KEYWORD_SETS)], seed=i)
        conn.send({"seconds": r.seconds, "model_ms": 1e3 * r.timings.get("model", 0.0) / new_tokens,
                   "kernel_ms": 1e3 * r.timings.get("kernel", 0.0) / new_tokens})


def run(model: str, generations: int = 3, new_tokens: int = NEW_TOKENS) -> dict:
    from dbs_fast.benchmarks.host import machine

    ctx = mp.get_context("spawn")
    procs, pipes = {}, {}
    for arm, env in ARMS.items():                     # started one at a time: loads do not overlap
        pipes[arm], child = ctx.Pipe()
        procs[arm] = ctx.Process(target=_worker, args=(str(model), env, new_tokens, child), daemon=True)
        procs[arm].start()
        assert pipes[arm].recv() == "ready"
    res = {arm: [] for arm in ARMS}
    try:
        for i in range(generations):
            for arm in (ARMS if i % 2 == 0 else reversed(list(ARMS))):
                pipes[arm].send(i)
                res[arm].append(pipes[arm].recv())
    finally:
        for arm in ARMS:
            pipes[arm].send(None)
            procs[arm].join(timeout=60)
    out = {"machine": machine(), "model": str(model), "generations": generations, "new_tokens": new_tokens,
           "arms": res}
    for arm, rs in res.items():
        out[arm] = {k: statistics.median(r[k] for r in rs) for k in ("seconds", "model_ms", "kernel_ms")}
    for arm in ARMS:
        out[f"spin_over_{arm}"] = out["spin"]["seconds"] / out[arm]["seconds"]
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--generations", type=int, default=3)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    from dbs_fast.benchmarks.host import report_arms

    res = run(a.model, a.generations)
    report_arms(res, ARMS, f"spin / passive = {res['spin_over_passive']:.3f}, spin / brief = "
                f"{res['spin_over_brief']:.3f}", a.out)
    return 0


if __name__ == "__main__":
    main()
