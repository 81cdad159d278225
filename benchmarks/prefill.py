"""Prefill of engine v2, alternated on one export: a context of T tokens through `decode.onnx` in
one call (L = T new tokens per row; one call per `PREFILL_SLICE` = 256 columns beyond that)
against one call per context column (how exports made before multi-token steps prefill). Random context tokens (the cost does not depend on their values); the
two paths' last logits are compared before anything is timed.

    python -m dbs_fast.benchmarks.prefill --model DIR [--lengths 3,16,66,200 --rows 1 --rounds 3]
        [--out FILE.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

from dbs_fast.benchmarks.host import decode_graph_export, machine
from dbs_fast.export.timing import median_seconds
from dbs_fast.prefix import DECODE_GRAPH


def run(model_dir: Path, lengths: list[int], rows: int = 1, rounds: int = 3, threads: int | None = None) -> dict:
    from dbs_fast.prefix import PrefixCache, PrefixDecoder
    from dbs_fast.session import read_manifest

    m = read_manifest(model_dir)
    one, per = PrefixDecoder(model_dir / DECODE_GRAPH, "cpu", threads), PrefixDecoder(model_dir / DECODE_GRAPH, "cpu", threads)
    if not one.multi_token:
        raise SystemExit(f"{model_dir / DECODE_GRAPH} takes one token per row: re-export it with this version")
    per.multi_token = False
    rng = np.random.default_rng(0)
    out = []
    for T in lengths:
        ids, mask = rng.integers(1, m["vocab_size"], (rows, T)), np.ones((rows, T), np.int64)

        def prefill(dec):
            return PrefixCache.prefill(dec, ids, mask, m["num_kv_heads"], m["head_dim"], s=1, k=1)[0]

        diff = float(np.abs(prefill(one) - prefill(per)).max())
        ms = {"one_call": [], "per_column": []}
        for _ in range(rounds):
            ms["one_call"].append(1e3 * median_seconds(lambda: prefill(one), 3))
            ms["per_column"].append(1e3 * median_seconds(lambda: prefill(per), 1))
        med = {k: statistics.median(v) for k, v in ms.items()}
        out.append({"tokens": T, "rows": rows, "ms_per_round": ms, "ms_median": med,
                    "per_column_over_one_call": med["per_column"] / med["one_call"], "max_abs_logit_diff": diff})
    from dbs_fast.prefix import PREFILL_SLICE

    return {"machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M %Z"), "model": str(model_dir),
            "prefill_slice": PREFILL_SLICE, "prefill": out}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="an export made by this version (decode.onnx)")
    ap.add_argument("--lengths", default="3,16,66,200", help="context tokens, comma-separated")
    for name, default in (("rows", 1), ("rounds", 3), ("threads", None)):
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    model = decode_graph_export(ap, a.model)
    r = run(model, [int(x) for x in a.lengths.split(",")], a.rows, a.rounds, a.threads)
    print(f"{r['machine']}, {r['date']}, {model}:")
    for p in r["prefill"]:
        print(f"  {p['tokens']} tokens x {p['rows']} rows: one call {p['ms_median']['one_call']:.1f} ms, "
              f"per column {p['ms_median']['per_column']:.1f} ms ({p['per_column_over_one_call']:.1f}x); "
              f"max |logit diff| {p['max_abs_logit_diff']:.1e}")
    if a.out:
        Path(a.out).write_text(json.dumps(r, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
