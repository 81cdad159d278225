"""Hugging Face checkpoint -> ONNX with KV cache (optimum), optimisation, int8, parity.

Needs the `export` extra (torch, transformers, optimum-onnx); the runtime never imports it.
"""
