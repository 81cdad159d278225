"""How far one decode step is over its weight matmuls, both timed under the same machine load.

The bench's x roofline divides a generation's step by the roofline's matmul time, measured once
at the start of the run (the best of 7). On a shared machine the load moves between the two by
up to 30%, so the ratio reads the load as much as the engine. Here the decode
step of an export (`decode.onnx`, random inputs: `export/timing.py`) and the roofline's own
matmul graphs (`bench.matmul_session`: the step's weight shapes at b x s rows, distinct weights)
are timed in alternating rounds in one process: each round, the step's median of 3 runs, then
every shape's median of 3 runs x its count in the step. Matmuls only: the roofline's KV-read
term and the engine's kernel, text and Python work are not in either arm.

    python -m benchmarks.overhead --model DIR [--int8] [--rounds 6 --beams 7 --candidates 10
        --prefix 47] [--out FILE.json]

`--int8`: the roofline's int8 matmuls (ORT's dynamic quantisation), for an int8 export.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from dbs_fast.bench.machine import decode_graph_export, machine
from dbs_fast.bench.suite import linear_shapes, matmul_session
from dbs_fast.export.timing import feeds, median_run
from dbs_fast.kv.prefix_cache import DECODE_GRAPH


def run(model_dir: Path, int8: bool = False, rounds: int = 6, b: int = 7, s: int = 10, T: int = 47,
        threads: int | None = None) -> dict:
    from dbs_fast.runtime import make_session

    step = make_session(model_dir / DECODE_GRAPH, "cpu", threads)
    x = feeds(step, b, s, T)
    shapes = linear_shapes(model_dir)
    mm = [(count, *matmul_session(b * s, k, n, int8, threads)) for k, n, count in shapes]
    step_ms, mm_ms = [], []
    for _ in range(rounds):
        step_ms.append(1e3 * median_run(step, x, 3))
        mm_ms.append(sum(1e3 * count * median_run(sess, fx, 3) / copies for count, sess, fx, copies in mm))
    ratios = [a / m for a, m in zip(step_ms, mm_ms)]
    return {"machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M %Z"), "model": str(model_dir),
            "matmuls": "int8 (dynamic)" if int8 else "fp32", "beams": b, "candidates": s, "prefix": T,
            "shapes_in_out_count": shapes, "step_ms_per_round": step_ms, "matmul_ms_per_round": mm_ms,
            "step_over_matmuls_per_round": ratios, "step_over_matmuls": statistics.median(ratios)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="an export with decode.onnx")
    ap.add_argument("--int8", action="store_true", help="the roofline's int8 matmuls (for an int8 export)")
    for name, default in (("rounds", 6), ("beams", 7), ("candidates", 10), ("prefix", 47), ("threads", None)):
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if a.rounds < 1:
        ap.error("--rounds must be >= 1")
    model = decode_graph_export(ap, a.model)
    r = run(model, a.int8, a.rounds, a.beams, a.candidates, a.prefix, a.threads)
    print(f"{r['machine']}, {r['date']}, {model}: step {statistics.median(r['step_ms_per_round']):.1f} ms, "
          f"its {r['matmuls']} matmuls {statistics.median(r['matmul_ms_per_round']):.1f} ms (medians of "
          f"{a.rounds} alternated rounds); step / matmuls {r['step_over_matmuls']:.2f} (per round "
          f"{', '.join(f'{v:.2f}' for v in r['step_over_matmuls_per_round'])})")
    if a.out:
        Path(a.out).write_text(json.dumps(r, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
