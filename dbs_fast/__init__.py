"""dbs-fast: Directed Beam Search on ONNX Runtime with a Numba logits kernel.

The runtime (this package) needs no torch; `dbs_fast.export`, `dbs_fast.bench` and the
PyTorch baseline backend import torch lazily, only when used.
"""
__version__ = "0.1.0"

from .config import DBSConfig  # noqa: E402
from .errors import DBSError  # noqa: E402


def __getattr__(name):
    # Heavy pieces load on first use so `import dbs_fast` stays light.
    if name in ("DirectedBeamSearch", "GenerationResult"):
        from . import api
        return getattr(api, name)
    if name == "OnnxModel":
        from .model import OnnxModel
        return OnnxModel
    raise AttributeError(name)


__all__ = ["DBSConfig", "DBSError", "DirectedBeamSearch", "GenerationResult", "OnnxModel"]
