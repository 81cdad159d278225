"""Whole generations of this checkout against another checkout of dbs-fast, each on its own export.

For a change that a kernel swap cannot A/B in one process (`kernel_generation.py`): a change of
the decode graph and the cache layout, whose exports differ. Each arm runs in its own process
with its own code (a checkout's dbs_fast, export and benchmarks packages imported in place of
the installed ones) and its own export; the arms take turns (ABBA across rounds),
each round a few generations after one warm-up. Paper setting, context "It is", the bench's
keyword sets, the same seeds in both arms.

    git worktree add /tmp/old REV
    python -m dbs_fast.benchmarks.checkouts --model NEW_EXPORT --against /tmp/old --against-model OLD_EXPORT \\
        [--rounds 3 --generations 2] [--out FILE]

Prints seconds per generation and the model / kernel / kv milliseconds per step of each arm.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

NEW_TOKENS = 90
THIS = "-"        # the child's root for this arm: the dbs_fast installed here, imported as it is


def _child(root: str, model: str, generations: int, first: int, new_tokens: int) -> None:
    """In a child process: the generations of one arm as JSON lines, code imported from `root`
    (`THIS`: the installed dbs_fast)."""
    if root != THIS:
        _import_from(root)
    from dbs_fast.benchmarks.bench import CONTEXT, KEYWORD_SETS

    import dbs_fast
    from dbs_fast import DBSConfig, DirectedBeamSearch

    assert root == THIS or Path(dbs_fast.__file__).resolve().is_relative_to(Path(root).resolve()), dbs_fast.__file__
    dbs = DirectedBeamSearch(model, config=DBSConfig.paper(max_new_tokens=new_tokens))
    dbs.generate(CONTEXT, KEYWORD_SETS[0], seed=0)                  # warm-up
    for i in range(first, first + generations):
        kws = KEYWORD_SETS[i % len(KEYWORD_SETS)]
        r = dbs.generate(CONTEXT, kws, seed=i)
        print(json.dumps({"set": i % len(KEYWORD_SETS), "seed": i, "seconds": r.seconds,
                          **{f"{k}_ms": 1e3 * r.timings.get(k, 0.0) / new_tokens for k in ("model", "kernel", "kv_gather")},
                          "text_md5": hashlib.md5(r.text.encode()).hexdigest()}), flush=True)


def _import_from(root: str) -> None:
    """dbs_fast, dbs_fast.export and dbs_fast.benchmarks from the checkout `root` from now on."""
    import importlib
    import importlib.util

    top = {"dbs_fast": Path(root) / "dbs_fast", "dbs_fast.export": Path(root) / "export",
           "dbs_fast.benchmarks": Path(root) / "benchmarks"}

    class Checkout:                  # the packages from `root`, their modules found under them
        @staticmethod
        def find_spec(name, path=None, target=None):
            if name not in top:
                return None
            return importlib.util.spec_from_file_location(name, top[name] / "__init__.py",
                                                          submodule_search_locations=[str(top[name])])

    for mod in [m for m in sys.modules if m == "dbs_fast" or m.startswith("dbs_fast.")]:
        del sys.modules[mod]
    sys.meta_path.insert(0, Checkout)
    importlib.invalidate_caches()


def run(model: str, against: str, against_model: str, rounds: int = 3, generations: int = 2,
        new_tokens: int = NEW_TOKENS) -> dict:
    from dbs_fast.benchmarks.host import machine

    arms = {"this": (THIS, model), "against": (str(Path(against).resolve()), against_model)}
    res = {arm: [] for arm in arms}
    for r in range(rounds):
        for arm in (list(arms) if r % 2 == 0 else list(reversed(list(arms)))):
            root, m = arms[arm]
            out = subprocess.run([sys.executable, "-m", "dbs_fast.benchmarks.checkouts", "--child", root, m,
                                  str(generations), str(r * generations), str(new_tokens)],
                                 capture_output=True, text=True, check=False,
                                 # not the working directory's dbs_fast/ (a source tree, whose
                                 # benchmarks/ and export/ are mapped only by the install)
                                 env={**os.environ, "PYTHONSAFEPATH": "1"})
            lines = [json.loads(x) for x in out.stdout.splitlines() if x.startswith("{")]
            if out.returncode or len(lines) != generations:
                raise RuntimeError(f"arm {arm} failed: {out.stderr.strip().splitlines()[-1:]}")
            res[arm] += lines
    out = {"machine": machine(), "model": model, "against_root": arms["against"][0], "against_model": against_model,
           "rounds": rounds, "generations_per_round": generations, "new_tokens": new_tokens, "arms": res,
           "same_texts": [a["text_md5"] == b["text_md5"] for a, b in zip(res["this"], res["against"])]}
    for arm, rs in res.items():
        out[arm] = {k: statistics.median(x[k] for x in rs) for k in ("seconds", "model_ms", "kernel_ms", "kv_gather_ms")}
    out["against_over_this"] = out["against"]["seconds"] / out["this"]["seconds"]
    return out


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        root, model, n, first, tokens = argv[1:6]
        _child(root, model, int(n), int(first), int(tokens))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="this checkout's export (or `default`)")
    ap.add_argument("--against", required=True, help="the other checkout's root (a git worktree)")
    ap.add_argument("--against-model", required=True, help="the export the other checkout runs")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--generations", type=int, default=2, help="generations per arm and round")
    ap.add_argument("--new-tokens", type=int, default=NEW_TOKENS)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if not (Path(a.against) / "dbs_fast" / "__init__.py").is_file():
        ap.error(f"--against {a.against}: not a checkout of dbs-fast (no dbs_fast/__init__.py)")
    r = run(a.model, a.against, a.against_model, a.rounds, a.generations, a.new_tokens)
    print(f"{r['machine']}: {a.rounds} rounds x {a.generations} generations per arm, {a.new_tokens} tokens")
    for arm in ("this", "against"):
        x = r[arm]
        print(f"  {arm:8s} {x['seconds']:7.2f} s/generation (median)   per step: model {x['model_ms']:6.1f} ms, "
              f"kernel {x['kernel_ms']:4.1f}, kv {x['kv_gather_ms']:4.1f}")
    print(f"  against / this: {r['against_over_this']:.3f}x; same texts: {r['same_texts']}")
    if a.out:
        Path(a.out).write_text(json.dumps(r, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
