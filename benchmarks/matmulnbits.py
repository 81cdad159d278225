"""One weight matmul three ways on this CPU: ONNX Runtime's fp32 MatMul against MatMulNBits on the
same weights in 4 or 8 bits, at accuracy level 0 (fp32 arithmetic, exact) and 4 (int8 activations),
at one row and at the search's 70: median microseconds and the largest error against the fp32
product. It chose which GGUF block types the decode graph keeps (`export/gguf_weights.KEPT`).

    python -m benchmarks.matmulnbits [--k 576 --n 1536 --bits 4 --threads 2] [--out FILE.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

from dbs_fast.bench.machine import machine


def _session(nodes, inits, K: int, threads: int):
    import onnxruntime as ort
    from onnx import TensorProto, helper

    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, K])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)],
                          ir_version=8)
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    return ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])


def run(K: int, N: int, bits: int, threads: int, repeats: int = 50) -> dict:
    from onnx import helper, numpy_helper

    rng = np.random.default_rng(0)
    codes = rng.integers(0, 1 << bits, (N, K // 32, 32)).astype(np.uint8)
    packed = codes if bits == 8 else codes[..., 0::2] | (codes[..., 1::2] << 4)
    scales = (rng.random((N, K // 32)) * 0.01).astype(np.float32)
    w = (scales[..., None] * (codes.astype(np.float32) - (1 << (bits - 1)))).reshape(N, K)
    arms = {"fp32": _session([helper.make_node("MatMul", ["x", "W"], ["y"])],
                             [numpy_helper.from_array(np.ascontiguousarray(w.T), "W")], K, threads)}
    for level in (0, 4):
        arms[f"nbits_level{level}"] = _session(
            [helper.make_node("MatMulNBits", ["x", "B", "S"], ["y"], domain="com.microsoft", K=K, N=N, bits=bits,
                              block_size=32, accuracy_level=level)],
            [numpy_helper.from_array(packed, "B"), numpy_helper.from_array(scales.reshape(-1), "S")], K, threads)
    out = {"machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M %Z"), "K": K, "N": N, "bits": bits,
           "threads": threads, "rows": {}}
    for rows in (1, 70):
        x = rng.standard_normal((rows, K)).astype(np.float32)
        ref = x @ w.T
        res = {}
        for name, sess in arms.items():
            sess.run(None, {"x": x})
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                y = sess.run(None, {"x": x})[0]
                times.append(time.perf_counter() - t0)
            res[name] = {"us_median": 1e6 * statistics.median(times), "max_abs_error": float(np.abs(y - ref).max())}
        out["rows"][rows] = res
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--k", type=int, default=576)
    ap.add_argument("--n", type=int, default=1536)
    ap.add_argument("--bits", type=int, default=4, choices=[4, 8])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None, help="write the result as JSON here")
    a = ap.parse_args(argv)
    r = run(a.k, a.n, a.bits, a.threads)
    for rows, res in r["rows"].items():
        print(f"{a.k} x {a.n}, {a.bits}-bit, {rows} row(s): " + ", ".join(
            f"{k} {v['us_median']:.0f} us (error {v['max_abs_error']:.1e})" for k, v in res.items()))
    if a.out:
        Path(a.out).write_text(json.dumps(r, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
