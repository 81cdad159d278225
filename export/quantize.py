"""int8 weights, two ways (ONNX Runtime's quantisation tools).

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
"""
from __future__ import annotations

from pathlib import Path

METHODS = ("int8", "int8-block")
AUTO = "auto"   # every quantisation that passes parity, timed on this host: the fastest is kept (`choose`)
# a quantised export must beat fp32 by this much to be chosen: fp32 is the more accurate, and step
# times of one run on a shared 2-core machine move by a few per cent
MARGIN = 0.05


def plan(method: str | None) -> list[str | None]:
    """The exports to make (None = fp32). `auto`: all of them; parity refuses some (dynamic int8 on
    the default model's activation outliers), a timed decode step on this host ranks the rest.
    Which one wins depends on the CPU, not only on its ISA flags: ORT's int8 GEMM ran at 3.5x fp32
    on a Xeon with VNNI/AMX (590 vs 170 GFLOP/s), 1.9x on an AMD EPYC (Zen 3) with AVX2 only
    (255 vs 133, `dbs-fast bench`'s roofline), and 1.07x on another AVX2-only EPYC (77 vs 72,
    issue 11)."""
    return [None, *METHODS] if method == AUTO else [method]


def choose(step_seconds: dict[str | None, float], margin: float = MARGIN) -> str | None:
    """The fastest of the timed exports; fp32 (None) unless a quantised one is faster by `margin`."""
    best = min(step_seconds, key=step_seconds.get)
    if None in step_seconds and step_seconds[best] > (1 - margin) * step_seconds[None]:
        return None
    return best


def quantize_int8(src: Path, dst: Path) -> dict:
    from onnx import TensorProto
    from onnxruntime.quantization import QuantType, quantize_dynamic

    quantize_dynamic(str(src), str(dst), weight_type=QuantType.QInt8, per_channel=False,
                     use_external_data_format=False,
                     # shape inference stops at contrib ops (MultiHeadAttention): tensors after
                     # them have no inferred type, and every activation here is float32
                     extra_options={"MatMulConstBOnly": True, "DefaultTensorType": TensorProto.FLOAT})
    return {"method": "onnxruntime.quantize_dynamic", "weight_type": "int8", "ops": ["MatMul", "Gemm"]}


def quantize_int8_block(src: Path, dst: Path, block_size: int = 32) -> dict:
    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    q = MatMulNBitsQuantizer(onnx.load(str(src)), bits=8, block_size=block_size, is_symmetric=True,
                             accuracy_level=4, op_types_to_quantize=("MatMul",))
    q.process()
    n = sum(1 for node in q.model.model.graph.node if node.op_type == "MatMulNBits")
    large = sum(t.ByteSize() for t in q.model.model.graph.initializer) > 1.8e9
    q.model.save_model_to_file(str(dst), use_external_data_format=large)
    return {"method": "onnxruntime MatMulNBits (weight-only)", "weight_type": "int8", "block_size": block_size,
            "accuracy_level": 4, "ops": ["MatMul"], "quantized_nodes": n}


def quantize(src: Path, dst: Path, method: str) -> dict:
    return quantize_int8(src, dst) if method == "int8" else quantize_int8_block(src, dst)

