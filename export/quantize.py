"""Dynamic int8 weight quantisation (ONNX Runtime), for VNNI/AMX CPUs."""
from __future__ import annotations

from pathlib import Path


def quantize_int8(src: Path, dst: Path) -> dict:
    from onnxruntime.quantization import QuantType, quantize_dynamic

    quantize_dynamic(str(src), str(dst), weight_type=QuantType.QInt8, per_channel=False,
                     use_external_data_format=False,
                     extra_options={"MatMulConstBOnly": True})
    return {"method": "onnxruntime.quantize_dynamic", "weight_type": "int8", "ops": ["MatMul", "Gemm"]}
