"""The KV-copy kernel of the prefix cache's chunk boundary: each new beam's prefix is its parent's
prefix followed by its own chunk tokens (NumPy reference: `tests/naive.py`, `extend_prefix_ref`)."""
from __future__ import annotations

import numpy as np

from ..numba_runtime import njit, prange, start_threads


def _extend(new, prefix, chunk, src, s, j, lead, first):
    kv, T, d = prefix.shape[1], prefix.shape[2], prefix.shape[3]
    c = T - first
    for q in prange(new.shape[0] * kv):
        beam, h = q // kv, q % kv
        parent, row = src[beam] // s, src[beam] % s
        for t in range(lead):
            for i in range(d):
                new[beam, h, t, i] = 0.0
        for t in range(c):
            for i in range(d):
                new[beam, h, lead + t, i] = prefix[parent, h, first + t, i]
        for t in range(j):
            for i in range(d):
                new[beam, h, lead + c + t, i] = chunk[t, parent, h, row, i]


_extend_prefix = njit(parallel=True, cache=True, nogil=True)(_extend)
# a small copy on one thread: waking the workers costs more than the copy (~15 us a call, 60 calls
# a chunk boundary on the default at b = s = 1)
_extend_prefix_serial = njit(cache=True, nogil=True)(_extend)
PARALLEL_FROM = 1 << 16     # elements of the new prefix


def extend_prefix(new: np.ndarray, prefix: np.ndarray, chunk: np.ndarray, src: np.ndarray, s: int, j: int,
                  lead: int = 0, first: int = 0) -> None:
    """new[i] = `lead` zero columns, prefix[src[i] // s] from its column `first` on, then the first
    j chunk tokens of row src[i] (chunk[:j, src[i] // s, :, src[i] % s]): the chunk boundary, new
    (B, kv, lead + T - first + j, d) from prefix (b, kv, T, d) and the slot-major chunk (K, b, kv,
    s, d), in parallel over (new beam, kv head). `lead` and `first` keep the width a multiple of
    `prefix_cache.ALIGN`. GPT-2 large at the paper setting copies ~130 MB a chunk this way (72
    tensors)."""
    args = (new, prefix, chunk, np.asarray(src, np.int64), s, j, lead, first)
    if new.size < PARALLEL_FROM:
        _extend_prefix_serial(*args)
        return
    start_threads()
    _extend_prefix(*args)


def warm_up() -> None:
    """Both copies (one thread and parallel) compiled into Numba's cache or loaded from there, on
    tiny inputs of the types the prefix cache passes (`numba_runtime.compiled_meanwhile`)."""
    for n in (1, PARALLEL_FROM):
        prefix = np.zeros((1, 1, n, 1), np.float32)
        extend_prefix(np.empty_like(prefix), prefix, np.zeros((1, 1, 1, 1, 1), np.float32), np.zeros(1, np.int64), 1, 0)
