"""Where exported models live ($DBS_FAST_HOME, else the user's cache dir), and the directory a
model name resolves to. An embedded model is exported on its first use: the one place the runtime
asks the exporter (`dbs_fast.export`) for anything."""
import os
from pathlib import Path

from platformdirs import user_cache_dir

from .errors import DBSError
from .manifest import current_export, read_manifest, window_unmasked


def home() -> Path:
    root = os.environ.get("DBS_FAST_HOME") or user_cache_dir("dbs-fast")
    return Path(root).expanduser()


EMBEDDED_DIRS = {"default": "smollm2-135m-instruct", "gemma3-270m": "gemma3-270m"}


def embedded_model_dir(name: str) -> Path:
    return home() / "models" / EMBEDDED_DIRS[name]


def default_model_dir() -> Path:
    return embedded_model_dir("default")


def resolve_model_dir(model: str | Path, quiet: bool = True) -> Path:
    if str(model) in EMBEDDED_DIRS:
        d = embedded_model_dir(str(model))
        current = current_export(d)
        manifest = read_manifest(d) if current else {}
        if current and (manifest.get("prefix_decode") or {}).get("written", True) and not window_unmasked(manifest):
            return d
        try:
            from .export.convert import ensure_embedded
        except ImportError as e:
            if current:          # without its decode graph, on the row layout
                return d
            raise DBSError(f"the embedded model {model!r} is exported on first use, which needs the export "
                           f"extra: pip install 'dbs-fast[export]' (missing: {e.name})") from None
        return ensure_embedded(str(model), quiet=quiet)
    p = Path(model).expanduser()
    if not p.is_dir():
        raise DBSError(f"model directory not found: {model} (export one with `dbs-fast export`)")
    return p
