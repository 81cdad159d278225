"""dbs-fast: Directed Beam Search on ONNX Runtime with a Numba logits kernel.

The runtime (this package) needs no torch; `dbs_fast.export` (folder `export/`) and the
PyTorch baseline backend import torch lazily, only when used.
"""
import os as _os

# In a source checkout `export/` and `benchmarks/` sit beside this folder; installed, they
# are mapped to dbs_fast.export / dbs_fast.benchmarks by pyproject's package-dir.
_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isdir(_os.path.join(_root, "export")) and _os.path.isfile(_os.path.join(_root, "pyproject.toml")):
    __path__.append(_root)  # type: ignore[name-defined]

__version__ = "0.1.0"

from .config import DBSConfig  # noqa: E402
from .errors import DBSError  # noqa: E402


def __getattr__(name):
    # Heavy pieces load on first use so `import dbs_fast` stays light.
    if name in ("DirectedBeamSearch", "GenerationResult"):
        from . import api
        return getattr(api, name)
    if name == "OnnxModel":
        from .session import OnnxModel
        return OnnxModel
    raise AttributeError(name)


__all__ = ["DBSConfig", "DBSError", "DirectedBeamSearch", "GenerationResult", "OnnxModel"]
