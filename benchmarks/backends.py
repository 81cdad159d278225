"""Seconds per generation of the ONNX engine and the PyTorch baseline on identical work
(same model, seeds, keywords, hyper-parameters), measured in one run.

    python -m dbs_fast.benchmarks.backends --model default --repeats 1 --out bench_out/backends.json

The full benchmark suite (GPT-2 large shapes, int8, reference-style loop, roofline) is the
speed issue's; this is the quick side-by-side the engine issue asks for.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from dbs_fast.benchmarks.host import machine

KEYWORDS = ["enemy", "speed", "meet", "colony", "mouth"]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=90)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default="bench_out/backends.json")
    a = ap.parse_args(argv)
    from dbs_fast import DBSConfig, DirectedBeamSearch

    cfg = DBSConfig.paper(max_new_tokens=a.max_new_tokens)
    report = {"machine": machine(),
              "date": time.strftime("%Y-%m-%d %H:%M"), "config": cfg.to_dict(), "keywords": KEYWORDS}
    texts = {}
    for backend in ("onnx", "torch"):
        t0 = time.perf_counter()
        dbs = DirectedBeamSearch(a.model, config=cfg, backend=backend, threads=a.threads)
        dbs.generate("It is", KEYWORDS, seed=0, config=DBSConfig.paper(max_new_tokens=cfg.chunk))  # warm-up
        load = time.perf_counter() - t0
        runs = [dbs.generate("It is", KEYWORDS, seed=s) for s in range(a.repeats)]
        secs = [r.seconds for r in runs]
        texts[backend] = runs[0].text
        report[backend] = {"seconds_median": statistics.median(secs), "seconds_min": min(secs),
                           "seconds_max": max(secs), "load_and_warmup_seconds": load,
                           "candidate_tokens_per_second": statistics.median(r.candidate_tokens_per_second for r in runs),
                           "success_rate": runs[0].success_rate, "stage_seconds": runs[0].timings}
        print(f"{backend:6s} {report[backend]['seconds_median']:8.2f} s/generation "
              f"({report[backend]['candidate_tokens_per_second']:.0f} candidate tokens/s)", flush=True)
        del dbs
    report["speedup_onnx_vs_torch"] = report["torch"]["seconds_median"] / report["onnx"]["seconds_median"]
    report["same_text"] = texts["onnx"] == texts["torch"]
    print(f"onnx is {report['speedup_onnx_vs_torch']:.2f}x faster than torch; same text: {report['same_text']}")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
