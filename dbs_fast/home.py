"""Where exported models live: $DBS_FAST_HOME, else the user's cache dir."""
import json
import os
from pathlib import Path

from platformdirs import user_cache_dir

DEFAULT_MODEL = "default"
MANIFEST = "dbs_fast_model.json"
EXPORT_FORMAT_VERSION = 1
# the decode graph's chunk inputs as its manifest names them (an export with other ones predates v2)
CHUNK_LAYOUT = "slot-major (slots, b, kv_heads, s, head_dim)"
# how the decode graph sums a row's chunk values over the slots (an export without it predates v2)
CHUNK_SUM = "MatMul of ones over the slots"


def home() -> Path:
    root = os.environ.get("DBS_FAST_HOME") or user_cache_dir("dbs-fast")
    return Path(root).expanduser()


EMBEDDED_DIRS = {"default": "smollm2-135m-instruct", "gemma3-270m": "gemma3-270m"}


def embedded_model_dir(name: str) -> Path:
    return home() / "models" / EMBEDDED_DIRS[name]


def default_model_dir() -> Path:
    return embedded_model_dir("default")


def predates_v2(model_dir: Path) -> bool:
    """An export made before engine v2's decode graph as it is now: its manifest has no
    `prefix_decode` (written, or why not), or its decode graph takes one new token per row (made
    before one-call prefill: it still runs, but prefills a context one call per token), or it
    computes its shapes once per layer (made before f2ee9ce: it runs, 11% slower at
    4 rows on the default), or takes its chunks row-major (N, kv, K, d) or beam-major
    (b, kv, s, K, d) (made before the slot-major chunk: it runs, through a copy of every chunk
    each step), or sums its chunk values by ReduceSum over the slots (made before CHUNK_SUM: it
    runs, its attention 8-15% slower on GPT-2 large: README, Speed)."""
    pd = json.loads((Path(model_dir) / MANIFEST).read_text()).get("prefix_decode")
    return pd is None or bool(pd.get("written") and not ({"prefill", "shapes"} <= pd.keys()
                                                         and pd.get("chunk") == CHUNK_LAYOUT
                                                         and pd.get("chunk_sum") == CHUNK_SUM))
