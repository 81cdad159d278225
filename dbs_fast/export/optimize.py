"""ONNX Runtime transformer graph optimisation, where the architecture supports it."""
from __future__ import annotations

from pathlib import Path

# onnxruntime.transformers.optimizer knows these decoder families (model_type names).
ORT_MODEL_TYPES = {"gpt2": "gpt2", "gpt_neo": "gpt_neox", "gpt_neox": "gpt_neox", "phi": "phi"}


def optimize(src: Path, dst: Path, config, large: bool) -> dict:
    """Write the optimised graph to `dst`; returns a report {applied, model_type, fusions, reason}.

    When the architecture is not known to ORT's fusion passes, or no fusion applied, the
    original graph is kept (ORT still applies its generic level-3 optimisations at load).
    """
    from onnxruntime.transformers.optimizer import optimize_model

    mt = ORT_MODEL_TYPES.get(config.model_type)
    if mt is None:
        return {"applied": False, "model_type": config.model_type, "fusions": {},
                "reason": f"onnxruntime has no transformer fusions for {config.model_type!r}; kept the "
                          f"exported graph (ORT's generic graph optimisations still run at load)"}
    heads = getattr(config, "num_attention_heads", 0)
    hidden = getattr(config, "hidden_size", 0)
    opt = optimize_model(str(src), model_type=mt, num_heads=heads, hidden_size=hidden, opt_level=1,
                         use_gpu=False, only_onnxruntime=False)
    fusions = {k: int(v) for k, v in opt.get_fused_operator_statistics().items() if v}
    if not fusions:
        return {"applied": False, "model_type": mt, "fusions": {},
                "reason": "no fusion pattern matched; kept the exported graph"}
    opt.save_model_to_file(str(dst), use_external_data_format=large)
    return {"applied": True, "model_type": mt, "fusions": fusions, "reason": "fused"}
