"""An export's manifest (`dbs_fast_model.json` in the model dir): what it holds, checked on load."""
from __future__ import annotations

import json
from pathlib import Path

from .errors import DBSError

MANIFEST = "dbs_fast_model.json"
# bumped whenever an export's files change in a way this version cannot read: an export with
# another version is refused with "re-export it with `dbs-fast export --force`" (embedded models
# are exported again on their own)
EXPORT_FORMAT_VERSION = 4
# bumped whenever the decode graph an export writes changes but an older one still runs (the same
# inputs and outputs: a leaner step): an embedded model's export of an older graph is written
# again, once, instead of running the slower step without a word
DECODE_GRAPH_REVISION = 7


def current_export(model_dir: Path) -> bool:
    """Whether `model_dir` holds an export this version reads (its manifest's format version)."""
    f = Path(model_dir) / MANIFEST
    return f.is_file() and json.loads(f.read_text()).get("format_version") == EXPORT_FORMAT_VERSION


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


def window_unmasked(manifest: dict) -> bool:
    """Whether the export's decode graph leaves its layers' sliding window unmasked (written
    before the graph slid it): a request longer than the window is refused there."""
    graph = manifest.get("prefix_decode") or {}
    return bool(graph.get("written") and graph.get("sliding_window") and not graph.get("window_masked"))


def stale_embedded(manifest: dict, row_layout: bool = False) -> str | None:
    """Why an embedded model's export is to be written again by this version (None: it is not):
    a decode graph that does not slide its local layers' window, one of an older revision
    (`DECODE_GRAPH_REVISION`), one written before the graph kept
    the GGUF file's blocks at an accuracy level, or no row layout (model.onnx) where one is needed."""
    graph = manifest.get("prefix_decode") or {}
    if window_unmasked(manifest):
        return "its decode graph does not slide its local layers' window"
    if graph.get("written") and graph.get("revision", 0) < DECODE_GRAPH_REVISION:
        return f"its decode graph predates this version's (revision {DECODE_GRAPH_REVISION}: a leaner step)"
    if manifest.get("gguf_file") and graph.get("written") and manifest.get("dtype") == "float32" and \
            "accuracy_level" not in (graph.get("weights") or {}):
        return "its decode graph predates the GGUF file's own blocks at an accuracy level"
    if row_layout and not manifest.get("onnx"):
        return "it has no row layout (model.onnx), which is needed here"
    return None
