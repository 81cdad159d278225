"""An exported model directory opened as an ONNX Runtime session with a KV cache.

`OnnxModel.forward` runs prefill (T > 1) and decode (T = 1) steps alike; `KVCache.select`
is the one cache operation the scheduler needs: repeat (one beam -> s candidates) and gather
(keep the selected candidates) are both a row gather, done as one copy per tensor.
"""
from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import DBSError
from .home import EXPORT_FORMAT_VERSION, MANIFEST

PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}
# ISA flags that decide kernel speed, as the manifest of a `--quantize auto` export records them
ISA = {"avx2": "AVX2", "avx512f": "AVX-512", "avx512_vnni": "AVX-512 VNNI", "avx_vnni": "AVX-VNNI",
       "amx_int8": "AMX-INT8"}


def cpu_flags() -> set[str]:
    """The ISA flags of this CPU (/proc/cpuinfo; empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        return set()


def cpu_model() -> str:
    """This CPU's model name (/proc/cpuinfo), else what the platform module says."""
    import platform

    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def cpu_signature(flags: set[str] | None = None) -> dict:
    """The CPU a timing was taken on: model name and the ISA flags of `ISA` it has."""
    flags = cpu_flags() if flags is None else flags
    return {"cpu": cpu_model(), "isa": [name for flag, name in ISA.items() if flag in flags]}


@dataclass
class KVCache:
    """Past keys/values of every layer, (B, kv_heads, T, head_dim) each, plus the mask (B, T)."""

    tensors: list[np.ndarray]   # [k0, v0, k1, v1, ...]
    mask: np.ndarray            # (B, T) int64, 0 for left padding

    @property
    def batch(self) -> int:
        return self.mask.shape[0]

    @property
    def length(self) -> int:
        return self.mask.shape[1]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def select(self, rows: np.ndarray, in_place: bool = False) -> "KVCache":
        """Rows `rows` of the cache (repeat and gather in one copy per tensor). `in_place` lets it
        overwrite this cache's arrays (see `take_rows_in_place`): do not use this cache after."""
        rows = np.asarray(rows, dtype=np.int64)
        if not in_place:
            return KVCache([np.take(t, rows, axis=0) for t in self.tensors], self.mask[rows])
        return KVCache([take_rows_in_place(t, rows) for t in self.tensors], self.mask[rows])

    @staticmethod
    def merge(a: "KVCache", b: "KVCache") -> "KVCache":
        """The rows of `a` then those of `b`, the shorter left-padded (mask 0) to the longer."""
        T = max(a.length, b.length)

        def pad(c: KVCache, t: np.ndarray) -> np.ndarray:
            return np.pad(t, ((0, 0), (0, 0), (T - c.length, 0), (0, 0))) if c.length < T else t

        tensors = [np.concatenate([pad(a, x), pad(b, y)]) for x, y in zip(a.tensors, b.tensors)]
        mask = np.concatenate([np.pad(c.mask, ((0, 0), (T - c.length, 0))) for c in (a, b)])
        return KVCache(tensors, mask)

    def trim(self) -> "KVCache":
        """Without the leading columns that are padding in every row (left by rows that left)."""
        z = int(np.argmax(self.mask.any(axis=0))) if self.mask.any() else self.length
        if z == 0:
            return self
        return KVCache([np.ascontiguousarray(t[:, :, z:]) for t in self.tensors], self.mask[:, z:].copy())

    def repeat(self, n: int) -> "KVCache":
        return self.select(np.repeat(np.arange(self.batch), n))


def take_rows_in_place(src: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """`src[rows]` written into `src` itself when the row count is unchanged, else a plain gather.

    Every chunk after the first keeps b rows and repeats each s times, so the new cache has as
    many rows as the old one: it is written into the arrays ONNX Runtime just returned, through
    a copy of only the distinct source rows (b of b*s). No multi-GB allocation per chunk (whose
    page faults cost more than the copy), and the peak holds one cache plus a tenth, not two.
    """
    if len(rows) == src.shape[0] and src.flags.writeable and src.flags.c_contiguous:
        uniq, inv = np.unique(rows, return_inverse=True)
        tmp = src[uniq]                                                 # the distinct rows only
        for j in range(len(rows)):
            src[j] = tmp[inv[j]]
        return src
    return np.take(src, rows, axis=0)


def read_manifest(model_dir: Path) -> dict:
    path = Path(model_dir) / MANIFEST
    if not Path(model_dir).is_dir():
        raise DBSError(f"model directory not found: {model_dir}")
    if not path.is_file():
        raise DBSError(f"{model_dir} is not a dbs-fast export (no {MANIFEST}); run `dbs-fast export` first")
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise DBSError(f"{path} is not valid JSON: {e}") from None
    version = manifest.get("format_version")
    if version != EXPORT_FORMAT_VERSION:
        raise DBSError(f"{model_dir} was written by export format version {version!r}; this dbs-fast reads "
                       f"version {EXPORT_FORMAT_VERSION}: re-export it with `dbs-fast export --force`")
    for rel, size in manifest.get("files", {}).items():
        f = Path(model_dir) / rel
        if not f.is_file():
            raise DBSError(f"{model_dir}: file {rel} listed in the manifest is missing")
        if f.stat().st_size != size:
            raise DBSError(f"{model_dir}: {rel} is {f.stat().st_size} bytes, the manifest says {size} "
                           f"(truncated or replaced); re-export the model")
    return manifest


def session_options(threads: int | None):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    if threads:
        so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    # Workers spin inside a run (engine v2's graph has ~4,000 small nodes: waking a sleeping
    # worker for each cost ~30 ms of a 200 ms GPT-2-large int8 step: benchmarks/spinning.py) and stop when the run ends,
    # because the Numba kernel runs between ORT calls on the same cores (spinning left on after
    # the run slowed the kernel from 12 to 21 ms per step on the default).
    so.add_session_config_entry("session.intra_op.allow_spinning", "1")
    so.add_session_config_entry("session.force_spinning_stop", "1")
    return so


# Operators of our exports that ORT's CUDA provider has no kernel for, so ORT runs them on the CPU and
# copies their inputs and outputs between host and GPU around every one: the dynamic-int8 graph's
# activation quantiser, and its integer matmul on uint8 activations (CUDA's MatMulInteger takes int8 x
# int8 only). From onnxruntime-gpu 1.31.1 (docs/OperatorKernels.md and the CUDA provider library's
# kernel classes, 2026-11-25). fp32 and int8-block (MatMulNBits) graphs have CUDA kernels throughout.
CUDA_FALLBACK_OPS = ("DynamicQuantizeLinear", "MatMulInteger", "DynamicQuantizeMatMul")


def cuda_fallback_ops(path: Path) -> dict[str, int]:
    """{operator: count} of the graph's nodes that would run on the CPU under the CUDA provider.
    Without the `onnx` package (a runtime-only install) it goes by the export's manifest instead."""
    try:
        import onnx
    except ImportError:
        try:
            dtype = json.loads((Path(path).parent / MANIFEST).read_text()).get("dtype")
        except (OSError, ValueError):
            return {}
        return {"dynamic-int8 graph": 1} if dtype == "int8-dynamic" else {}
    found: dict[str, int] = {}
    for node in onnx.load(str(path), load_external_data=False).graph.node:
        if node.op_type in CUDA_FALLBACK_OPS:
            found[node.op_type] = found.get(node.op_type, 0) + 1
    return found


def _warn_cuda_fallback(path: Path) -> None:
    found = cuda_fallback_ops(path)
    if found:
        ops = ", ".join(f"{n} {op}" for op, n in found.items())
        warnings.warn(f"{path}: ORT's CUDA provider has no kernels for this graph's dynamic-int8 nodes ({ops}): "
                      f"they run on the CPU, with a host<->GPU copy around each. For the GPU export fp32 or "
                      f"`--quantize int8-block`", RuntimeWarning, stacklevel=3)


# onnxruntime and onnxruntime-gpu ship the same module: installed together (as `pip install dbs-fast[gpu]`
# does, onnxruntime being a dependency) one's files overwrite the other's, and removing one breaks the other
GPU_SWAP = "pip uninstall -y onnxruntime onnxruntime-gpu && pip install 'onnxruntime-gpu[cuda,cudnn]'"
GPU_INSTALL_HINT = (f"Both onnxruntime and onnxruntime-gpu are installed, and the CPU build's files are the "
                    f"ones imported (they share the module `onnxruntime`): {GPU_SWAP}")


def _both_onnxruntimes() -> bool:
    from importlib import metadata

    try:
        metadata.version("onnxruntime")
        metadata.version("onnxruntime-gpu")
    except metadata.PackageNotFoundError:
        return False
    return True


def make_session(path: Path, provider: str = "cpu", threads: int | None = None):
    import onnxruntime as ort

    if provider not in PROVIDERS:
        raise DBSError(f"`provider` must be one of {sorted(PROVIDERS)}, got {provider!r}")
    wanted = PROVIDERS[provider]
    providers = ["CPUExecutionProvider"]
    if wanted != "CPUExecutionProvider":
        if wanted in ort.get_available_providers():
            providers = [wanted, "CPUExecutionProvider"]
        else:
            warnings.warn(f"{wanted} is not available in this onnxruntime build ({ort.__version__}); falling back "
                          f"to CPU. {GPU_INSTALL_HINT if _both_onnxruntimes() else 'For CUDA: ' + GPU_SWAP}",
                          RuntimeWarning, stacklevel=2)
    try:
        session = ort.InferenceSession(str(path), sess_options=session_options(threads), providers=providers)
    except Exception as e:  # ORT raises its own Fail/InvalidGraph types
        raise DBSError(f"cannot load {path}: {str(e).splitlines()[0][:300]}") from None
    if providers[0] != "CPUExecutionProvider" and session.get_providers()[0] != providers[0]:
        # onnxruntime-gpu without the CUDA / cuDNN libraries it was built for, or no GPU: ORT logs why
        warnings.warn(f"{providers[0]} did not start (ORT's message above names what is missing: onnxruntime-gpu "
                      f"{ort.__version__} needs its CUDA and cuDNN libraries, e.g. `pip install "
                      f"'onnxruntime-gpu[cuda,cudnn]'`, and a GPU); running on the CPU", RuntimeWarning, stacklevel=2)
    elif session.get_providers()[0] == "CUDAExecutionProvider":
        _warn_cuda_fallback(path)
    return session


class OnnxModel:
    """A causal LM with KV cache: tokenizer + ORT session + the manifest that describes them."""

    def __init__(self, model_dir: str | os.PathLike, provider: str = "cpu", threads: int | None = None,
                 lazy: bool = False):
        """`lazy`: open the ONNX Runtime session of model.onnx on first use (engine v2 decodes and
        prefills with decode.onnx alone, so its weights are loaded once)."""
        from tokenizers import Tokenizer

        self.dir = Path(model_dir)
        self.manifest = m = read_manifest(self.dir)
        self.num_layers = m["num_layers"]
        self.kv_heads = m["num_kv_heads"]
        self.head_dim = m["head_dim"]
        self.vocab_size = m["vocab_size"]
        self.eos_ids = tuple(m.get("eos_token_ids", []))
        self.max_positions = m.get("max_positions")
        self._open_args, self._session = (provider, threads), None
        if not lazy:
            self._open()
        self.tokenizer = Tokenizer.from_file(str(self.dir / "tokenizer.json"))

    @property
    def session(self):
        if self._session is None:
            self._open()
        return self._session

    def _open(self) -> None:
        m = self.manifest
        self._session = make_session(self.dir / m["onnx"], *self._open_args)
        self.provider = self._session.get_providers()[0]
        names = [i.name for i in self._session.get_inputs()]
        self.past_names = [n for n in names if n.startswith("past_key_values.")]
        self.present_names = [o.name for o in self._session.get_outputs() if o.name.startswith("present.")]
        self.has_position_ids = "position_ids" in names
        self._outputs = ["logits"] + self.present_names
        self._check_against_manifest()
        chosen_on = m.get("quantize_auto", {}).get("host")
        if chosen_on and self.provider == "CPUExecutionProvider" and chosen_on != cpu_signature():
            warnings.warn(f"{self.dir}: `--quantize auto` chose {m['quantize_auto']['chose']} by timing on "
                          f"{chosen_on['cpu']} ({', '.join(chosen_on['isa']) or 'no AVX2'}), not on this CPU "
                          f"({cpu_model()}): `dbs-fast export --quantize auto` again here to choose for it",
                          RuntimeWarning, stacklevel=3)

    def _check_against_manifest(self):
        if len(self.past_names) != 2 * self.num_layers:
            raise DBSError(f"{self.dir}: the manifest says {self.num_layers} layers but model.onnx has "
                           f"{len(self.past_names) // 2}: manifest and model do not match")
        shape = self.session.get_inputs()[[i.name for i in self.session.get_inputs()].index(self.past_names[0])].shape
        if isinstance(shape[1], int) and (shape[1] != self.kv_heads or shape[3] != self.head_dim):
            raise DBSError(f"{self.dir}: the manifest says {self.kv_heads} kv heads x {self.head_dim} but "
                           f"model.onnx has {shape[1]} x {shape[3]}: manifest and model do not match")
        vocab = self.session.get_outputs()[0].shape[-1]
        if isinstance(vocab, int) and vocab != self.vocab_size:
            raise DBSError(f"{self.dir}: the manifest says vocab {self.vocab_size}, model.onnx has {vocab}")

    def empty_cache(self, batch: int) -> KVCache:
        z = np.zeros((batch, self.kv_heads, 0, self.head_dim), np.float32)  # (B, kvh, 0, hd)
        return KVCache([z] * (2 * self.num_layers), np.zeros((batch, 0), np.int64))

    def forward(self, input_ids: np.ndarray, cache: KVCache, mask: np.ndarray | None = None):
        """Run T new tokens per row; returns logits (B, T, V) float32 and the grown cache."""
        session = self.session                                         # opened here if lazy
        B, T = input_ids.shape
        new_mask = np.ones((B, T), np.int64) if mask is None else mask.astype(np.int64)
        full = np.concatenate([cache.mask, new_mask], axis=1)          # (B, past + T)
        feed = {"input_ids": input_ids.astype(np.int64), "attention_mask": full}
        if self.has_position_ids:
            pos = np.cumsum(full, axis=1)[:, -T:] - 1                  # left padding aware
            feed["position_ids"] = np.maximum(pos, 0)
        feed.update(zip(self.past_names, cache.tensors))
        out = session.run(self._outputs, feed)
        return out[0], KVCache(out[1:], full)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text).ids

    def decode(self, ids) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)
