"""Quantised weights, three ways (ONNX Runtime's quantisation tools).

`int8`: dynamic quantisation (`quantize_dynamic`): int8 weights per tensor, activations
quantised to uint8 per tensor at run time, integer GEMM (DynamicQuantizeMatMul). The fastest
(measured 590 vs 170 GFLOP/s fp32 on a Xeon with VNNI/AMX at 70 x 1280 x 5120; 255 vs 133 in
the bench's roofline on an AVX2-only AMD EPYC), and accurate on GPT-2
(mean KL 6e-4 nats), but per-tensor activation scales break models with activation outliers:
SmolLM2-135M (the embedded default) gets mean KL 1.2 nats and fails parity.

`int8-block`: weight-only 8-bit, symmetric, blocks of 32 along K (`MatMulNBits`,
accuracy_level 4: activations quantised per block at run time). Mean KL 0.018 on the default;
slower (230 GFLOP/s at the same shape on the Xeon). MatMul nodes only: Gemm-based graphs (GPT-2) keep
their Gemm layers in fp32.

`int4-block`: the same in 4 bits (round to nearest, a zero point per block of 32): half the bytes
of int8-block, for checkpoints that come with no quantisation of their own (a GGUF file's own
blocks are kept as they are: `export/gguf_weights.py`). Parity refuses it on the default (mean KL
0.82 nats), whose fp32 weights are its file's Q4_1 grid: a second 4-bit grid over them does not
land on the first.
"""
from __future__ import annotations

from pathlib import Path

METHODS = ("int8", "int8-block", "int4-block")
BITS = {"int8-block": 8, "int4-block": 4}
TIMED = ("int8", "int8-block")      # what `auto` times against fp32
AUTO = "auto"   # every quantisation that passes parity, timed on this host: the fastest is kept (`choose`)
# a quantised export must beat fp32 by this much to be chosen: fp32 is the more accurate, and step
# times of one run on a shared 2-core machine move by a few per cent
MARGIN = 0.05


def plan(method: str | None) -> list[str | None]:
    """The exports to make (None = fp32). `auto`: all of them; parity refuses some (dynamic int8 on
    the default model's activation outliers), a timed decode step on this host ranks the rest.
    Which one wins depends on the CPU, not only on its ISA flags: ORT's int8 GEMM ran at 3.5x fp32
    on a Xeon with VNNI/AMX (590 vs 170 GFLOP/s), 1.9x on an AMD EPYC (Zen 3) with AVX2 only
    (255 vs 133, `dbs-fast bench`'s roofline), and 1.07x on another AVX2-only EPYC (77 vs 72)."""
    return [None, *TIMED] if method == AUTO else [method]


def choose(step_seconds: dict[str | None, float], margin: float = MARGIN) -> str | None:
    """The fastest of the timed exports; fp32 (None) unless a quantised one is faster by `margin`."""
    best = min(step_seconds, key=step_seconds.get)
    if None in step_seconds and step_seconds[best] > (1 - margin) * step_seconds[None]:
        return None
    return best


def untie_shared_gemm(src: Path, dst: Path) -> bool:
    """Write `src` to `dst` with every Gemm(transB=1) whose weight another node also reads (the prefix cache's
    tied head, `prefix_graph.share_tied_head`: the embedding Gather and the head share one tensor) as a
    MatMul on a transposed copy of its own. False (nothing written) when there is none. What for:
    onnxruntime's `quantize_dynamic` before 1.32 (1.31.1 seen, 2026-11-25) transposes such a shared weight
    in place for the Gemm, so the Gather then reads it transposed and the graph fails to load; 1.32 keeps a
    transposed copy of its own, as this does. The quantised graph is the same size either way (the
    Gather's int8 table and the head's), and the fp32 copy here is only the quantiser's input."""
    from collections import Counter

    import onnx
    from onnx import helper, numpy_helper

    from .prefix_graph import save

    g = onnx.load(str(src))
    inits = {i.name: i for i in g.graph.initializer}
    readers = Counter(name for node in g.graph.node for name in node.input)
    changed = False
    for k, node in enumerate(g.graph.node):
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if (node.op_type != "Gemm" or len(node.input) != 2 or attrs.get("transB") != 1 or attrs.get("transA", 0)
                or attrs.get("alpha", 1.0) != 1.0 or node.input[1] not in inits or readers[node.input[1]] < 2):
            continue
        w = numpy_helper.to_array(inits[node.input[1]])
        copy = numpy_helper.from_array(w.T.copy(), node.input[1] + "_transposed_for_head")
        g.graph.initializer.append(copy)
        g.graph.node[k].CopyFrom(helper.make_node("MatMul", [node.input[0], copy.name], list(node.output),
                                                  name=node.name or "tied_head"))
        changed = True
    if changed:
        save(g, dst)
    return changed


def _quantizer_transposes_shared_weights() -> bool:
    import onnxruntime
    from packaging.version import Version

    return Version(onnxruntime.__version__).release < (1, 32)


def quantize_int8(src: Path, dst: Path) -> dict:
    import tempfile

    from onnx import TensorProto
    from onnxruntime.quantization import QuantType, quantize_dynamic

    with tempfile.TemporaryDirectory(dir=dst.parent, prefix=".untied-") as tmp:
        untied = Path(tmp) / src.name
        if _quantizer_transposes_shared_weights() and untie_shared_gemm(src, untied):
            src = untied
        quantize_dynamic(str(src), str(dst), weight_type=QuantType.QInt8, per_channel=False,
                         use_external_data_format=False,
                         # shape inference stops at contrib ops (MultiHeadAttention): tensors after
                         # them have no inferred type, and every activation here is float32
                         extra_options={"MatMulConstBOnly": True, "DefaultTensorType": TensorProto.FLOAT})
    return {"method": "onnxruntime.quantize_dynamic", "weight_type": "int8", "ops": ["MatMul", "Gemm"]}


def quantize_block(src: Path, dst: Path, bits: int = 8, block_size: int = 32) -> dict:
    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    from .prefix_graph import LARGE

    # 4 bits with a zero point per block (the asymmetric grid: mean KL 0.82 nats on the default
    # against the symmetric one's 1.57; ORT's k-quant search, 0.86)
    q = MatMulNBitsQuantizer(onnx.load(str(src)), bits=bits, block_size=block_size, is_symmetric=bits == 8,
                             accuracy_level=4, op_types_to_quantize=("MatMul",))
    q.process()
    n = sum(1 for node in q.model.model.graph.node if node.op_type == "MatMulNBits")
    large = sum(t.ByteSize() for t in q.model.model.graph.initializer) > LARGE
    q.model.save_model_to_file(str(dst), use_external_data_format=large)
    return {"method": "onnxruntime MatMulNBits (weight-only)", "weight_type": f"int{bits}", "block_size": block_size,
            "accuracy_level": 4, "ops": ["MatMul"], "quantized_nodes": n}


def quantize(src: Path, dst: Path, method: str) -> dict:
    return quantize_int8(src, dst) if method == "int8" else quantize_block(src, dst, BITS[method])

