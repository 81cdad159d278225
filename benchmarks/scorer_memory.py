"""Memory of a second-LM scorer (`--scorer DIR`) on each KV layout (issue 11).

One paper-setting generation (b = 7, s = 10, k = 5, 90 tokens: `stop="max"`) per layout, each in
its own process so that peak RSS is that layout's alone; prints one JSON line per layout with the
scorer's cache at its largest, the generator's, the peak RSS and the text:

    python -m dbs_fast.benchmarks.scorer_memory --model runs/default-auto --scorer runs/default-v2

Both exports must share a tokenizer and have `decode.onnx` (made by this version).
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys

KEYWORDS = ["sun", "park", "dog", "ball", "run"]


def one(model: str, scorer: str, layout: str) -> dict:
    from dbs_fast import DBSConfig, DirectedBeamSearch

    dbs = DirectedBeamSearch(model, config=DBSConfig(stop="max"), scorer=scorer, kv_layout=layout)
    cls, largest = type(dbs.scorer), [0]
    score = cls.score

    def watched(self, *args):
        out = score(self, *args)
        largest[0] = max(largest[0], self.cache.nbytes)
        return out

    cls.score = watched
    r = dbs.generate("It is", KEYWORDS, seed=0)
    return {"layout": layout, "scorer_cache_mb": round(largest[0] / 1e6, 1),
            "generator_cache_mb": round(r.kv_cache_bytes / 1e6, 1),
            "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6, 2),
            "seconds": round(r.seconds, 1), "text": r.text}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--scorer", required=True)
    ap.add_argument("--layouts", default="prefix,rows")
    ap.add_argument("--one", help=argparse.SUPPRESS)          # the child process: this layout only
    a = ap.parse_args(argv)
    if a.one:
        print(json.dumps(one(a.model, a.scorer, a.one)))
        return 0
    for layout in a.layouts.split(","):
        out = subprocess.run([sys.executable, "-m", "dbs_fast.benchmarks.scorer_memory", "--model", a.model,
                              "--scorer", a.scorer, "--one", layout], capture_output=True, text=True, check=True)
        print(out.stdout.strip().splitlines()[-1], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
