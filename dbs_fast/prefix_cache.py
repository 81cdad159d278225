"""The prefix KV cache: each beam's prefix stored once, each candidate's chunk in its own buffer.

`PrefixCache` holds b prefixes (b, kv_heads, T, head_dim) per layer and the N = b * s rows'
preallocated chunks, slot-major (k, b, kv_heads, s, head_dim); row r is candidate r % s of beam
r // s. A decode step (`PrefixDecoder.step`, the graph of `export/prefix_graph.py`) reads the
prefixes and the chunk's decoded slots in place (the first slots of the buffer: a contiguous
view) and writes the new token's K/V straight into the chunk's next slot (its output is bound
there), so a step copies nothing on the host. At the chunk boundary
`keep(rows)` builds the next prefixes from the kept candidates: their parent beam's prefix plus
their own chunk (a gather of b prefixes and b chunks of <= k tokens), and empties the chunks.
The s candidates of a kept beam are then the s rows that follow it, with no copy at all.

The tensors are NumPy arrays on the host (`HostOps`), or, with the CUDA provider, ORT tensors on
the device (`dbs_fast.device`): the cache's few tensor operations go through `PrefixCache.ops`,
so the scheduler and the step are one code path on both, and a step moves only ids, positions,
masks and the logits between host and device (`PrefixDecoder.host_bytes` counts them).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .errors import DBSError
from .kv_copy import extend_prefix

DECODE_GRAPH = "decode.onnx"      # beside model.onnx in an exported model dir
# auto: this layout where the export has its decode graph, else rows (one cache row per candidate:
# an export without a decode graph, the PyTorch baseline)
KV_LAYOUTS = ("auto", "rows", "prefix")


class HostOps:
    """The cache's tensor operations on NumPy arrays (`dbs_fast.device.DeviceOps` has the same on a
    device; the prefix extension on the host is `PrefixCache._extend`, into reused buffers)."""

    device = None

    @staticmethod
    def zeros(shape) -> np.ndarray:
        return np.zeros(shape, np.float32)

    @staticmethod
    def take(x: np.ndarray, idx) -> np.ndarray:
        return x[idx]

    @staticmethod
    def concat(a: np.ndarray, b: np.ndarray, axis: int) -> np.ndarray:
        return np.concatenate([a, b], axis=axis)

    @staticmethod
    def pad_cols(x: np.ndarray, n: int) -> np.ndarray:
        return np.pad(x, [(0, 0), (0, 0), (n, 0), (0, 0)]) if n else x

    @staticmethod
    def cols(x: np.ndarray, z: int) -> np.ndarray:
        return np.ascontiguousarray(x[:, :, z:])

    @staticmethod
    def lead(x: np.ndarray, n: int) -> np.ndarray:
        return x[:n]

    @staticmethod
    def at(x: np.ndarray, i: int, shape) -> np.ndarray:
        return x[i].reshape(shape)


HOST = HostOps()


@dataclass
class PrefixCache:
    prefix: list[np.ndarray]   # [k0, v0, k1, v1, ...], (b, kv, T, d) each
    mask: np.ndarray           # (b, T) int64, 0 = left padding
    chunk: list[np.ndarray]    # [k0, v0, ...], (K, b, kv, s, d) each: row r = candidate r % s of beam r // s
    chunk_mask: np.ndarray     # (N, K) int64, 1 = decoded in this chunk
    s: int
    used: int = 0              # tokens decoded in this chunk
    capacity: int = 0          # prefix columns expected at most (context + max_new_tokens): the buffers' size
    ops: object = HOST         # where the tensors live: HOST (NumPy) or a dbs_fast.device.DeviceOps
    # flat buffers the cache allocated itself: `_own` backs `prefix`, `_spare` is free. The chunk
    # boundary writes the next prefixes into the spare ones and swaps (ping-pong): one copy, no
    # allocation, so no page faults, at most boundaries.
    _own: list | None = field(default=None, repr=False)
    _spare: list | None = field(default=None, repr=False)

    @classmethod
    def start(cls, past: list, mask: np.ndarray, s: int, k: int, reserve: int = 0, ops=HOST) -> "PrefixCache":
        """From a prefill's present K/V (one row per beam) with s candidates per beam, room for k
        tokens per chunk and `reserve` more prefix columns (max_new_tokens) in its buffers."""
        b, T = mask.shape
        chunk = [ops.zeros((k, b, t.shape[1], s, t.shape[3])) for t in past]
        past = [np.ascontiguousarray(t) for t in past] if ops is HOST else past
        return cls(past, np.asarray(mask, np.int64), chunk, np.zeros((b * s, k), np.int64), s,
                   capacity=T + reserve, ops=ops)

    @property
    def beams(self) -> int:
        return self.mask.shape[0]

    @property
    def nbytes(self) -> int:
        """Bytes held: the prefix buffers (with their headroom and the spare ones) and the chunks."""
        held = (self._own or self.prefix) + (self._spare or [])
        return sum(t.nbytes for t in held) + sum(t.nbytes for t in self.chunk)

    def positions(self) -> np.ndarray:
        """(N, 1) position of each row's next token: its prefix's real tokens + the chunk so far."""
        return np.repeat(self.mask.sum(1), self.s)[:, None] + self.used

    def slots(self) -> tuple[list[np.ndarray], np.ndarray]:
        """The chunk as a decode step reads it: each tensor's first U = max(1, used) slots (a
        contiguous view) and their mask (N, U). With none decoded, slot 0 is bound masked while the
        step writes its new K/V there: whichever values the graph reads, finite, get weight 0."""
        U = max(1, self.used)
        return [self.ops.lead(c, U) for c in self.chunk], np.ascontiguousarray(self.chunk_mask[:, :U])

    def next_slot(self) -> list[np.ndarray]:
        """Where a decode step's new K/V go: the chunk's slot `used`, (b, kv, s, 1, d) per tensor (a
        view a decode graph writes in place; `advance` then counts it)."""
        self._room(1)
        return [self.ops.at(c, self.used, c.shape[1:4] + (1,) + c.shape[4:]) for c in self.chunk]

    def advance(self, L: int = 1) -> None:
        """Count L new tokens written at slots `used`.. of the chunk."""
        self._room(L)
        self.chunk_mask[:, self.used:self.used + L] = 1
        self.used += L

    def _room(self, L: int) -> None:
        """Raise unless L more tokens fit in the chunk."""
        if self.used + L > self.chunk_mask.shape[1]:
            raise DBSError(f"the chunk buffer holds {self.chunk_mask.shape[1]} tokens, {self.used} used; "
                           f"call keep() first")

    def keep(self, rows) -> None:
        """The next beams are the candidates `rows` (indices into N): each one's parent prefix +
        its chunk, with s candidate rows each (row r of beam i is row i * s + r)."""
        self.regroup(np.repeat(np.asarray(rows, np.int64), self.s))

    def regroup(self, rows) -> np.ndarray:
        """The rows `rows` (indices into N, repeats allowed) as the next layout; returns where each
        one is now. Rows with the same sequence share a beam: after decoded chunk tokens, the
        copies of one row; before any, the rows of one beam. A beam is its parent prefix plus
        that chunk (a gather of a few tokens per beam), with up to s rows; more copies than s
        take several beams. Slots a beam does not fill are idle rows (their logits unused)."""
        rows = np.asarray(rows, dtype=np.int64)
        j, s = self.used, self.s
        key = rows if j else rows // s
        uniq, first, inv = np.unique(key, return_index=True, return_inverse=True)
        rank = np.empty(len(uniq), np.int64)
        rank[np.argsort(first)] = np.arange(len(uniq))        # beams in order of first appearance
        g = rank[inv]
        order = np.argsort(g, kind="stable")
        counts = np.bincount(g, minlength=len(uniq))
        slot = np.empty(len(rows), np.int64)
        slot[order] = np.arange(len(rows)) - np.repeat(np.cumsum(counts) - counts, counts)
        per = -(-counts // s)                                   # beams per key (copies beyond s split)
        beam = (np.cumsum(per) - per)[g] + slot // s
        src = np.empty(int(per.sum()), np.int64)
        src[beam] = key                                         # the key each new beam copies
        if j:
            self._extend(src, j)
            self.mask = np.concatenate([self.mask[src // s], np.ones((len(src), j), np.int64)], axis=1)
        else:
            self._release([self.ops.take(p, src) for p in self.prefix])
            self.mask = self.mask[src]
        n = len(src) * s
        if n != self.chunk_mask.shape[0]:
            self.chunk = [self.ops.zeros((c.shape[0], len(src)) + tuple(c.shape[2:])) for c in self.chunk]
            self.chunk_mask = np.zeros((n, self.chunk_mask.shape[1]), np.int64)
        else:
            self.chunk_mask[:] = 0            # stale chunk K/V stays: masked, overwritten column by column
        self.used = 0
        return beam * s + slot % s

    def _extend(self, src: np.ndarray, j: int) -> None:
        """Prefix of new beam i := prefix of beam src[i] // s + the first j chunk tokens of row src[i],
        written into the spare buffers. Those are allocated when too small, for `capacity` columns
        or 4 more chunks: a fresh allocation costs page faults, up to 5x the copy itself."""
        if self.ops is not HOST:                       # on the device: one ORT graph for all tensors
            self.prefix = self.ops.extend(self.prefix, self.chunk, src, self.s, j)
            return
        T, k = self.mask.shape[1], self.chunk_mask.shape[1]
        spare, own = self._spare or [None] * len(self.prefix), []
        for i, (p, c) in enumerate(zip(self.prefix, self.chunk)):
            shape = (len(src), p.shape[1], T + j, p.shape[3])
            n = int(np.prod(shape))
            buf = spare[i]
            if buf is None or buf.size < n:
                cols = self.capacity if self.capacity >= T + j else T + j + 4 * k
                buf = np.empty(len(src) * p.shape[1] * cols * p.shape[3], p.dtype)
            new = buf[:n].reshape(shape)
            extend_prefix(new, p, c, src, self.s, j)
            self.prefix[i] = new
            own.append(buf)
        self._spare, self._own = self._own, own

    def _release(self, prefix: list[np.ndarray]) -> None:
        """`prefix` (new arrays) replaces the pooled one, whose buffers become spare."""
        self.prefix = prefix
        self._spare, self._own = self._spare or self._own, None

    @staticmethod
    def merge(a: "PrefixCache", b: "PrefixCache") -> "PrefixCache":
        """The beams of `a` then those of `b` (between chunks), the shorter prefix left-padded."""
        if a.used or b.used or a.s != b.s or a.chunk_mask.shape[1] != b.chunk_mask.shape[1]:
            raise DBSError("prefix caches merge only between chunks, with the same s and chunk size")
        if a.ops is not b.ops:
            raise DBSError("prefix caches merge only on the same device")
        T, ops = max(a.mask.shape[1], b.mask.shape[1]), a.ops

        def pad(c: "PrefixCache", t):
            return ops.pad_cols(t, T - c.mask.shape[1])

        def pad_mask(c: "PrefixCache"):
            return np.pad(c.mask, [(0, 0), (T - c.mask.shape[1], 0)])

        return PrefixCache([ops.concat(pad(a, x), pad(b, y), 0) for x, y in zip(a.prefix, b.prefix)],
                           np.concatenate([pad_mask(a), pad_mask(b)]),
                           [ops.concat(x, y, 1) for x, y in zip(a.chunk, b.chunk)],
                           np.concatenate([a.chunk_mask, b.chunk_mask]), a.s,
                           capacity=T + max(c.capacity - c.mask.shape[1] for c in (a, b)), ops=ops)

    def trim(self) -> None:
        """Drop the leading prefix columns that are padding in every beam."""
        z = int(np.argmax(self.mask.any(axis=0))) if self.mask.any() else self.mask.shape[1]
        if z:
            self._release([self.ops.cols(p, z) for p in self.prefix])
            self.mask = self.mask[:, z:].copy()
