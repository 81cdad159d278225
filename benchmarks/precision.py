"""An fp16 export's decode graph against the fp32 model.onnx beside it, over a run of the search's
shape: two left-padded contexts, 2 beams x s candidates, `--chunks` chunks of k tokens with the beams
kept and swapped between them (`export/prefix_graph.parity`), both graphs on `--provider`. Reports the
largest logit difference, the mean KL of the next-token distributions and the share of rows whose
likeliest token is the same (top-1 agreement), over the prefill and every step.

    python -m benchmarks.precision --model DIR [--provider cuda --candidates 10 --chunk 5 --chunks 4]
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from dbs_fast.bench.machine import machine


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="an export (`dbs-fast export --dtype fp16`)")
    ap.add_argument("--provider", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--candidates", type=int, default=10)
    ap.add_argument("--chunk", type=int, default=5)
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--context", type=int, default=8, help="context tokens (random ids)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write the result as JSON here")
    a = ap.parse_args(argv)
    from dbs_fast.export.prefix_graph import parity
    from dbs_fast.manifest import read_manifest

    m = read_manifest(Path(a.model))
    r = parity(Path(a.model), s=a.candidates, k=a.chunk, seed=a.seed, context=a.context, chunks=a.chunks,
               provider=a.provider)
    r.update(model=str(a.model), decode_dtype=m.get("prefix_decode", {}).get("dtype", "float32"), provider=a.provider,
             steps=1 + a.chunk * a.chunks, rows=2 * a.candidates, machine=machine(),
             date=time.strftime("%Y-%m-%d %H:%M %Z"))
    print(f"{a.model}: decode graph {r['decode_dtype']} against model.onnx (float32) on {a.provider}, "
          f"{r['steps']} calls x {r['rows']} rows: max |logit diff| {r['max_abs_logit_diff']:.4f}, "
          f"mean KL {r['mean_kl']:.2e} nats, top-1 agreement {r['top1_agreement']:.3f}")
    if a.out:
        Path(a.out).write_text(json.dumps(r, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
