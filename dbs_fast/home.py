"""Where exported models live: $DBS_FAST_HOME, else the user's cache dir."""
import os
from pathlib import Path

from platformdirs import user_cache_dir


def home() -> Path:
    root = os.environ.get("DBS_FAST_HOME") or user_cache_dir("dbs-fast")
    return Path(root).expanduser()


EMBEDDED_DIRS = {"default": "smollm2-135m-instruct", "gemma3-270m": "gemma3-270m"}


def embedded_model_dir(name: str) -> Path:
    return home() / "models" / EMBEDDED_DIRS[name]


def default_model_dir() -> Path:
    return embedded_model_dir("default")
