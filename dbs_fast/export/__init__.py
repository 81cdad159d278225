"""Hugging Face checkpoint -> ONNX with KV cache (optimum), optimisation, int8, parity.

Needs the `export` extra (torch, transformers, optimum-onnx). The runtime imports it only to
export: `dbs-fast export`, and an embedded model's first use (`api.resolve_model_dir`).
"""
