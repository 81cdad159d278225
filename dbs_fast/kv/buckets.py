"""The decode step at fixed shapes, one ONNX Runtime session per bucket of sizes, every input and
output at a fixed address: what ORT's CUDA graphs need (`enable_cuda_graph`, one captured graph
per `gpu_graph_id`), so that a step on the GPU is one graph launch instead of a launch per node.

A decode step's sizes (rows, beams, prefix and context columns, chunk slots) round up to a bucket
(`Buckets`); each bucket's session has its graph's dimensions fixed (free-dimension overrides), so
that ORT folds the shape arithmetic away and no node is left to the CPU. The sessions share one
copy of the weights (`add_initializer`). Each bucket's inputs live in buffers allocated once per
shape: the int64 inputs in one buffer (one host->device copy a step), the contexts and prefixes
copied in when the cache's arrays change (once a request, once a chunk: a device copy), and the
chunk is the bucket's own buffer, which the cache adopts at a chunk's first step. The new K/V go
into the chunk's slot j in place, so a bucket has one captured graph per slot: `gpu_graph_id` j.

Padding: rows beyond the computed ones repeat slot 0's row (their logits are dropped), prefix and
context columns beyond the cache's are masked. `Buckets.rows` 0 computes every slot (the distinct
rows spread to their slots): one row bucket per batch, fewer sessions, where a GPU has the rows to
spare. On the CPU provider the same path runs without capture (`DeviceOps("cpu")`): the tests hold
it to the dynamic step's logits and texts.
"""
from __future__ import annotations

import time
import warnings
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import DBSError
from ..manifest import read_manifest
from ..runtime import session_options
from .device import DTYPES, DeviceArray, DeviceOps
from .prefix_cache import round_up

# int64 inputs whose padded rows hold something other than 0: a padded row reads one real token
# (an all-masked row would divide by zero)
ROW_FILL = {"new_mask": 1}
SHARED_BYTES = 1024          # initializers of at least this many bytes are shared between the sessions


@dataclass(frozen=True)
class Buckets:
    """How a step's sizes round up to a bucket's fixed shapes."""

    rows: int = 0        # rows computed, up to a multiple of this; 0: every slot (one row bucket a batch)
    prefix: int = 32     # prefix columns, up to a multiple of this (a 90-token generation: 3-4 buckets)
    context: int = 64    # context columns (a folded context, one masked column, stays one)
    sessions: int = 32   # bucket sessions kept (least recently used dropped); each holds its own activations

    def __post_init__(self):
        for name in ("rows", "prefix", "context"):
            if getattr(self, name) < 0:
                raise DBSError.about(name, "must be >= 0", getattr(self, name))
        if self.sessions < 1:
            raise DBSError.about("sessions", "must be >= 1", self.sessions)

    def dims(self, n: int, N: int, context_mask, context_beams, prefix_mask, chunk_mask, s: int) -> dict:
        """The graph's named dimensions for a step of n rows computed over N slots."""
        R, C = context_mask.shape
        rows = N if self.rows == 0 else min(round_up(n, self.rows), max(n, N))
        return {"rows": rows, "new": 1, "slots": N, "contexts": R,
                "context": C if C == 1 else round_up(C, self.context), "blocks": context_beams.shape[1],
                "beams": prefix_mask.shape[0], "prefix": round_up(prefix_mask.shape[1], self.prefix),
                "chunk": chunk_mask.shape[1], "candidates": s}


def shared_weights(path: Path, device: str, device_id: int = 0) -> dict:
    """{name: OrtValue on `device`} of the graph's initializers of SHARED_BYTES or more: one copy of
    the weights for every session given them (`SessionOptions.add_initializer`; ORT uses one where
    it plans it on that device)."""
    import onnx
    import onnxruntime as ort
    from onnx import numpy_helper

    out = {}
    for init in onnx.load(str(path)).graph.initializer:
        a = numpy_helper.to_array(init)
        if a.nbytes >= SHARED_BYTES:
            out[init.name] = ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(a), device, device_id)
    return out


ITEM_BYTES = {"tensor(float)": 4, "tensor(float16)": 2, "tensor(bfloat16)": 2, "tensor(uint8)": 1, "tensor(int8)": 1,
              "tensor(int32)": 4, "tensor(int64)": 8}


def _nbytes(v) -> int:
    """Bytes of the tensor OrtValue `v` (on any device)."""
    return int(np.prod(v.shape())) * ITEM_BYTES.get(v.data_type(), 4)


def control_flow(model) -> dict:
    """{If, Loop, Scan: count} of an ONNX model's top-level nodes: what a CUDA graph cannot capture."""
    found: dict[str, int] = {}
    for n in model.graph.node:
        if n.op_type in ("If", "Loop", "Scan"):
            found[n.op_type] = found.get(n.op_type, 0) + 1
    return found


def cuda_graph_providers(device_id: int = 0) -> list:
    """ORT's CUDA provider with CUDA graphs on (then the CPU provider, which nothing may need)."""
    return [("CUDAExecutionProvider", {"device_id": str(device_id), "enable_cuda_graph": "1"}), "CPUExecutionProvider"]


def fill_padded(out: np.ndarray, arr: np.ndarray, fill: int = 0) -> np.ndarray:
    """`out` := `arr` in its top-left corner, `fill` elsewhere (in place)."""
    out.fill(fill)
    out[tuple(slice(0, d) for d in arr.shape)] = arr
    return out


def padded(arr: np.ndarray, shape: tuple, fill: int = 0) -> np.ndarray:
    """`arr` in the top-left corner of an array of `shape` filled with `fill`."""
    return fill_padded(np.empty(shape, arr.dtype), arr, fill)


@dataclass
class _Bucket:
    """One bucket's session, its int64 staging (host) and buffer (device), its K/V and logits
    buffers, and an IO binding per chunk slot (all bound once)."""

    session: object
    dims: dict
    staging: np.ndarray                  # (total,) int64: every int64 input, one after another
    ints: DeviceArray                    # the same on the device
    regions: dict                        # int64 input -> (offset, shape)
    kv: dict                             # input name -> its DeviceArray (context.*, prefix.*, chunk.*)
    logits: DeviceArray
    ios: dict                            # chunk slot -> (IO binding, run options)
    seconds: float = 0.0                 # its session's creation
    views: dict = field(default_factory=dict)    # int64 input -> its view of `staging`, shaped
    levels: dict = field(default_factory=dict)   # level -> its buffers in the cache's order [k0, v0, ...]

    def __post_init__(self):
        self.views = {n: self.staging[off:off + int(np.prod(sh))].reshape(sh) for n, (off, sh) in self.regions.items()}
        self.levels = {lv: [self.kv[f"{lv}.{i}.{t}"] for i in range(len(self.kv) // 6) for t in ("key", "value")]
                       for lv in ("context", "prefix", "chunk")}


class StaticStep:
    """Decode steps at bucket shapes (`Buckets`) on `ops`'s device, with CUDA graphs where `cuda_graph`."""

    def __init__(self, path: Path, ops: DeviceOps, buckets: Buckets, threads: int | None = None,
                 cuda_graph: bool = False, weights: dict | None = None):
        import onnx
        import onnxruntime as ort

        if ops.device == "cpu" and cuda_graph:
            raise DBSError("CUDA graphs need the CUDA provider (`provider` cuda)")
        self.path, self.ops, self.buckets, self.threads, self.cuda_graph = Path(path), ops, buckets, threads, cuda_graph
        self._ort = ort
        flow = control_flow(onnx.load(str(path), load_external_data=False))
        if flow and cuda_graph:
            raise DBSError(f"{path}: a CUDA graph cannot hold control flow ({flow} nodes: the split attention's "
                           f"context level); export with `--dtype fp16` or `--attention gathered`")
        # the weights once on the device, given to every bucket's session (and the decoder's own)
        self.weights = weights if weights is not None else shared_weights(self.path, ops.device, ops.device_id)
        self.weight_bytes = sum(_nbytes(v) for v in self.weights.values())
        self.vocab = int(read_manifest(self.path.parent)["vocab_size"])
        self._pool: dict[tuple, DeviceArray] = {}       # (role, shape) -> its buffer, allocated once
        self._sessions: OrderedDict[tuple, _Bucket] = OrderedDict()
        self._copied: dict[tuple, list] = {}            # pooled K/V buffer's key -> the arrays copied into it
        self.created = self.captured = 0                # sessions made, slot graphs bound (captured on CUDA)
        self.moved = 0                                  # bytes between host and device in the last step
        self.capture_refused: str | None = None         # why ORT would not capture, if it would not
        self.setup_seconds = 0.0

    # -- buffers and sessions ---------------------------------------------------------------

    def _buffer(self, role: str, shape: tuple, dtype) -> DeviceArray:
        key = (role, tuple(shape), np.dtype(dtype).str)
        if key not in self._pool:
            zeros = np.zeros(shape, dtype)
            self._pool[key] = DeviceArray(self._ort.OrtValue.ortvalue_from_numpy(zeros, self.ops.device,
                                                                                 self.ops.device_id), tuple(shape),
                                          0, np.dtype(dtype))
        return self._pool[key]

    def _session(self, dims: dict):
        so = session_options(self.threads)
        for name, value in dims.items():
            so.add_free_dimension_override_by_name(name, int(value))
        for name, value in self.weights.items():
            so.add_initializer(name, value)
        providers = (cuda_graph_providers(self.ops.device_id) if self.cuda_graph else
                     [("CUDAExecutionProvider", {"device_id": str(self.ops.device_id)}), "CPUExecutionProvider"]
                     if self.ops.device == "cuda" else ["CPUExecutionProvider"])
        try:
            return self._ort.InferenceSession(str(self.path), so, providers=providers)
        except Exception as e:  # ORT raises its own types; a CUDA graph refuses nodes left to the CPU
            why = str(e).splitlines()[0][:300]
            if not self.cuda_graph:
                raise DBSError(f"cannot make the bucket session of {self.path} at {dims}: {why}") from None
        # ORT would not capture this graph (a node it leaves to the CPU): the buckets run uncaptured
        warnings.warn(f"CUDA graphs refused for {self.path} ({why}); its bucketed steps run without them",
                      RuntimeWarning, stacklevel=3)
        self.cuda_graph, self.capture_refused = False, why
        return self._session(dims)

    def bucket(self, dims: dict) -> _Bucket:
        key = tuple(dims.values())
        b = self._sessions.get(key)
        if b is not None:
            self._sessions.move_to_end(key)
            return b
        t0 = time.perf_counter()
        sess = self._session(dims)
        regions, total, kv = {}, 0, {}
        for i in sess.get_inputs():
            shape = tuple(dims[d] if isinstance(d, str) else int(d) for d in i.shape)
            if i.type == "tensor(int64)":
                regions[i.name] = (total, shape)
                total += int(np.prod(shape))
            else:
                kv[i.name] = self._buffer(i.name, shape, DTYPES[i.type])
        logits = self._buffer("logits", (dims["rows"], self.vocab), np.float32)
        ints = self._buffer(f"ints.{key}", (total,), np.int64)
        b = _Bucket(sess, dims, np.zeros(total, np.int64), ints, regions, kv, logits, {},
                    time.perf_counter() - t0)
        self._sessions[key] = b
        self.created += 1
        self.setup_seconds += b.seconds
        while len(self._sessions) > self.buckets.sessions:
            self._sessions.popitem(last=False)
        return b

    def _io(self, b: _Bucket, slot: int):
        """The bucket's IO binding and run options for a step writing chunk slot `slot`: every input
        and output bound to its fixed buffer, once."""
        if slot in b.ios:
            return b.ios[slot]
        io = b.session.io_binding()
        dev, did = self.ops.device, self.ops.device_id
        for name, (off, shape) in b.regions.items():
            io.bind_input(name, dev, did, np.int64, list(shape), b.ints.ptr + 8 * off)
        for name, a in b.kv.items():
            io.bind_input(name, dev, did, a.dtype.type, list(a.shape), a.ptr)
        outs = b.session.get_outputs()
        io.bind_output(outs[0].name, dev, did, np.float32, list(b.logits.shape), b.logits.ptr)
        for o in outs[1:]:                              # new.i.key -> chunk.i.key's slot
            c = b.kv["chunk" + o.name[len("new"):]]
            at = c.at(slot, (1,) + c.shape[1:])
            io.bind_output(o.name, dev, did, at.dtype.type, list(at.shape), at.ptr)
        ro = self._ort.RunOptions()
        if self.cuda_graph:                             # the slot's own captured graph
            ro.add_run_config_entry("gpu_graph_id", str(slot))
        b.ios[slot] = (io, ro)
        self.captured += 1
        return b.ios[slot]

    # -- a step ----------------------------------------------------------------------------

    def _copy_in(self, b: _Bucket, level: str, arrays: list) -> None:
        """The cache's K/V of `level` into the bucket's buffers (padded with zero columns), unless
        they are the arrays copied there last (held, so that their memory is not reused)."""
        targets = b.levels[level]
        key = (level, targets[0].ptr)
        last = self._copied.get(key)
        if last is not None and len(last) == len(arrays) and all(x is y for x, y in zip(last, arrays)):
            return
        self.ops.pad_into(arrays, targets)
        self._copied[key] = list(arrays)

    def step(self, feeds: dict, cache) -> np.ndarray:
        """The logits (n, vocab) of `feeds` (the decode graph's int64 inputs for n rows) over
        `cache`, whose chunk slot `cache.used` gets the new K/V (the cache adopts the bucket's
        chunk buffers at a chunk's first step)."""
        n, N = len(feeds["input_ids"]), feeds["chunk_mask"].shape[0]
        if self.buckets.rows == 0 and "slot_row" in feeds and n != N:
            feeds, back = _every_slot(feeds), feeds["row_slot"]
        else:
            back = None
        dims = self.buckets.dims(len(feeds["input_ids"]), N, feeds["context_mask"], feeds["context_beams"],
                                 feeds["prefix_mask"], feeds["chunk_mask"], cache.s)
        b = self.bucket(dims)
        self._adopt_chunk(b, cache)
        self._copy_in(b, "context", cache.context)
        self._copy_in(b, "prefix", cache.prefix)
        for name, view in b.views.items():           # each int64 input padded in place in the staging
            fill_padded(view, np.asarray(feeds[name], np.int64), ROW_FILL.get(name, 0))
        b.ints.buf.update_inplace(b.staging)
        io, ro = self._io(b, cache.used)
        b.session.run_with_iobinding(io, ro)
        logits = b.logits.buf.numpy()
        self.moved = b.staging.nbytes + logits.nbytes
        return logits[back] if back is not None else logits[:n]

    def _adopt_chunk(self, b: _Bucket, cache) -> None:
        """The cache's chunk becomes the bucket's buffers (the slots decoded so far copied over)."""
        chunk = b.levels["chunk"]
        if len(cache.chunk) == len(chunk) and all(x is y for x, y in zip(cache.chunk, chunk)):
            return
        if cache.used:
            self.ops.pad_into(cache.chunk, chunk)
        cache.chunk, cache._chunk_base = list(chunk), None

    @property
    def sessions(self) -> int:
        return len(self._sessions)

    def stats(self) -> dict:
        """Buckets made and kept, slot graphs bound (each captured once on CUDA), the seconds their
        sessions took to make (a graph's capture is in its first steps), the buffers' bytes, and
        each bucket's sizes."""
        return {"sessions_created": self.created, "sessions_kept": self.sessions, "slot_graphs": self.captured,
                "cuda_graph": self.cuda_graph, "capture_refused": self.capture_refused, "session_seconds": round(self.setup_seconds, 3),
                "buffer_bytes": sum(a.nbytes for a in self._pool.values()),
                "shared_weight_bytes": self.weight_bytes,
                "buckets": [b.dims for b in self._sessions.values()]}


def _every_slot(feeds: dict) -> dict:
    """`feeds` of the distinct rows spread to every slot: each slot computes its row's token."""
    slot_row = feeds["slot_row"]
    out = dict(feeds)
    for name in ("input_ids", "position_ids", "new_mask"):
        out[name] = np.asarray(feeds[name])[slot_row]
    out["slot_row"] = out["row_slot"] = np.arange(len(slot_row), dtype=np.int64)
    return out

