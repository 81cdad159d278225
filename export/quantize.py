"""Dynamic int8 weight quantisation (ONNX Runtime), for VNNI/AMX CPUs."""
from __future__ import annotations

from pathlib import Path


def quantize_int8(src: Path, dst: Path) -> dict:
    from onnx import TensorProto
    from onnxruntime.quantization import QuantType, quantize_dynamic

    quantize_dynamic(str(src), str(dst), weight_type=QuantType.QInt8, per_channel=False,
                     use_external_data_format=False,
                     # shape inference stops at contrib ops (MultiHeadAttention): tensors after
                     # them have no inferred type, and every activation here is float32
                     extra_options={"MatMulConstBOnly": True, "DefaultTensorType": TensorProto.FLOAT})
    return {"method": "onnxruntime.quantize_dynamic", "weight_type": "int8", "ops": ["MatMul", "Gemm"]}
