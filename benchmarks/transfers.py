"""What a decode step moves between host and device memory, with the KV cache in NumPy arrays on
the host and with it as ORT tensors on the device (`dbs_fast.kv.device`), for one generation each at
the paper setting. Both run here on the CPU provider (the device path through `DeviceOps("cpu")`),
so the bytes are those a CUDA run would copy across (host arrays bound to a device graph are
copied at binding, outputs into host memory at every run: `PrefixDecoder.host_bytes`); the
seconds are the CPU's, not a GPU's. Both must write the same text.

    python -m benchmarks.transfers --model DIR [--keywords enemy,speed,meet,colony,mouth]
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from dbs_fast.bench.machine import machine

CONTEXT = "It is"


def run(model: str, keywords: list[str], seed: int = 0) -> dict:
    from dbs_fast import DBSConfig, DirectedBeamSearch
    from dbs_fast.kv.decoder import PrefixDecoder
    from dbs_fast.kv.prefix_cache import DECODE_GRAPH

    cfg = DBSConfig.paper()
    out = {"machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M %Z"), "model": str(model),
           "config": {"beams": cfg.beams, "candidates": cfg.candidates, "chunk": cfg.chunk,
                      "max_new_tokens": cfg.max_new_tokens}, "keywords": keywords}
    for where in ("host", "device"):
        # its decoder: the host cache; no context store (host-only), so both paths make the same calls
        dbs = DirectedBeamSearch(model, config=cfg, kv_layout="prefix", context_cache_mb=0)
        if where == "device":
            dbs.decoder = PrefixDecoder(dbs.model_dir / DECODE_GRAPH, "cpu", kv_device="cpu")
        dbs.generate(CONTEXT, keywords, seed=seed)            # warm: sessions, Numba, first allocations
        dbs.decoder.host_bytes_total = dbs.decoder.calls = 0
        t0 = time.perf_counter()
        r = dbs.generate(CONTEXT, keywords, seed=seed)
        sec = time.perf_counter() - t0
        dec = dbs.decoder
        out[where] = {"seconds_on_this_cpu": sec, "graph_calls": dec.calls,
                      "mb_per_call": dec.host_bytes_total / dec.calls / 1e6,
                      "kv_cache_mb": r.kv_cache_bytes / 1e6, "text": r.generated}
    out["same_text"] = out["host"]["text"] == out["device"]["text"]
    # the device path moves ids, positions, masks and logits; the host path those and its cache
    out["cache_mb_per_call_on_host_path"] = out["host"]["mb_per_call"] - out["device"]["mb_per_call"]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default", help="an exported model dir with decode.onnx, or 'default'")
    ap.add_argument("--keywords", default="enemy,speed,meet,colony,mouth")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write the result as JSON here")
    a = ap.parse_args(argv)
    r = run(a.model, a.keywords.split(","), a.seed)
    for where in ("host", "device"):
        x = r[where]
        print(f"KV cache on the {where:6s}: {x['mb_per_call']:8.2f} MB host<->device per graph call "
              f"({x['graph_calls']} calls), {x['seconds_on_this_cpu']:.1f} s on this CPU")
    print(f"of which the cache on the host path: {r['cache_mb_per_call_on_host_path']:.2f} MB per call")
    print("same text:", r["same_text"])
    if a.out:
        Path(a.out).write_text(json.dumps(r, indent=2))
    return 0 if r["same_text"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
