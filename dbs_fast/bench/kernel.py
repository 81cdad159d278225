"""The logits kernel on the paper's batch (b*s = 70 rows x GPT-2's 50257 tokens), against the
plain NumPy sort-based top-p (`numpy_sample`, the same algorithm as `tests/naive.py`, which
an installed package cannot import) and a torch sort-based top-p (the PyTorch baseline's sampler).

    python -m dbs_fast.bench.kernel --rows 70 --vocab 50257 --repeats 20

The same run also times the kernel with the anti-repetition options on (repetition_penalty
1.2, no_repeat_ngram_size 3, a 100-token history per row), so the two times are comparable.

`--against FILE` also times this kernel against another version of it, alternated call by call
on the same workload in one process (the machine's load hits both alike), after checking that
both draw the same ids:

    git show REV:dbs_fast/kernels.py > /tmp/kernels_rev.py
    python -m dbs_fast.bench.kernel --against /tmp/kernels_rev.py
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from dbs_fast import kernels
from dbs_fast.config import DBSConfig
from dbs_fast.numba_runtime import set_threads


def _workload(rows: int, vocab: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    # LM-like logits: a heavy tail (Gumbel) so the nucleus holds tens to thousands of tokens
    logits = (rng.gumbel(size=(rows, vocab)) * 2.5).astype(np.float32)
    # a guide word's boost table as the GloVe one is: ~60% of GPT-2's vocabulary has a positive
    # similarity, lambda * cos^2 mostly small (the bench's 5 words at lambda 20: median 1.1, 99th
    # percentile 8.6, max 20; here median 0.9, 99th 12)
    n_boost = max(1, int(vocab * 0.6))
    ids = np.sort(rng.choice(vocab, n_boost, replace=False)).astype(np.int32)
    vals = (20 * rng.beta(1, 3, n_boost) ** 2).astype(np.float32)
    csr = (np.array([0, n_boost], np.int64), ids, vals)
    row_word = np.where(np.arange(rows) % 2 == 0, 0, -1).astype(np.int32)   # half the rows guided
    return logits, rng.random(rows), row_word, csr


def numpy_sample(logits, uniforms, row_word, csr, top_p=0.9):
    """Sort-based top-p in plain NumPy, filter then boost (the reference the tests use)."""
    ptr, bids, bvals = csr
    R, V = logits.shape
    out = np.empty(R, np.int64)
    for r in range(R):
        s = logits[r].astype(np.float64)
        order = np.argsort(-s, kind="stable")
        w = np.exp(s - s.max())
        cum = np.cumsum(w[order])
        cut = s[order[min(int(np.searchsorted(cum, top_p * cum[-1])), V - 1)]]
        kept = s >= cut
        if row_word[r] >= 0:
            b = np.zeros(V)
            b[bids[ptr[row_word[r]]:ptr[row_word[r] + 1]]] = bvals[ptr[row_word[r]]:ptr[row_word[r] + 1]]
            w = w * np.exp(np.where(kept, b, 0.0))
        c = np.cumsum(np.where(kept, w, 0.0))
        out[r] = min(int(np.searchsorted(c, uniforms[r] * c[-1], side="right")), V - 1)
    return out


def draw(m, logits, u, **rules):
    """`m.sample` (this kernels module, or another kernels.py loaded by `load_other`) under rules
    given by name (`StepRules.given`); a kernels.py from before StepRules takes them as keywords."""
    if hasattr(m, "StepRules"):
        return m.sample(logits, u, m.StepRules.given(**rules))
    ptr, ids, vals = rules.pop("boosts")
    return m.sample(logits, u, boost_ptr=ptr, boost_ids=ids, boost_vals=vals, **rules)


def _time(fn, repeats: int) -> dict:
    fn()                                       # warm-up (compilation, caches)
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return {"ms_median": 1e3 * statistics.median(ts), "ms_min": 1e3 * min(ts), "ms_max": 1e3 * max(ts)}


def run(rows: int = 70, vocab: int = 50257, repeats: int = 20, threads: int | None = None,
        torch_too: bool = True) -> dict:
    set_threads(threads)
    logits, u, row_word, csr = _workload(rows, vocab)
    ptr, bids, bvals = csr
    res = {"rows": rows, "vocab": vocab, "threads": threads}
    res["numba"] = _time(lambda: draw(kernels, logits, u, top_p=0.9, row_word=row_word, boosts=csr), repeats)
    res["numpy"] = _time(lambda: numpy_sample(logits, u, row_word, csr), max(1, repeats // 5))
    same = np.array_equal(numpy_sample(logits, u, row_word, csr),
                          draw(kernels, logits, u, top_p=0.9, row_word=row_word, boosts=csr)[0])
    res["numba_equals_numpy"] = bool(same)
    hist = np.random.default_rng(1).integers(0, vocab, (rows, 100)).astype(np.int32)
    hist[:, 50:] = hist[:, :50]                                  # repeats, so n-grams get banned
    res["numba_anti_repetition"] = _time(lambda: draw(
        kernels, logits, u, top_p=0.9, row_word=row_word, boosts=csr, history=hist, repetition_penalty=1.2,
        no_repeat_ngram_size=3), repeats)
    res["anti_repetition_ratio"] = res["numba_anti_repetition"]["ms_median"] / res["numba"]["ms_median"]
    if torch_too:
        try:
            import torch

            from dbs_fast.torch_backend import torch_sample
        except ImportError:
            torch = None
        if torch is not None:
            if threads:
                torch.set_num_threads(threads)
            tl = torch.from_numpy(logits)
            dense = torch.zeros((1, vocab))
            dense[0, torch.from_numpy(bids.astype(np.int64))] = torch.from_numpy(bvals)
            res["torch"] = _time(lambda: torch_sample(tl, u, row_word, dense, DBSConfig(top_p=0.9), False), repeats)
    for other in ("numpy", "torch"):
        if other in res:
            res[f"speedup_vs_{other}"] = res[other]["ms_median"] / res["numba"]["ms_median"]
    return res


def load_other(path: str):
    """Another kernels.py, loaded as a module of this package (so its relative imports resolve)
    and compiled afresh, not cached: Numba's cache of a module loaded this way fails to load again
    on the next run ("No module named '<dynamic>'")."""
    import importlib.util
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "kernels_against.py"
        src.write_text(Path(path).read_text().replace("cache=True", "cache=False"))
        spec = importlib.util.spec_from_file_location("dbs_fast._kernels_against", src)
        other = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = other         # a dataclass in it (StepRules) looks its module up
        spec.loader.exec_module(other)
    return other


def _bans_and_loops(hist: np.ndarray, vocab: int) -> dict:
    """The default preset's shaping on `hist`: n-gram bans and the word-loop rule (each token its
    own word), and every tenth row under a ban of a third of the vocabulary, one-token sequences in
    ascending order (a glue ban: the word pieces that would continue a keyword just placed)."""
    rows = len(hist)
    words = (np.ones(vocab, np.int8), np.arange(vocab, dtype=np.int32), np.arange(vocab + 1, dtype=np.int64),
             np.arange(vocab, dtype=np.int32))
    banned = np.arange(0, vocab, 3, dtype=np.int32)
    bans = (np.array([0, len(banned)], np.int64), np.arange(len(banned) + 1, dtype=np.int64), banned)
    row_ban = np.where(np.arange(rows) % 10 == 0, 0, -1).astype(np.int32)
    return {"history": hist, "no_repeat_ngram_size": 3, "no_repeat_word_window": 5, "words": words, "bans": bans,
            "row_ban": row_ban}


def against(path: str, rows: int = 70, vocab: int = 50257, rounds: int = 40) -> dict:
    """This kernel against the `sample` of another kernels.py (loaded as a module of this package,
    so its relative imports resolve), alternated call by call; plain (peaked logits), flat
    logits, plain with anti-repetition, and plain with the default's n-gram and word-loop rules
    and a large ban (`_bans_and_loops`)."""
    other = load_other(path)
    logits, u, row_word, (ptr, bids, bvals) = _workload(rows, vocab)
    hist = np.random.default_rng(1).integers(0, vocab, (rows, 100)).astype(np.int32)
    hist[:, 50:] = hist[:, :50]
    # flat: an untrained model's (or a high temperature's) logits, thousands of tokens per bucket
    flat = (np.random.default_rng(2).standard_normal(logits.shape) * 0.5).astype(np.float32)
    out = {"against": str(path), "rounds": rounds}
    for kind, x, kw in (("plain", logits, {}), ("flat", flat, {}),
                        ("anti_repetition", logits, {"history": hist, "repetition_penalty": 1.2,
                                                     "no_repeat_ngram_size": 3}),
                        ("bans_and_word_loops", logits, _bans_and_loops(hist, vocab))):
        def call(m):
            return draw(m, x, u, top_p=0.9, row_word=row_word, boosts=(ptr, bids, bvals), **kw)
        a, b = call(kernels), call(other)
        ts = {"this": [], "against": []}
        for _ in range(rounds):
            for name, m in (("this", kernels), ("against", other)):
                t0 = time.perf_counter()
                call(m)
                ts[name].append(time.perf_counter() - t0)
        med = {k: 1e3 * statistics.median(v) for k, v in ts.items()}
        out[kind] = {"same_ids": bool(np.array_equal(a[0], b[0])), "max_logp_diff": float(np.abs(a[1] - b[1]).max()),
                     "ms_median": med, "against_over_this": med["against"] / med["this"]}
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=70)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--against", default=None, help="another kernels.py to time against, alternated")
    a = ap.parse_args(argv)
    res = run(a.rows, a.vocab, a.repeats, a.threads)
    if a.against:
        res["against"] = against(a.against, a.rows, a.vocab)
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
