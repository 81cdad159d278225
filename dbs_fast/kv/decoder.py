"""The decode graph (`decode.onnx`, `dbs_fast/export/prefix_graph.py`) as an ONNX Runtime session
over a `PrefixCache`: inputs bound in place and rebound only when their array changes, outputs into
buffers kept from step to step (no allocation); the new token's K/V come out in one array, copied
into the cache's chunk slot at once (`PrefixCache.put`), or, with the cache on a device, written
into the slot in place."""
from __future__ import annotations

import functools
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..runtime import make_session
from .prefix_cache import HOST, PrefixCache

# context columns per prefill call: the attention scores of a call are (rows, heads, slice, slice +
# columns before it), so slices keep a long context's transient memory linear in its length
PREFILL_SLICE = 256


class ContextStore:
    """Prefilled contexts' K/V kept across requests (automatic prefix caching), an LRU bounded in
    bytes. A request whose context is one prefilled before, token for token, takes its K/V and its
    last logits and computes nothing (a service's shared system prompt, an eval's one context). One
    whose context starts with the tokens of one prefilled before reuses that one's K/V up to the
    last whole prefill slice they share, and prefills only the rest: the slices then start where
    an uncached prefill's would, so either way the result is the same to the bit. `hits`,
    `lookups` and `reused_tokens` / `context_tokens` are its hit rates."""

    def __init__(self, max_bytes: int, granule: int = PREFILL_SLICE):
        self.max_bytes, self.granule = int(max_bytes), granule
        # key -> (tokens, K/V of the tokens, the last token's logits or None for a part of a context)
        self.entries: OrderedDict[int, tuple[np.ndarray, list, np.ndarray | None]] = OrderedDict()
        self.whole: dict[bytes, int] = {}           # the tokens of a whole prefilled context -> its key
        self.long: dict[int, None] = {}             # keys of the entries of a slice or more (reusable in part), in order
        self.parts: set[int] = set()                # keys of the parts of contexts (kept without logits)
        self.nbytes = self.hits = self.lookups = self.reused_tokens = self.context_tokens = 0
        self._key = 0

    def lookup(self, tokens: np.ndarray) -> tuple[int, list | None, np.ndarray | None]:
        """(P, the K/V of tokens[:P] as (1, kv, >= P, d) arrays, the logits after tokens[:P]):
        P = len(tokens) with the logits when the store holds this whole context; else the longest
        stored prefix of `tokens` in whole slices, leaving at least one token to prefill, and None
        for the logits; (0, None, None) on a miss."""
        self.lookups += 1
        self.context_tokens += len(tokens)
        best, hit = self.peek(tokens)
        if hit is None:
            return 0, None, None
        self.entries.move_to_end(hit)
        self.hits += 1
        self.reused_tokens += best
        _, past, logits = self.entries[hit]
        return best, past, logits if best == len(tokens) else None

    def peek(self, tokens: np.ndarray) -> tuple[int, int | None]:
        """`lookup` without counting or touching the LRU order: (P, the entry's key or None)."""
        tokens = np.asarray(tokens, np.int64)
        whole = self.whole.get(tokens.tobytes())
        if whole is not None:
            return len(tokens), whole
        best, hit = 0, None
        for key in self.long:                       # only these can share a whole slice
            toks = self.entries[key][0]
            n = min(len(toks), len(tokens) - 1)
            same = toks[:n] == tokens[:n]
            common = n if same.all() else int(np.argmin(same))
            p = common // self.granule * self.granule
            if p > best:
                best, hit = p, key
        return best, hit

    def put(self, tokens: np.ndarray, past: list, logits: np.ndarray | None = None) -> None:
        """Keep the K/V `past` ((1, kv, len(tokens), d) per tensor, arrays of the prefill that made them,
        which nothing writes to later) of `tokens`; with `logits` (the last token's), `tokens` is a
        whole context, kept at any length; without, a part of one, kept from one slice up."""
        tokens = np.asarray(tokens, np.int64)
        n = sum(p.nbytes for p in past) + (0 if logits is None else logits.nbytes)
        if (logits is None and len(tokens) < self.granule) or n > self.max_bytes:
            return
        same = self.whole.get(tokens.tobytes())     # the same whole context, or a part this one extends:
        redundant = [] if same is None else [same]
        for key in self.parts:
            part = self.entries[key][0]
            if len(part) <= len(tokens) and np.array_equal(part, tokens[:len(part)]):
                redundant.append(key)
        for key in redundant:
            self._drop(key)
        self._key += 1
        self.entries[self._key] = (tokens.copy(), past, logits)
        if logits is not None:
            self.whole[tokens.tobytes()] = self._key
        else:
            self.parts.add(self._key)
        if len(tokens) >= self.granule:
            self.long[self._key] = None
        self.nbytes += n
        while self.nbytes > self.max_bytes:
            self._drop(next(iter(self.entries)))

    def _drop(self, key: int) -> None:
        toks, past, logits = self.entries.pop(key)
        if logits is not None:
            del self.whole[toks.tobytes()]
        self.parts.discard(key)
        self.long.pop(key, None)
        self.nbytes -= sum(p.nbytes for p in past) + (0 if logits is None else logits.nbytes)


@dataclass(frozen=True)
class _Bound:
    """A device array bound by pointer: the pointer and shape it was bound with, and the array."""

    ptr: int
    shape: tuple
    arr: object = field(compare=False)


@functools.cache
def lone_row_rounds_apart() -> bool:
    """Whether ONNX Runtime's CPU MatMulNBits kernels give one row other bits than the same row
    among several on this machine (the shipped `data/row_probe.onnx`, 4- and 8-bit blocks with
    int8 activations: on an AVX2 Zen 3 they do; on the AVX-512 machines before it the default's
    texts were the same batched and alone). Where they do, a step of one
    row runs it twice (`PrefixBackend.step`), so that a request writes the same text alone as in
    a batch."""
    from importlib.resources import files

    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    session = ort.InferenceSession(files("dbs_fast.data").joinpath("row_probe.onnx").read_bytes(), so,
                                   providers=["CPUExecutionProvider"])
    x = np.random.default_rng(0).standard_normal((3, 64)).astype(np.float32)
    many, one = session.run(None, {"X": x}), session.run(None, {"X": x[:1]})
    return any(not np.array_equal(a[:1], b) for a, b in zip(many, one))


class PrefixDecoder:
    """The decode graph (`export/prefix_graph.py`) as an ONNX Runtime session, inputs bound in
    place, outputs into buffers kept from step to step (no allocation, no copy out of ORT)."""

    def __init__(self, path: str | Path, provider: str = "cpu", threads: int | None = None,
                 kv_device: str | None = "auto", buckets=None, cuda_graph: bool = False):
        # bucketed steps on the GPU: the weights loaded once there, for this session and every bucket's
        weights = None
        if (buckets is not None or cuda_graph) and provider == "cuda":
            from .buckets import shared_weights

            try:
                weights = shared_weights(Path(path), "cuda")
            except Exception:  # noqa: BLE001 - no GPU for ORT: the session falls back and says why
                weights = None
        self.session = make_session(Path(path), provider, threads, initializers=weights)
        self.outputs = [o.name for o in self.session.get_outputs()]
        self.vocab = self.session.get_outputs()[0].shape[-1]
        names = [i.name for i in self.session.get_inputs()]
        self.layers = sum(n.startswith("prefix.") for n in names) // 2
        # the cache's inputs per level, in the order of its tensors [k0, v0, k1, v1, ...]
        self._cache_inputs = [[f"{level}.{i}.{t}" for i in range(self.layers) for t in ("key", "value")]
                              for level in ("context", "prefix", "chunk")]
        # the graph computes distinct rows only (`slot_row`, `row_slot`; an older export computes every slot)
        self.distinct = "slot_row" in names
        self._arange = np.arange(0)
        self._ones_kept = np.ones(0, np.int64)
        self._out_shape: tuple = ()
        self._outs: dict[int, list[np.ndarray]] = {}    # rows computed -> the outputs' buffers (`_buffers`)
        self._outs_bound: tuple | None = None            # (the outputs list bound, its bytes)
        self._new = np.empty(0, np.float32)          # the new K/V of every tensor (`_buffers`)
        self._logits = np.empty((0, 0), np.float32)  # the logits of every slot (`_buffers`)
        self._new_views: list[np.ndarray] = []       # `_new`'s entries, made once (bound once)
        # one IO binding for all steps: an input is bound again only when its array is not the one
        # bound (the cache's buffers are written in place between steps, so most are not rebound:
        # binding GPT-2 large's 149 inputs took ~1 ms a step). One thread drives a decoder, as one
        # scheduler loop drives a batch (the service's Batcher thread owns the model).
        self._io = self.session.io_binding()
        self._bound: dict[str, object] = {}
        # where the cache lives: "auto" = on the GPU when the session runs on CUDA, else host NumPy;
        # "cpu" runs the device path on the CPU provider (tests); None = host
        # the K/V's float type: float32, or float16 (an fp16 export: its cache always goes through
        # `DeviceOps`, on the CPU provider where the session runs on the CPU)
        from .device import DTYPES, DeviceOps

        self.dtype = DTYPES[next(i.type for i in self.session.get_inputs() if i.name.startswith("context."))]
        if kv_device == "auto":
            kv_device = "cuda" if "CUDAExecutionProvider" in self.session.get_providers() else None
        if kv_device is None and self.dtype != np.float32:
            kv_device = "cpu"
        self.ops = HOST if kv_device is None else DeviceOps(kv_device, dtype=self.dtype)
        # a CPU-only session reads a bound host input where it lies (at every run); another copies it
        # at binding, so an input written in place between steps is bound again there
        self._reads_host_memory = self.session.get_providers() == ["CPUExecutionProvider"]
        self.host_bytes = 0       # bytes bound from host memory (inputs bound again, outputs) in the last call
        self.host_bytes_total, self.calls = 0, 0                    # ... and over all calls
        self.graph_seconds = 0.0  # inside ORT's run, over all calls (the rest of a call is the host's work)
        self.store: ContextStore | None = None      # prefilled contexts kept across requests (host cache only)
        # decode steps at bucket shapes, inputs and outputs at fixed addresses (`dbs_fast.kv.buckets`):
        # on CUDA with `cuda_graph`, one captured graph per bucket and chunk slot
        self.static = None
        if buckets is not None or cuda_graph:
            from ..errors import DBSError
            from .buckets import Buckets, StaticStep

            if self.ops is HOST:
                raise DBSError("bucketed decode steps need the cache on a device (`kv_device` cuda or cpu)")
            self.static = StaticStep(Path(path), self.ops, buckets or Buckets(), threads, cuda_graph,
                                     weights if self.ops.device == "cuda" else None)

    @property
    def on_cpu(self) -> bool:
        """Whether the graph runs on ONNX Runtime's CPU provider alone."""
        return self._reads_host_memory

    def _identity(self, n: int) -> np.ndarray:
        if len(self._arange) < n:
            self._arange = np.arange(max(n, 64), dtype=np.int64)
        return self._arange[:n]

    def _ones(self, shape: tuple) -> np.ndarray:
        """An all-ones int64 array of `shape`, the same one while the shape is (bound once)."""
        if self._ones_kept.shape != shape:
            self._ones_kept = np.ones(shape, np.int64)
        return self._ones_kept

    def _buffers(self, cache: PrefixCache, L: int, new: bool = True, n: int | None = None) -> list[np.ndarray]:
        """Logits (n, vocab) (n: the rows computed, default every slot) and, with `new`, the new
        K/V (L, b, kv, s, d) per tensor, reused while the shapes are the same. The logits are the
        first n rows of a buffer for every slot (two at least: a lone row runs twice,
        `PrefixBackend.step`), so that a step computing fewer distinct rows than the last allocates
        nothing."""
        N = cache.chunk_mask.shape[0]
        _, b, kv, s, d = cache.chunk[0].shape
        shape = (N, len(cache.chunk) if new else 0, L, b, kv, s, d)
        if shape != self._out_shape:
            # the new K/V of every tensor are entries of one array, so that `PrefixCache.put` copies once
            self._new = np.empty(shape[1:], self.dtype)
            self._logits, self._new_views = np.empty((max(N, 2), self.vocab), np.float32), list(self._new)
            self._out_shape, self._outs = shape, {}
        n = N if n is None else n
        if n not in self._outs:              # the same list, and views, while n is the same: bound once
            self._outs[n] = [self._logits[:n]] + self._new_views
        return self._outs[n]

    def _bind(self, name: str, arr, output: bool = False) -> None:
        """Bind `arr` (a NumPy array, or a DeviceArray on the cache's device) to `name` unless it is
        already the array bound there (kept referenced here, so that its memory stays valid while
        bound). A host array bound to a device graph is copied over at binding (an output, at
        every run): `host_bytes` counts those bytes."""
        on_host = isinstance(arr, np.ndarray)
        if on_host and output:
            self._moved(arr.nbytes)
        bound = self._bound.get(name)
        if bound is arr or (not on_host and isinstance(bound, _Bound) and (bound.ptr, bound.shape) == (arr.ptr, arr.shape)):
            return
        key = arr
        if on_host:
            if not output:
                self._moved(arr.nbytes)
                self._io.bind_cpu_input(name, arr)
            else:
                self._io.bind_output(name, "cpu", 0, arr.dtype, arr.shape, arr.ctypes.data)
        else:                                  # by pointer: the array is kept referenced in _bound
            bind = self._io.bind_output if output else self._io.bind_input
            bind(name, self.ops.device, self.ops.device_id, arr.dtype.type, list(arr.shape), arr.ptr)
            key = _Bound(arr.ptr, tuple(arr.shape), arr)
        self._bound[name] = key

    def _bind_cache(self, cache: PrefixCache, chunk: list) -> None:
        """The cache's tensors bound to the graph's inputs, each only where it is not the array bound
        there already (most are, between chunk boundaries)."""
        bound = self._bound
        for names, tensors in zip(self._cache_inputs, (cache.context, cache.prefix, chunk)):
            for name, arr in zip(names, tensors):
                if bound.get(name) is not arr:
                    self._bind(name, np.ascontiguousarray(arr) if isinstance(arr, np.ndarray) else arr)

    def _run(self, io) -> None:
        t0 = time.perf_counter()
        self.session.run_with_iobinding(io)
        self.graph_seconds += time.perf_counter() - t0

    def _moved(self, n: int) -> None:
        self.host_bytes += n
        self.host_bytes_total += n

    def release(self) -> None:
        """Unbind the inputs and outputs (the binding holds the last cache's arrays, and the outputs
        of an in-place step are its chunk slots, so that they would stay alive after their batch)."""
        self._io.clear_binding_inputs()
        self._io.clear_binding_outputs()
        self._bound, self._outs_bound = {}, None

    def prefill(self, ids: np.ndarray, mask: np.ndarray, kv_heads: int, head_dim: int, s: int, k: int,
                reserve: int = 0) -> tuple[np.ndarray, PrefixCache]:
        """Left-padded contexts (Q, T) through the decode graph as new tokens: the last logits (Q,
        vocab) and a cache with the contexts as its context level, one beam of s rows each, room for
        k chunk tokens and `reserve` prefix columns. One call per `PREFILL_SLICE` columns, each over
        the columns before it as the context (padding stays masked): no second graph, no second
        copy of the weights."""
        if self.store is not None and self.ops is HOST:
            return self._prefill_stored(ids, mask, kv_heads, head_dim, s, k, reserve)
        logits, past = self._prefill_slices(ids, mask, kv_heads, head_dim)
        return logits, PrefixCache.start(past, mask, s, k, reserve, self.ops)

    def _prefill_slices(self, ids: np.ndarray, mask: np.ndarray, kv_heads: int, head_dim: int,
                        start: int = 0, before: list | None = None) -> tuple[np.ndarray, list]:
        """Columns `start`: of the contexts through the graph, one call per `PREFILL_SLICE`, after
        `before` (the K/V of the first `start` columns, (Q, kv, >= start, d) per tensor): the last
        logits (Q, vocab) and the K/V of all T columns."""
        Q, T = ids.shape
        ops = self.ops
        empty = ops.zeros((Q, kv_heads, 1, head_dim))                      # one masked column
        context = [empty] * (2 * self.layers) if not start else \
            [np.concatenate([empty, b[:, :, :start]], axis=2) for b in before]
        pc = PrefixCache(context, np.concatenate([np.zeros((Q, 1), np.int64), mask[:, :start]], axis=1),
                         np.arange(Q), [empty] * (2 * self.layers), np.zeros((Q, 1), np.int64),
                         [ops.zeros((1, Q, kv_heads, 1, head_dim)) for _ in range(2 * self.layers)],
                         np.zeros((Q, 1), np.int64), 1, ops=ops)
        pos = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
        for t in range(start, T, PREFILL_SLICE):
            cols = slice(t, min(t + PREFILL_SLICE, T))
            logits, new = self.run(ids[:, cols], pc, positions=pos[:, cols], new_mask=mask[:, cols])
            # new (L, Q, kv, 1, d): L slots of one row per context, the context's next L columns
            pc.context = [ops.append_slots(p, x) for p, x in zip(pc.context, new)]
            pc.context_mask = np.concatenate([pc.context_mask, mask[:, cols]], axis=1)
        return logits.copy(), [ops.cols(p, 1) for p in pc.context]

    def prefill_left(self, tokens) -> int:
        """Tokens of a context that its prefill would compute now: all but what the context store
        holds of it (0 where nothing can be prefilled ahead: no store, a cache on a device)."""
        if self.store is None or self.ops is not HOST:
            return 0
        return len(tokens) - self.store.peek(np.asarray(tokens, np.int64))[0]

    def prefill_ahead(self, tokens, kv_heads: int, head_dim: int) -> bool:
        """One `PREFILL_SLICE` more of a context into the context store, after the longest prefix of
        it the store holds, so that a long context's prefill can go in pieces between a running
        batch's chunks (its admission then takes them from the store, to the bit the same as a
        prefill in one go). False when the store did not keep it (too small): prefill it whole."""
        tokens = np.asarray(tokens, np.int64)
        start, key = self.store.peek(tokens)
        if start >= len(tokens) - 1:                       # all there (a whole context stored)
            return True
        before = self.store.entries[key][1] if key is not None else None
        end = min(start + PREFILL_SLICE, len(tokens) - 1)
        _, past = self._prefill_slices(tokens[None, :end], np.ones((1, end), np.int64), kv_heads, head_dim, start,
                                       before)
        self.store.put(tokens[:end], past)
        return self.store.peek(tokens)[0] > start

    def _prefill_stored(self, ids, mask, kv_heads, head_dim, s, k, reserve) -> tuple[np.ndarray, PrefixCache]:
        """`prefill` through the context store: each context on its own, from the longest prefix
        of it the store holds (a context it holds whole is not computed at all: the contexts of a
        batch that are the same are computed once); then left-padded together as one batch's cache
        (a lone context's arrays are the store's own: a context is never written to)."""
        Q, T = ids.shape
        logits, pasts = [], []
        for q in range(Q):
            toks = ids[q, mask[q] == 1]
            n = len(toks)
            start, past, last = self.store.lookup(toks)
            if last is None:
                lg, past = self._prefill_slices(toks[None], np.ones((1, n), np.int64), kv_heads, head_dim, start,
                                                past)
                last = lg[0]
                self.store.put(toks, past, last)
            logits.append(last)
            pasts.append([np.pad(p, ((0, 0), (0, 0), (T - n, 0), (0, 0))) if n < T else p for p in past])
        past = pasts[0] if Q == 1 else [np.concatenate([p[i] for p in pasts]) for i in range(2 * self.layers)]
        return np.stack(logits), PrefixCache.start(past, mask, s, k, reserve, self.ops)

    def step(self, input_ids: np.ndarray, cache: PrefixCache, positions: np.ndarray | None = None,
             new_mask: np.ndarray | None = None, rows: tuple | None = None,
             group: np.ndarray | None = None) -> np.ndarray:
        """Logits (N, vocab) of the next token of every row; the rows' new K/V go into `cache`'s
        chunk. `input_ids` (N,) or (N, L): L new tokens per row; `positions` (N, L): instead of the
        cache's own count; `new_mask` (N, L): 0 = padding. `rows` (slot_row, row_slot) computes the
        distinct rows only (`dbs_fast.kv.groups.distinct_rows`): `input_ids` and the logits are then
        theirs (n rows), and `group` the slots' history groups after it (`PrefixCache.group`; None:
        not tracked). The logits are a buffer the next step overwrites: copy what must outlive it."""
        logits, _ = self.run(input_ids, cache, positions, new_mask, in_place=True, rows=rows)
        cache.advance()                                # written in place, into the chunk's next slot
        cache.group = group
        return logits

    def run(self, input_ids: np.ndarray, cache: PrefixCache, positions: np.ndarray | None = None,
            new_mask: np.ndarray | None = None, in_place: bool = False,
            rows: tuple | None = None) -> tuple[np.ndarray, list | None]:
        """One call of the graph: logits (n, vocab) and the new K/V (L, b, kv, s, d) per tensor, both
        buffers of this decoder; the cache is not changed. `in_place` (one new token per row): the
        new K/V are written into the cache's next chunk slot instead, and None comes back for them
        (`PrefixCache.advance` counts them). `rows`: (slot_row, row_slot), the distinct rows to
        compute (None: every slot is its own row)."""
        ids = np.ascontiguousarray(input_ids, np.int64).reshape(len(input_ids), -1)
        L = ids.shape[1]
        in_place = in_place and L == 1
        io = self._io
        self.host_bytes, self.calls = 0, self.calls + 1
        chunk, chunk_mask = cache.slots()
        if not self._reads_host_memory:                # a device graph copies a host input at binding
            chunk_mask = chunk_mask.copy()
        context_beams, beam_slot = cache.blocks()
        N = chunk_mask.shape[0]
        if rows is None:
            if len(ids) != N:
                raise ValueError(f"{len(ids)} rows of input for {N} slots: give `rows`")
            positions = cache.positions() if positions is None else positions
        else:
            positions = cache.positions()[rows[1]] if positions is None else positions
        feeds = {"input_ids": ids,
                 "position_ids": positions,
                 "context_mask": cache.context_mask, "context_beams": context_beams, "beam_slot": beam_slot,
                 "prefix_mask": cache.mask, "chunk_mask": chunk_mask,
                 "new_mask": self._ones(ids.shape) if new_mask is None else new_mask.astype(np.int64)}
        if self.distinct:
            feeds["slot_row"], feeds["row_slot"] = rows if rows is not None else (self._identity(N),) * 2
        elif rows is not None:
            raise ValueError("this decode graph computes every slot (re-export the model for distinct rows)")
        if self.static is not None and in_place:     # a bucket's fixed buffers, its own bindings
            t0 = time.perf_counter()
            logits = self.static.step(feeds, cache)
            self.graph_seconds += time.perf_counter() - t0
            self._moved(self.static.moved)
            return logits, None
        for name, arr in feeds.items():
            self._bind(name, np.ascontiguousarray(arr) if isinstance(arr, np.ndarray) else arr)
        self._bind_cache(cache, chunk)
        if self.ops is not HOST and not in_place:      # a prefill: the new K/V stay on the device
            out = self._buffers(cache, L, new=False, n=len(ids))
            self._bind(self.outputs[0], out[0], output=True)
            for name in self.outputs[1:]:
                io.bind_output(name, self.ops.device, self.ops.device_id)
                self._bound[name] = None
            self._outs_bound = None
            self._run(io)
            from .device import DeviceArray

            return out[0], [DeviceArray(v, tuple(v.shape())) for v in io.get_outputs()[1:]]
        # one new token per row on the host: the new K/V into buffers kept from step to step (bound
        # once), copied into the chunk's slot after the run; on a device, written there in place
        to_slot = in_place and self.ops is HOST
        out = self._buffers(cache, L, new=not in_place or to_slot, n=len(ids))
        if in_place and not to_slot:
            out = out + cache.next_slot()
        if self._outs_bound is not None and self._outs_bound[0] is out:
            self._moved(self._outs_bound[1])        # bound already (most steps): only counted
        else:
            for name, arr in zip(self.outputs, out):
                self._bind(name, arr, output=True)
            self._outs_bound = (out, sum(a.nbytes for a in out if isinstance(a, np.ndarray)))
        self._run(io)
        if to_slot:
            cache.put(self._new)
        return out[0], (None if in_place else out[1:])
