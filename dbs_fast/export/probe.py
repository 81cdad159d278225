"""The row probe (`data/row_probe.onnx`, read by `kv.decoder.lone_row_rounds_apart`): two
MatMulNBits products, 4-bit and 8-bit in blocks of 32 with int8 activations (`accuracy_level` 4),
as a GGUF export's projections run. ONNX Runtime's CPU kernels for one row and for many need not
round alike; where they do not, a request's text would depend on how many rows its step shares.
Written with `onnx` (an export dependency) and shipped, so that the runtime needs no `onnx`:
`python -m dbs_fast.export.probe` rewrites it."""
from __future__ import annotations

from pathlib import Path

import numpy as np

K, N, BLOCK = 64, 32, 32
PROBE = Path(__file__).resolve().parent.parent / "data" / "row_probe.onnx"


def probe_bytes() -> bytes:
    """The probe model, the same bytes on every run (its weights from a fixed seed)."""
    from onnx import TensorProto, helper

    rng = np.random.default_rng(0)
    nodes, inits, outs = [], [], []
    for bits in (4, 8):
        packed = rng.integers(0, 256, size=(N, K // BLOCK, BLOCK * bits // 8), dtype=np.uint8)
        scales = (rng.random(N * K // BLOCK) * 0.01 + 0.001).astype(np.float32)
        inits += [helper.make_tensor(f"B{bits}", TensorProto.UINT8, packed.shape, packed.tobytes(), raw=True),
                  helper.make_tensor(f"S{bits}", TensorProto.FLOAT, scales.shape, scales.tobytes(), raw=True)]
        nodes.append(helper.make_node("MatMulNBits", ["X", f"B{bits}", f"S{bits}"], [f"Y{bits}"], domain="com.microsoft",
                                      K=K, N=N, bits=bits, block_size=BLOCK, accuracy_level=4))
        outs.append(helper.make_tensor_value_info(f"Y{bits}", TensorProto.FLOAT, ["M", N]))
    graph = helper.make_graph(nodes, "row_probe", [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["M", K])],
                              outs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)],
                              producer_name="dbs-fast")
    model.ir_version = 8
    return model.SerializeToString()


if __name__ == "__main__":
    PROBE.write_bytes(probe_bytes())
    print(f"wrote {PROBE}")
