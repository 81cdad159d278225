"""Engine v2's decode step vs today's, on the same model and rows (issue 11).

Today: `model.onnx` with one past per row (b * s copies of each beam's prefix), `present` =
past + new returned every step, and a gather of the whole cache at every chunk boundary.
v2: `decode.onnx` (export/prefix_graph.py) with b prefixes and b * s chunk buffers, only the
new token's K/V returned, and at the boundary the b kept prefixes extended by their chunk.

For each prefix length T it times one decode step (median of --repeats, after a warm-up) and
the chunk-boundary cache work (per chunk, so per step it is that over k), checks that both
graphs give the same logits, and reports the cache bytes. Writes JSON (+ the exported graph):

    python -m dbs_fast.benchmarks.prefix --model DIR --out runs/prefix

DIR: an export made by this version (it has decode.onnx; `dbs-fast export --model default --out
DIR`). The per-generation arm (--generations N paper sets, best of 2, arms interleaved) runs the
whole engine on both layouts and checks that they write the same texts.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from dbs_fast.benchmarks.host import machine
from dbs_fast.export.timing import median_seconds


def export_decoder(model: str, model_dir: Path, out: Path) -> Path:
    """The model's decode graph: from its export (this version writes one), else exported into `out`."""
    from dbs_fast.export.prefix_graph import export_prefix_decoder
    from dbs_fast.export.source import load_torch_model, resolve
    from dbs_fast.prefix import DECODE_GRAPH

    if (model_dir / DECODE_GRAPH).is_file():
        return model_dir / DECODE_GRAPH
    path = out / DECODE_GRAPH
    if not path.is_file():
        torch_model, _ = load_torch_model(resolve(model))
        export_prefix_decoder(torch_model, path)
    return path


def measure(full, dec, b: int, s: int, k: int, T: int, repeats: int, seed: int = 0) -> dict:
    from dbs_fast.prefix import PrefixCache

    rng = np.random.default_rng(seed)
    N = b * s
    ctx = rng.integers(100, 1000, (b, T))
    _, past = full.forward(ctx, full.empty_cache(b))                     # b beams' prefixes
    used = k // 2                                                         # mid-chunk
    chunk_tok = rng.integers(100, 1000, (N, used))
    old = past.repeat(s)                                                  # today: s copies per beam
    for j in range(used):
        _, old = full.forward(chunk_tok[:, j:j + 1], old)
    new = PrefixCache.start(past.tensors, past.mask, s, k)
    for j in range(used):
        dec.step(chunk_tok[:, j], new)
    tok = rng.integers(100, 1000, (N, 1))
    ref, _ = full.forward(tok, old)
    got = dec.step(tok[:, 0], new)
    new.used -= 1                                                          # undo that write: same state each step
    new.chunk_mask[:, new.used] = 0
    diff = float(np.abs(ref[:, 0] - got).max())

    def old_step():
        full.forward(tok, old)

    def new_step():
        dec.step(tok[:, 0], new)
        new.used -= 1
        new.chunk_mask[:, new.used] = 0

    keep = np.sort(rng.choice(N, b, replace=False))
    rows = np.repeat(keep, s)

    def old_boundary():                                                   # gather kept rows, repeat s times
        old.select(rows)

    def new_boundary():
        c = PrefixCache(list(new.prefix), new.mask, [x.copy() for x in new.chunk], new.chunk_mask.copy(), s, used)
        c.keep(keep)

    res = {"T": T, "rows": N, "max_abs_logit_diff": diff,
           "old_step_s": median_seconds(old_step, repeats), "new_step_s": median_seconds(new_step, repeats),
           "old_boundary_s": median_seconds(old_boundary, repeats), "new_boundary_s": median_seconds(new_boundary, repeats),
           "old_cache_bytes": int(sum(t.nbytes for t in old.tensors)),
           "new_cache_bytes": int(sum(t.nbytes for t in new.prefix) + sum(t.nbytes for t in new.chunk))}
    res["old_per_step_s"] = res["old_step_s"] + res["old_boundary_s"] / k
    res["new_per_step_s"] = res["new_step_s"] + res["new_boundary_s"] / k
    res["speedup"] = res["old_per_step_s"] / res["new_per_step_s"]
    return res


def generations(model_dir, n_sets: int, repeats: int, threads=None) -> dict:
    """Seconds per generation at the paper setting on each layout (arms interleaved, best of
    `repeats` per set), and whether the two wrote the same texts."""
    from dbs_fast import DBSConfig, DirectedBeamSearch
    from dbs_fast.benchmarks.eval import builtin_sets

    sets = builtin_sets("paper")[:n_sets]
    cfg = DBSConfig.paper()
    engines = {lay: DirectedBeamSearch(model_dir, threads=threads, kv_layout=lay) for lay in ("rows", "prefix")}
    best = {lay: [float("inf")] * len(sets) for lay in engines}
    texts = {lay: [None] * len(sets) for lay in engines}
    for _ in range(repeats):
        for i, kws in enumerate(sets):
            for lay, dbs in engines.items():
                t = time.perf_counter()
                r = dbs.generate("It is", kws, seed=i, config=cfg)
                best[lay][i] = min(best[lay][i], time.perf_counter() - t)
                texts[lay][i] = r.generated
    per = {lay: sum(v) / len(v) for lay, v in best.items()}
    return {"seconds_per_generation": per, "speedup": per["rows"] / per["prefix"], "sets": len(sets),
            "repeats": repeats, "same_texts": texts["rows"] == texts["prefix"],
            "differing_sets": [i for i in range(len(sets)) if texts["rows"][i] != texts["prefix"][i]]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default", help="exported model dir, or `default`")
    ap.add_argument("--checkpoint", default=None, help="its source checkpoint, for the decode graph "
                                                       "(default: --model, which works for `default`)")
    ap.add_argument("--out", default="prefix_out")
    ap.add_argument("--beams", type=int, default=7)
    ap.add_argument("--candidates", type=int, default=10)
    ap.add_argument("--chunk", type=int, default=5)
    ap.add_argument("--lengths", default="8,47,90")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--generations", type=int, default=3, help="paper sets for the per-generation arm (0: skip)")
    a = ap.parse_args(argv)
    from dbs_fast.home import default_model_dir
    from dbs_fast.prefix import PrefixDecoder
    from dbs_fast.session import OnnxModel

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    full = OnnxModel(default_model_dir() if a.model == "default" else a.model, threads=a.threads)
    dec = PrefixDecoder(export_decoder(a.checkpoint or a.model, full.dir, out), threads=a.threads)
    rows = []
    for T in (int(x) for x in a.lengths.split(",")):
        r = measure(full, dec, a.beams, a.candidates, a.chunk, T, a.repeats)
        print(json.dumps(r), flush=True)
        rows.append(r)
    res = {"date": time.strftime("%Y-%m-%d"), "machine": machine(), "model": a.model,
           "beams": a.beams, "candidates": a.candidates, "chunk": a.chunk, "results": rows}
    if a.generations:
        res["generation"] = generations(full.dir, a.generations, 2, a.threads)
        print(json.dumps(res["generation"]), flush=True)
    (out / "prefix.json").write_text(json.dumps(res, indent=2))
    print(f"wrote {out / 'prefix.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
