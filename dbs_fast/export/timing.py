"""One decode step of an export, timed on this host: what `--quantize auto` compares.

The graph timed is the one the engine loads (`decode.onnx`, the prefix cache,
where the export wrote it; else `model.onnx` with one cache row per candidate), at the paper's
setting by default: b = 7 beams x s = 10 candidates, 47 tokens before the chunk (the middle of a
90-token run after a 2-token context, which the engine keeps in the beams' prefixes), 2 tokens into
the chunk. Inputs are random: the cost of a step does not depend on the values. Also used by
`benchmarks/profile.py`.
"""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import numpy as np

from dbs_fast.kv.prefix_cache import DECODE_GRAPH, in_prefixes
from dbs_fast.manifest import MANIFEST
from dbs_fast.runtime import make_session

BEAMS, CANDIDATES, PREFIX, CONTEXT = 7, 10, 47, 2


def feeds(sess, b: int, s: int, T: int, K: int = 5, used: int = 2, C: int = CONTEXT, fold: int | None = None) -> dict:
    """Random inputs for one step of `sess` at b x s rows with T tokens before the chunk: the decode
    graph's (one request's context.L.* of C columns, prefix.L.* of b rows and T - C columns,
    chunk.L.* of b*s rows with the `used` decoded slots of K that the engine binds; a context of
    `fold` (default `FOLD_CONTEXT`) columns or fewer is in the prefixes, as the engine keeps it,
    and the context level one masked column) or the row layout's (past_key_values.L.* of b*s rows
    and length T + used)."""
    rng = np.random.default_rng(0)
    N, out = b * s, {}
    C = min(C, T - 1)
    folded = in_prefixes(C, fold)
    P = T if folded else T - C                          # each beam's own columns
    past = T + used                                     # the row layout's cache length
    U = max(1, used)
    for i in sess.get_inputs():
        n, shape = i.name, i.shape
        if n == "input_ids":
            out[n] = np.ones((N, 1), np.int64)
        elif n == "position_ids":
            out[n] = np.full((N, 1), T + used, np.int64)
        elif n == "attention_mask":
            out[n] = np.ones((N, past + 1), np.int64)
        elif n == "prefix_mask":
            out[n] = np.ones((b, P), np.int64)
        elif n == "context_mask":
            out[n] = np.zeros((1, 1), np.int64) if folded else np.ones((1, C), np.int64)
        elif n == "context_beams":
            out[n] = np.arange(b)[None]
        elif n == "beam_slot":
            out[n] = np.arange(b)
        elif n in ("slot_row", "row_slot"):               # every slot its own row: the plain schedule
            out[n] = np.arange(N)
        elif n == "new_mask":
            out[n] = np.ones((N, 1), np.int64)
        elif n == "chunk_mask":
            out[n] = np.zeros((N, U), np.int64)
            out[n][:, :used] = 1
        elif n.startswith("chunk."):                    # the decoded slots (U, b, kv, s, d)
            out[n] = rng.standard_normal((U, b, shape[2], s, shape[4])).astype(_float(i))
        else:                                           # context.L.* / prefix.L.* / past_key_values.L.*
            rows, length = (1, 1 if folded else C) if n.startswith("context.") else (b, P) if n.startswith("prefix.") \
                else (N, past)
            out[n] = rng.standard_normal((rows, shape[1], length, shape[3])).astype(_float(i))
    return out


def _float(arg) -> type:
    """The NumPy float type of a graph input (an fp16 export's K/V are float16)."""
    return np.float16 if arg.type == "tensor(float16)" else np.float32


def engine_graph(model_dir: Path) -> Path:
    """The graph the engine loads from this export (kv_layout auto)."""
    d = Path(model_dir)
    m = json.loads((d / MANIFEST).read_text())
    return d / DECODE_GRAPH if (d / DECODE_GRAPH).is_file() else d / m["onnx"]


def step_seconds(model_dir: Path, b: int = BEAMS, s: int = CANDIDATES, T: int = PREFIX, repeats: int = 5,
                 threads: int | None = None) -> float:
    """Median seconds of one decode step of the engine's graph at b x s rows (after one warm run),
    with the engine's session options (ORT workers spin inside a run, as in generation)."""
    sess = make_session(engine_graph(model_dir), "cpu", threads)
    return median_run(sess, feeds(sess, b, s, T), repeats)


def median_run(sess, x: dict, repeats: int) -> float:
    """Median seconds of `sess.run` on `x`, after one warm run."""
    return median_seconds(lambda: sess.run(None, x), repeats)


def median_seconds(fn, repeats: int) -> float:
    """Median seconds of `fn()`, after one warm call."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
