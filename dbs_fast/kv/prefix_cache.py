"""The three-level KV cache: each request's context stored once, each beam's generated prefix
once, each candidate's chunk in its own buffer. A context of `FOLD_CONTEXT` tokens or fewer starts
its beams' prefixes instead (its level is then one masked column, which the decode graph skips).

`PrefixCache` holds R contexts (R, kv_heads, C, head_dim) per layer (one per request, shared by
all its beams: `beam_context` says whose), b prefixes (b, kv_heads, T, head_dim) of the tokens
each beam generated, and the N = b * s rows' preallocated chunks, slot-major (k, b, kv_heads, s,
head_dim); row r is candidate r % s of beam r // s. A context is never written after its prefill
(a context store may hold the same arrays). A decode step (`PrefixDecoder.step`, the graph of
`export/prefix_graph.py`) reads the contexts, the prefixes and the chunk's buffers in place (its
undecoded slots masked; on the host the chunk's tensors are entries of one array) and its new
token's K/V go into the chunk's next slot: one copy of a few KB a layer on the host (`put`; rebinding
60 outputs at each step cost more), the output bound there on a device. At the
chunk boundary
`keep(rows)` builds the next prefixes from the kept candidates: their parent beam's prefix plus
their own chunk (a gather of b prefixes and b chunks of <= k tokens), and empties the chunks.
The s candidates of a kept beam are then the s rows that follow it, with no copy at all.

The tensors are NumPy arrays on the host (`HostOps`), or, with the CUDA provider, ORT tensors on
the device (`dbs_fast.kv.device`): the cache's few tensor operations go through `PrefixCache.ops`,
so the scheduler and the step are one code path on both, and a step moves only ids, positions,
masks and the logits between host and device (`PrefixDecoder.host_bytes` counts them).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .kv_copy import extend_prefix

DECODE_GRAPH = "decode.onnx"      # beside model.onnx in an exported model dir
# contexts of this many tokens or fewer start the beams' prefixes instead of being a level of their
# own: a step then skips the context level's nodes (16 a layer on the default), and each beam reads
# and, at each boundary, copies its own copy of these few columns (at 64 tokens the two were even)
FOLD_CONTEXT = 32
# a level's width (prefix and context columns) is a multiple of this: a batchmate's padding then moves
# a row's columns by a multiple of the vector kernels' lanes and blocks (16 float32 lanes), so that
# its softmax and matmul sums are the same to the bit as alone (and so is its text, where the
# 4-bit graph's int8 activations turn a last-bit difference into a different token)
ALIGN = 16
# auto: this layout where the export has its decode graph, else rows (one cache row per candidate:
# an export without a decode graph, the PyTorch baseline)
KV_LAYOUTS = ("auto", "rows", "prefix")


def context_blocks(beam_context: np.ndarray, R: int) -> tuple[np.ndarray, np.ndarray]:
    """For beams of contexts `beam_context` (b,) among R: (R, M) the beams of each context in M
    blocks (M = the most beams a context has; a context with fewer repeats its first beam, whose
    extra results the graph drops), and (b,) each beam's block r * M + m."""
    bc = np.asarray(beam_context, np.int64)
    order = np.argsort(bc, kind="stable")
    counts = np.bincount(bc, minlength=R)
    first = np.cumsum(counts) - counts
    M = max(1, int(counts.max(initial=0)))
    rank = np.empty(len(bc), np.int64)
    rank[order] = np.arange(len(bc)) - np.repeat(first, counts)
    beams = np.repeat(np.where(counts > 0, order[np.minimum(first, max(len(bc) - 1, 0))], 0)[:, None], M, axis=1)
    beams[bc, rank] = np.arange(len(bc))
    return beams, bc * M + rank


def round_up(x: int, granule: int) -> int:
    """`x` rounded up to a multiple of `granule` (0: as it is)."""
    return -(-x // granule) * granule if granule > 0 else x


def aligned(columns: int) -> int:
    """`columns` rounded up to a multiple of ALIGN."""
    return round_up(columns, ALIGN)


def in_prefixes(columns: int, fold: int | None = None) -> bool:
    """Whether a context of `columns` tokens starts its beams' prefixes rather than being a level of
    its own: `fold` (default `FOLD_CONTEXT`) or fewer."""
    return columns <= (FOLD_CONTEXT if fold is None else fold)


def padding_columns(mask: np.ndarray) -> int:
    """The leading columns of `mask` (rows, cols) that are padding in every row, all but the last
    where every column is (a graph input is never empty)."""
    used = mask.any(axis=0)
    return int(np.argmax(used)) if used.any() else mask.shape[1] - 1


def _last_columns(ops, tensors: list, mask: np.ndarray, width: int) -> tuple[list, np.ndarray]:
    """The last `width` columns of each (n, kv, T, d) tensor and of `mask` (n, T), zero columns
    in front where width > T."""
    T = mask.shape[1]
    if width > T:
        return [ops.pad_cols(t, width - T) for t in tensors], np.pad(mask, [(0, 0), (width - T, 0)])
    if width < T:
        return [ops.cols(t, T - width) for t in tensors], mask[:, T - width:].copy()
    return list(tensors), mask


class HostOps:
    """The cache's tensor operations on NumPy arrays (`dbs_fast.kv.device.DeviceOps` has the same on a
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
    def at(x: np.ndarray, i: int, shape) -> np.ndarray:
        return x[i].reshape(shape)

    @staticmethod
    def append_slots(p: np.ndarray, x: np.ndarray) -> np.ndarray:
        """p (Q, kv, T, d) and the L slots x (L, Q, kv, 1, d) as its next columns: (Q, kv, T + L, d)."""
        return np.concatenate([p, x[:, :, :, 0].transpose(1, 2, 0, 3)], axis=2)


HOST = HostOps()


def chunk_buffers(ops, shapes: list[tuple]) -> tuple[list, np.ndarray | None]:
    """Zeroed chunk buffers of `shapes` (k, b, kv, s, d) and, on the host where the shapes are
    alike, the one array (tensors, k, b, kv, s, d) whose entries they are (else None)."""
    if ops is HOST and len(set(shapes)) == 1:
        base = np.zeros((len(shapes),) + shapes[0], np.float32)
        return list(base), base
    return [ops.zeros(sh) for sh in shapes], None


@dataclass
class PrefixCache:
    context: list[np.ndarray]  # [k0, v0, k1, v1, ...], (R, kv, C, d) each: one per request
    context_mask: np.ndarray   # (R, C) int64, 0 = left padding
    beam_context: np.ndarray   # (b,) int64: the context of each beam
    prefix: list[np.ndarray]   # [k0, v0, k1, v1, ...], (b, kv, T, d) each: the tokens each beam generated
    mask: np.ndarray           # (b, T) int64, 0 = left padding
    chunk: list[np.ndarray]    # [k0, v0, ...], (K, b, kv, s, d) each: row r = candidate r % s of beam r // s
    chunk_mask: np.ndarray     # (N, K) int64, 1 = decoded in this chunk
    s: int
    used: int = 0              # tokens decoded in this chunk
    capacity: int = 0          # prefix columns expected at most (max_new_tokens + 1): the buffers' size
    ops: object = HOST         # where the tensors live: HOST (NumPy) or a dbs_fast.kv.device.DeviceOps
    # (N,) each row's history group in this chunk (`dbs_fast.kv.groups`): rows of one group hold the
    # same sequence; -1 a row no step computes any more (idle, ended); None: every row its own
    group: np.ndarray | None = None
    # flat buffers the cache allocated itself: `_own` backs `prefix`, `_spare` is free. The chunk
    # boundary writes the next prefixes into the spare ones and swaps (ping-pong): one copy, no
    # allocation, so no page faults, at most boundaries.
    _own: list | None = field(default=None, repr=False)
    _spare: list | None = field(default=None, repr=False)
    _blocks: tuple | None = field(default=None, repr=False)     # (key, blocks()) of the last step
    # (tensors, k, b, kv, s, d): the one host array whose entries are `chunk` (`chunk_buffers`), or None
    _chunk_base: np.ndarray | None = field(default=None, repr=False)

    @classmethod
    def start(cls, past: list, mask: np.ndarray, s: int, k: int, reserve: int = 0, ops=HOST,
              fold: int | None = None) -> "PrefixCache":
        """From a prefill's present K/V (one row per context, taken as it is) with one beam per
        context, s candidates per beam, room for k tokens per chunk and `reserve` prefix columns
        (max_new_tokens) in its buffers. Contexts of more than `fold` columns become the context
        level, and their beams' prefixes start as ALIGN masked columns; shorter ones start the
        beams' prefixes instead, with their rows of the context level masked (each context by its
        own length, so that a request's levels are the same in a batch as alone). Where no context
        is a level, the level is one masked column, which the decode graph skips
        (`export/prefix_graph.py`, `context_ifs`). Both levels' widths are multiples of ALIGN, the
        tokens at the right. `fold`: default `FOLD_CONTEXT`."""
        b, T = mask.shape
        chunk, base = chunk_buffers(ops, [(k, b, t.shape[1], s, t.shape[3]) for t in past])
        past = [np.ascontiguousarray(t) for t in past] if ops is HOST else past
        mask = np.asarray(mask, np.int64)
        folded = np.array([in_prefixes(int(n), fold) for n in mask.sum(axis=1)])
        tokens = int(mask[folded].sum(axis=1).max(initial=0))     # the folded contexts' longest
        if tokens:
            prefix, prefix_mask = _last_columns(ops, past, mask * folded[:, None], aligned(tokens))
        else:
            prefix = [ops.zeros((b, t.shape[1], ALIGN, t.shape[3])) for t in past]
            prefix_mask = np.zeros((b, ALIGN), np.int64)
        if folded.all():
            context = [ops.zeros((b, t.shape[1], 1, t.shape[3])) for t in past]
            context_mask = np.zeros((b, 1), np.int64)
        else:
            context, context_mask = _last_columns(ops, past, mask * ~folded[:, None], aligned(T))
        return cls(context, context_mask, np.arange(b), prefix, prefix_mask, chunk, np.zeros((b * s, k), np.int64), s,
                   capacity=aligned(tokens + reserve), ops=ops, group=np.repeat(np.arange(b), s),
                   _chunk_base=base)

    def groups(self) -> np.ndarray:
        """`group`, or every row its own where the cache does not track them."""
        return np.arange(self.chunk_mask.shape[0]) if self.group is None else self.group

    @property
    def beams(self) -> int:
        return self.mask.shape[0]

    @property
    def nbytes(self) -> int:
        """Bytes held: the contexts, the prefix buffers (with their headroom and the spare ones) and
        the chunks."""
        held = self.context + (self._own or self.prefix) + (self._spare or [])
        return sum(t.nbytes for t in held) + sum(t.nbytes for t in self.chunk)

    def positions(self) -> np.ndarray:
        """(N, 1) position of each row's next token: its context's and prefix's real tokens + the
        chunk so far."""
        before = self.context_mask.sum(1)[self.beam_context] + self.mask.sum(1)
        return np.repeat(before, self.s)[:, None] + self.used

    def blocks(self) -> tuple[np.ndarray, np.ndarray]:
        """The gathers between beams and contexts a step takes (`context_blocks`), kept while the
        beams' contexts are the same array (so that a step binds them again only after a boundary)."""
        key = (self.beam_context, self.context_mask.shape[0])
        if self._blocks is None or self._blocks[0][0] is not key[0] or self._blocks[0][1] != key[1]:
            self._blocks = (key, context_blocks(*key))
        return self._blocks[1]

    def slots(self) -> tuple[list[np.ndarray], np.ndarray]:
        """The chunk as a decode step reads it: each tensor's whole buffer of k slots and their mask
        (N, k), the same arrays at every step of a chunk (`advance` writes the mask in place). The
        undecoded slots are masked: whichever values the graph reads there (zeros, or a past
        chunk's), finite, get weight 0."""
        return self.chunk, self.chunk_mask

    def next_slot(self) -> list[np.ndarray]:
        """Where a decode step's new K/V go: the chunk's slot `used`, (1, b, kv, s, d) per tensor (a
        view a decode graph writes in place; `advance` then counts it)."""
        self._room(1)
        return [self.ops.at(c, self.used, (1,) + c.shape[1:]) for c in self.chunk]

    def put(self, new) -> None:
        """A decode step's new K/V (host arrays), (tensors, 1, b, kv, s, d) as one array or a list
        of (1, b, kv, s, d), copied into the chunk's slot `used` (`advance` then counts it): one
        copy where both are one array (60 small copies took ~0.2 ms of a one-row step)."""
        self._room(1)
        u = self.used
        if self._chunk_base is not None and isinstance(new, np.ndarray):
            self._chunk_base[:, u] = new[:, 0]
            return
        for c, x in zip(self.chunk, new):
            c[u] = x[0]

    def advance(self, L: int = 1) -> None:
        """Count L new tokens written at slots `used`.. of the chunk."""
        self._room(L)
        self.chunk_mask[:, self.used:self.used + L] = 1
        self.used += L

    def _room(self, L: int) -> None:
        """Raise unless L more tokens fit in the chunk."""
        if self.used + L > self.chunk_mask.shape[1]:
            raise RuntimeError(f"the chunk buffer holds {self.chunk_mask.shape[1]} tokens, {self.used} used; "
                               f"call keep() first")

    def keep(self, idx) -> None:
        """The next beams are the candidates `idx` (indices into N): each one's parent prefix +
        its chunk, with s candidate rows each (row r of beam i is row i * s + r)."""
        self.regroup(np.repeat(np.asarray(idx, np.int64), self.s))

    def regroup(self, idx) -> np.ndarray:
        """The rows `idx` (indices into N, repeats allowed) as the next layout; returns where each
        one is now. Rows with the same sequence share a beam: after decoded chunk tokens, the
        copies of one row; before any, the rows of one beam. A beam is its parent prefix plus
        that chunk (a gather of a few tokens per beam), with up to s rows; more copies than s
        take several beams. Slots a beam does not fill are idle rows (their logits unused). Rows
        that held one history group (copies of one sequence) are one group again."""
        idx = np.asarray(idx, dtype=np.int64)
        j, s = self.used, self.s
        key = idx if j else idx // s
        uniq, first, inv = np.unique(key, return_index=True, return_inverse=True)
        rank = np.empty(len(uniq), np.int64)
        rank[np.argsort(first)] = np.arange(len(uniq))        # beams in order of first appearance
        g = rank[inv]
        order = np.argsort(g, kind="stable")
        counts = np.bincount(g, minlength=len(uniq))
        slot = np.empty(len(idx), np.int64)
        slot[order] = np.arange(len(idx)) - np.repeat(np.cumsum(counts) - counts, counts)
        per = -(-counts // s)                                   # beams per key (copies beyond s split)
        beam = (np.cumsum(per) - per)[g] + slot // s
        src = np.empty(int(per.sum()), np.int64)
        src[beam] = key                                         # the key each new beam copies
        parent = src // s if j else src
        old = self.groups()[idx]
        same = np.where(old >= 0, old, len(self.chunk_mask) + idx) if j else key   # copies of one history
        if j:
            self.mask = self._extend(src, j)
        else:
            self._release([self.ops.take(p, src) for p in self.prefix])
            self.mask = self.mask[src]
        self._contexts(self.beam_context[parent])
        n = len(src) * s
        if n != self.chunk_mask.shape[0]:
            self.chunk, self._chunk_base = chunk_buffers(
                self.ops, [(c.shape[0], len(src)) + tuple(c.shape[2:]) for c in self.chunk])
            self.chunk_mask = np.zeros((n, self.chunk_mask.shape[1]), np.int64)
        else:
            self.chunk_mask[:] = 0            # stale chunk K/V stays: masked, overwritten column by column
        group = np.full(n, -1, np.int64)
        group[beam * s + slot % s] = np.unique(same, return_inverse=True)[1].ravel()
        self.group, self.used = group, 0
        return beam * s + slot % s

    def _extend(self, src: np.ndarray, j: int) -> np.ndarray:
        """Prefix of new beam i := prefix of beam src[i] // s + the first j chunk tokens of row src[i],
        its width the least multiple of ALIGN that holds every new beam's tokens (its parent's
        columns from `first` on, after `lead` zero columns); returns the new mask. On the host,
        written into the spare buffers. Those are allocated when too small, for `capacity` columns
        or 4 more chunks: a fresh allocation costs page faults, up to 5x the copy itself."""
        pm = self.mask[src // self.s]
        T, k = pm.shape[1], self.chunk_mask.shape[1]
        used = pm.any(axis=0)
        width = aligned((T - int(np.argmax(used)) if used.any() else 0) + j)
        kept = min(T, width - j)                       # the parent's columns that hold its tokens
        lead, first = width - j - kept, T - kept
        mask = np.concatenate([np.zeros((len(src), lead), np.int64), pm[:, first:], np.ones((len(src), j), np.int64)],
                              axis=1)
        if self.ops is not HOST:                       # on the device: one ORT graph for all tensors
            self.prefix = self.ops.extend(self.prefix, self.chunk, src, self.s, j, lead, first)
            return mask
        spare, own = self._spare or [None] * len(self.prefix), []
        for i, (p, c) in enumerate(zip(self.prefix, self.chunk)):
            shape = (len(src), p.shape[1], width, p.shape[3])
            n = int(np.prod(shape))
            buf = spare[i]
            if buf is None or buf.size < n:
                cols = self.capacity if self.capacity >= width else width + 4 * k
                buf = np.empty(len(src) * p.shape[1] * cols * p.shape[3], p.dtype)
            new = buf[:n].reshape(shape)
            extend_prefix(new, p, c, src, self.s, j, lead, first)
            self.prefix[i] = new
            own.append(buf)
        self._spare, self._own = self._own, own
        return mask

    def _contexts(self, beam_context: np.ndarray) -> None:
        """The beams now belong to `beam_context`: contexts no beam uses any more (their requests
        left) go, and the context columns that are padding in every remaining one (all but one
        where every remaining context is in its beams' prefixes)."""
        used = np.unique(beam_context)
        if len(used) < self.context_mask.shape[0]:
            self.context = [self.ops.take(x, used) for x in self.context]
            self.context_mask = self.context_mask[used]
            beam_context = np.searchsorted(used, beam_context)
            z = padding_columns(self.context_mask)    # all but one: every context left is in its prefixes
            z -= z % ALIGN if self.context_mask.any() else 0
            if z:
                self.context = [self.ops.cols(x, z) for x in self.context]
                self.context_mask = self.context_mask[:, z:].copy()
        self.beam_context = beam_context

    def _release(self, prefix: list[np.ndarray]) -> None:
        """`prefix` (new arrays) replaces the pooled one, whose buffers become spare."""
        self.prefix = prefix
        self._spare, self._own = self._spare or self._own, None

    @staticmethod
    def merge(a: "PrefixCache", b: "PrefixCache") -> "PrefixCache":
        """The beams of `a` then those of `b` (between chunks), the shorter prefix left-padded."""
        if a.used or b.used or a.s != b.s or a.chunk_mask.shape[1] != b.chunk_mask.shape[1]:
            raise RuntimeError("prefix caches merge only between chunks, with the same s and chunk size")
        if a.ops is not b.ops:
            raise RuntimeError("prefix caches merge only on the same device")
        ops = a.ops

        def joined(x: list, mx: np.ndarray, y: list, my: np.ndarray) -> tuple[list, np.ndarray]:
            """Tensors (n, kv, cols, d) of both, the shorter left-padded, and their masks."""
            T = max(mx.shape[1], my.shape[1])
            tensors = [ops.concat(ops.pad_cols(p, T - mx.shape[1]), ops.pad_cols(q, T - my.shape[1]), 0)
                       for p, q in zip(x, y)]
            return tensors, np.concatenate([np.pad(m, [(0, 0), (T - m.shape[1], 0)]) for m in (mx, my)])

        return PrefixCache(*joined(a.context, a.context_mask, b.context, b.context_mask),
                           np.concatenate([a.beam_context, b.beam_context + a.context_mask.shape[0]]),
                           *joined(a.prefix, a.mask, b.prefix, b.mask),
                           [ops.concat(x, y, 1) for x, y in zip(a.chunk, b.chunk)],
                           np.concatenate([a.chunk_mask, b.chunk_mask]), a.s,
                           group=np.concatenate([a.groups(), np.where(b.groups() >= 0, b.groups() + len(a.chunk_mask), -1)]),
                           capacity=max(a.mask.shape[1], b.mask.shape[1]) + max(c.capacity - c.mask.shape[1] for c in (a, b)),
                           ops=ops)

    def trim(self) -> None:
        """Drop the leading prefix columns that are padding in every beam, a multiple of ALIGN."""
        z = padding_columns(self.mask)
        z -= z % ALIGN
        if z:
            self._release([self.ops.cols(p, z) for p in self.prefix])
            self.mask = self.mask[:, z:].copy()
