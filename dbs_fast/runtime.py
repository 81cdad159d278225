"""ONNX Runtime sessions: the engine's session options, the execution provider, and a clear word
when the CUDA provider cannot run (the wrong onnxruntime build, missing CUDA libraries, or graph
nodes that CUDA has no kernels for)."""
from __future__ import annotations

import functools
import json
import os
import warnings
from pathlib import Path

from .errors import DBSError
from .manifest import MANIFEST

PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}
THREADS_ENV = "DBS_FAST_THREADS"


def env_threads() -> int | None:
    """$DBS_FAST_THREADS: the threads of ORT and the kernel where `--threads` is not given (for
    processes that share the cores, as a test suite's workers do); None where it is unset."""
    v = os.environ.get(THREADS_ENV, "").strip()
    if not v:
        return None
    if not v.isdigit() or int(v) < 1:
        raise DBSError(f"the environment's {THREADS_ENV} must be an integer >= 1, got {v!r}")
    return int(v)


def session_options(threads: int | None):
    """The engine's session options; `threads` None: `env_threads()`, else ORT's own (the cores)."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    threads = threads or env_threads()
    if threads:
        so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    # Workers spin inside a run (the decode graph has ~4,000 small nodes: waking a sleeping
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


@functools.cache
def _preload_cuda_libraries(ort) -> None:
    """onnxruntime-gpu >= 1.21 loads the CUDA and cuDNN libraries of the `nvidia-*` pip packages (torch's, or
    `onnxruntime-gpu[cuda,cudnn]`'s) itself, so no LD_LIBRARY_PATH is needed; once per process, best effort
    (where it finds none, the provider's own start reports what is missing)."""
    if not hasattr(ort, "preload_dlls"):
        return
    try:
        ort.preload_dlls()
    except Exception as e:  # noqa: BLE001 - a failed preload leaves the provider's own message to explain
        warnings.warn(f"onnxruntime.preload_dlls() failed: {e}", RuntimeWarning, stacklevel=3)


def make_session(path: Path, provider: str = "cpu", threads: int | None = None, initializers: dict | None = None):
    """`initializers`: {name: OrtValue} the session takes instead of the file's (weights shared with
    other sessions)."""
    import onnxruntime as ort

    if provider not in PROVIDERS:
        raise DBSError(f"`provider` must be one of {sorted(PROVIDERS)}, got {provider!r}")
    wanted = PROVIDERS[provider]
    providers = ["CPUExecutionProvider"]
    if wanted != "CPUExecutionProvider":
        if wanted in ort.get_available_providers():
            providers = [wanted, "CPUExecutionProvider"]
            _preload_cuda_libraries(ort)
        else:
            warnings.warn(f"{wanted} is not available in this onnxruntime build ({ort.__version__}); falling back "
                          f"to CPU. {GPU_INSTALL_HINT if _both_onnxruntimes() else 'For CUDA: ' + GPU_SWAP}",
                          RuntimeWarning, stacklevel=2)
    so = session_options(threads)
    for name, value in (initializers or {}).items():
        so.add_initializer(name, value)
    try:
        session = ort.InferenceSession(str(path), sess_options=so, providers=providers)
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
