"""Whether a request fits, decided before anything is allocated: the model's context window
(and an unslid attention window), and this machine's free memory."""
from __future__ import annotations

import os
from pathlib import Path

from .config import DBSConfig
from .errors import DBSError
from .manifest import read_manifest, window_unmasked
from .model import load_tokenizer


def available_memory() -> int:
    """Bytes this machine can still give (MemAvailable; total memory where /proc is missing)."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def memory_needed(cfg: DBSConfig, context_tokens: int, manifest: dict) -> int:
    """Bytes a request at `cfg` needs at least: the logits of its rows (held three times over: the
    pending ones, the model's output buffer, the kernel's work) and a KV cache of one row per
    candidate over the whole text (the row layout; the prefix cache holds less)."""
    rows = cfg.beams * cfg.candidates
    per_token = 2 * manifest["num_layers"] * manifest["num_kv_heads"] * manifest["head_dim"] * 4
    return 3 * rows * manifest["vocab_size"] * 4 + rows * (context_tokens + cfg.max_new_tokens) * per_token


def decode_window(manifest: dict, kv_layout: str = "auto") -> int | None:
    """The tokens the decode graph attends to when the model's layers slide a window (Gemma's
    local layers) that the graph does not mask (an export older than the masked window), on the
    layout `kv_layout` picks; None: no limit."""
    unmasked = window_unmasked(manifest) and kv_layout != "rows"
    return manifest["prefix_decode"]["sliding_window"] if unmasked else None


def check_size(cfg: DBSConfig, context_tokens: int, manifest: dict, window: int | None = None) -> None:
    """DBSError, before anything is allocated, for a request longer than the model's context window
    (or than `window`, `decode_window`'s) or larger than this machine's free memory (`manifest`:
    the export's)."""
    if window and context_tokens + cfg.max_new_tokens > window:
        raise DBSError(f"context ({context_tokens} tokens) + --max-new-tokens ({cfg.max_new_tokens}) exceeds the "
                       f"{window} tokens of this model's sliding attention window, which its shared-context "
                       f"decode graph does not slide: use --kv-layout rows for longer texts", "context")
    limit = manifest.get("max_positions")
    if limit and context_tokens + cfg.max_new_tokens > limit:
        field = "max_new_tokens" if cfg.max_new_tokens >= limit else "context"
        raise DBSError(f"context ({context_tokens} tokens) + --max-new-tokens ({cfg.max_new_tokens}) exceeds "
                       f"the model's context window of {limit} tokens", field,
                       cfg.max_new_tokens if field == "max_new_tokens" else None)
    need, free = memory_needed(cfg, context_tokens, manifest), available_memory()
    if need > free:
        field = "beams" if cfg.beams >= cfg.candidates else "candidates"
        raise DBSError(f"beams x candidates = {cfg.beams} x {cfg.candidates} rows of {manifest['vocab_size']} "
                       f"logits and their KV cache over {context_tokens + cfg.max_new_tokens} tokens need about "
                       f"{need / 2**30:.1f} GiB; this machine has {free / 2**30:.1f} GiB free: lower --beams, "
                       f"--candidates or --max-new-tokens", field, getattr(cfg, field))


def preflight(d: Path, cfg: DBSConfig, context: str, kv_layout: str = "auto") -> None:
    """`check_size` from the manifest and tokenizer of the export in `d` alone, before the model
    loads (the CLI's check: a bad size fails in a second, not after loading a model)."""
    n = len(load_tokenizer(str(d / "tokenizer.json")).encode(context or "").ids) if isinstance(context, str) else 0
    manifest = read_manifest(d)
    check_size(cfg, max(n, 1), manifest, decode_window(manifest, kv_layout))
