"""The prefix KV cache kept on the execution provider's device (CUDA): tensors that never leave it.

On the CPU the cache is NumPy arrays bound to the decode graph in place (`dbs_fast.kv.prefix_cache`).
With the CUDA provider those arrays would live in host memory: every step ORT would copy the
chunk slots it reads to the GPU and the new K/V back, and every chunk the whole prefix up.
`DeviceArray` is a tensor in ORT's memory on a device (an `OrtValue` and an offset into it, so
that one chunk slot is a view and not a copy), bound to the
decode graph by pointer. `DeviceOps` does the cache's few tensor operations (gather of beams,
prefix extension by kept chunks, concatenation, a prefill's new slots as columns, left padding,
column trim, zeros) as small ONNX
graphs run by the same provider on the same device, so that at a step only the token ids,
positions and masks go up and the logits come down (the logits kernel runs on the host).

`DeviceOps("cpu")` runs this same path on the CPU provider: tests and the CPU-only machines
exercise it (same tokens as the NumPy cache), and `PrefixDecoder.host_bytes` counts what a step
moves between host and device memory on either path.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..runtime import PROVIDERS

F32 = np.dtype(np.float32)
# the cache's float types: the graph's K/V inputs as ORT names them -> NumPy's
DTYPES = {"tensor(float)": F32, "tensor(float16)": np.dtype(np.float16)}


@dataclass(frozen=True)
class DeviceArray:
    """A C-contiguous float32 or float16 tensor of `shape` at element `offset` of the ORT buffer `buf`."""

    buf: object                 # onnxruntime.OrtValue (owns the memory)
    shape: tuple
    offset: int = 0
    dtype: np.dtype = None      # the buffer's float type, read from it once (views pass it on)

    def __post_init__(self):
        if self.dtype is None:
            object.__setattr__(self, "dtype", DTYPES[self.buf.data_type()])

    @property
    def size(self) -> int:
        return int(np.prod(self.shape))

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    @property
    def ptr(self) -> int:
        return self.buf.data_ptr() + self.offset * self.dtype.itemsize

    def at(self, i: int, shape: tuple | None = None) -> DeviceArray:
        """Entry i of axis 0 (a view), reshaped to `shape` (same size) if given."""
        inner = tuple(self.shape[1:])
        step = int(np.prod(inner))
        if shape is not None and int(np.prod(shape)) != step:
            raise ValueError(f"cannot view {inner} as {shape}")
        return DeviceArray(self.buf, inner if shape is None else tuple(shape), self.offset + i * step, self.dtype)

    def reshape(self, *shape) -> DeviceArray:
        shape = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape
        return DeviceArray(self.buf, shape, self.offset, self.dtype)

    def numpy(self) -> np.ndarray:
        """A host copy (tests, debugging)."""
        full = self.buf.numpy().reshape(-1)
        return full[self.offset:self.offset + self.size].reshape(self.shape).copy()


def _model(nodes, inputs, outputs=("y",), dtype=F32):
    from onnx import TensorProto, helper

    f = TensorProto.FLOAT16 if dtype == np.float16 else TensorProto.FLOAT
    ins = [helper.make_tensor_value_info(n, f if t == "f" else TensorProto.INT64, None) for n, t in inputs]
    g = helper.make_graph(nodes, "cache_op", ins, [helper.make_tensor_value_info(o, f, None) for o in outputs])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def extend_graph(tensors: int, dtype=F32):
    """The chunk boundary's prefix extension of all `tensors` cache tensors in one graph (one run,
    not one per tensor): new beam i := `lead` zero columns ++ prefix[src[i] // s] from column
    `first` ++ the first j chunk tokens of row src[i]; prefix.t (b, kv, T, d), chunk.t slot-major
    (K, b, kv, s, d), src (n,), s, j and first (1,), pads (8,) = [0, 0, lead, 0, 0, 0, 0, 0] ->
    y.t (n, kv, lead + T - first + j, d). j >= 1 (j = 0 is a gather: `take`)."""
    from onnx import helper

    n = helper.make_node
    nodes = [n("Div", ["src", "s"], ["beam"])]
    for i in range(tensors):
        nodes += [n("Gather", [f"prefix.{i}", "beam"], [f"g{i}"], axis=0),
                  n("Slice", [f"g{i}", "first", "end", "two"], [f"gs{i}"]),
                  n("Pad", [f"gs{i}", "pads"], [f"p{i}"]),
                  n("Slice", [f"chunk.{i}", "zero", "j", "zero"], [f"c{i}"]),          # (j, b, kv, s, d)
                  n("Transpose", [f"c{i}"], [f"ct{i}"], perm=[1, 3, 2, 0, 4]),           # (b, s, kv, j, d)
                  n("Shape", [f"ct{i}"], [f"tail{i}"], start=2),
                  n("Concat", ["minus1", f"tail{i}"], [f"flat{i}"], axis=0),
                  n("Reshape", [f"ct{i}", f"flat{i}"], [f"rows{i}"]),                    # (b*s, kv, j, d)
                  n("Gather", [f"rows{i}", "src"], [f"own{i}"], axis=0),
                  n("Concat", [f"p{i}", f"own{i}"], [f"y.{i}"], axis=2)]
    inputs = ([(f"prefix.{i}", "f") for i in range(tensors)] + [(f"chunk.{i}", "f") for i in range(tensors)]
              + [("src", "i"), ("s", "i"), ("j", "i"), ("zero", "i"), ("minus1", "i"), ("first", "i"), ("end", "i"),
                 ("two", "i"), ("pads", "i")])
    return _model(nodes, inputs, [f"y.{i}" for i in range(tensors)], dtype)


def pad_graph(tensors: int, dtype=F32):
    """`tensors` arrays of one shape each padded at the end of their axes by `pads` (zeros): the
    step's fixed buffers filled from the cache's arrays in one run (`dbs_fast.kv.buckets`)."""
    from onnx import helper

    nodes = [helper.make_node("Pad", [f"x.{i}", "pads"], [f"y.{i}"]) for i in range(tensors)]
    inputs = [(f"x.{i}", "f") for i in range(tensors)] + [("pads", "i")]
    return _model(nodes, inputs, [f"y.{i}" for i in range(tensors)], dtype)


def _graphs(dtype=F32) -> dict:
    """The cache's other operations as ONNX models (`dtype` tensors, int64 indices, all sizes dynamic)."""
    from onnx import helper, numpy_helper

    def model(nodes, inputs):
        return _model(nodes, inputs, dtype=dtype)

    n = helper.make_node
    return {
        # prefix (b, kv, T, d), beams (n,) -> (n, kv, T, d)
        "take": model([n("Gather", ["x", "i"], ["y"], axis=0)], [("x", "f"), ("i", "i")]),
        "concat0": model([n("Concat", ["a", "b"], ["y"], axis=0)], [("a", "f"), ("b", "f")]),
        "concat1": model([n("Concat", ["a", "b"], ["y"], axis=1)], [("a", "f"), ("b", "f")]),
        # (b, kv, T, d) with n zero columns in front: pads (8,) = [0, 0, n, 0, 0, 0, 0, 0]
        "pad": model([n("Pad", ["x", "pads"], ["y"])], [("x", "f"), ("pads", "i")]),
        # columns z.. of (b, kv, T, d)
        "cols": model([n("Slice", ["x", "z", "end", "axis"], ["y"])],
                      [("x", "f"), ("z", "i"), ("end", "i"), ("axis", "i")]),
        # p (Q, kv, T, d) ++ the L slots x (L, Q, kv, 1, d) as columns -> (Q, kv, T + L, d)
        "append_slots": model([n("Constant", [], ["three"], value=numpy_helper.from_array(np.array([3], np.int64))),
                               n("Squeeze", ["x", "three"], ["x4"]), n("Transpose", ["x4"], ["xt"], perm=[1, 2, 0, 3]),
                               n("Concat", ["p", "xt"], ["y"], axis=2)], [("p", "f"), ("x", "f")]),
        # zeros of shape `shape`
        "zeros": model([n("ConstantOfShape", ["shape"], ["y"], value=numpy_helper.from_array(np.zeros(1, dtype)))],
                       [("shape", "i")]),
    }


class DeviceOps:
    """The cache's tensor operations on `device` ("cuda" or "cpu"), run by ORT on that device, on
    tensors of `dtype` (the decode graph's K/V: float32, or float16 for an fp16 export)."""

    def __init__(self, device: str = "cuda", device_id: int = 0, dtype=F32):
        import onnxruntime as ort

        self.device, self.device_id, self.dtype = device, device_id, np.dtype(dtype)
        providers = [PROVIDERS[device], "CPUExecutionProvider"] if device != "cpu" else ["CPUExecutionProvider"]
        so = ort.SessionOptions()
        so.intra_op_num_threads = 1         # copies of a few MB: one thread, no spinning beside the model's
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        self._so, self._providers, self._ort = so, providers, ort
        self._sessions = {k: self._session(m) for k, m in _graphs(self.dtype).items()}

    def _session(self, model):
        return self._ort.InferenceSession(model.SerializeToString(), self._so, providers=self._providers)

    def _run(self, op: str, **feeds) -> DeviceArray:
        return self._run_all(self._sessions[op], **feeds)[0]

    def _run_all(self, sess, **feeds) -> list[DeviceArray]:
        io = sess.io_binding()
        for name, x in feeds.items():
            if isinstance(x, DeviceArray):
                io.bind_input(name, self.device, self.device_id, self.dtype.type, list(x.shape), x.ptr)
            else:
                io.bind_cpu_input(name, np.ascontiguousarray(x, np.int64))
        for o in sess.get_outputs():
            io.bind_output(o.name, self.device, self.device_id)
        sess.run_with_iobinding(io)
        return [DeviceArray(v, tuple(v.shape())) for v in io.get_outputs()]

    def upload(self, a: np.ndarray) -> DeviceArray:
        a = np.ascontiguousarray(a, self.dtype)
        return DeviceArray(self._ort.OrtValue.ortvalue_from_numpy(a, self.device, self.device_id), a.shape)

    def zeros(self, shape) -> DeviceArray:
        return self._run("zeros", shape=np.asarray(shape, np.int64))

    def take(self, x: DeviceArray, idx) -> DeviceArray:
        return self._run("take", x=x, i=np.asarray(idx, np.int64))

    def extend(self, prefixes: list[DeviceArray], chunks: list[DeviceArray], src, s: int, j: int, lead: int = 0,
               first: int = 0) -> list[DeviceArray]:
        """Every tensor's next prefixes (`extend_graph`), in one run."""
        key = f"extend{len(prefixes)}"
        if key not in self._sessions:
            self._sessions[key] = self._session(extend_graph(len(prefixes), self.dtype))
        feeds = {f"prefix.{i}": p for i, p in enumerate(prefixes)} | {f"chunk.{i}": c for i, c in enumerate(chunks)}
        return self._run_all(self._sessions[key], **feeds, src=np.asarray(src, np.int64), s=np.array([s], np.int64),
                             j=np.array([j], np.int64), zero=np.zeros(1, np.int64), minus1=np.full(1, -1, np.int64),
                             first=np.array([first], np.int64), end=np.array([prefixes[0].shape[2]], np.int64),
                             two=np.array([2], np.int64), pads=np.array([0, 0, lead, 0, 0, 0, 0, 0], np.int64))

    def pad_into(self, xs: list[DeviceArray], outs: list[DeviceArray]) -> None:
        """Each x (one shape) into its out (one larger shape), zeros after it on every axis, in one
        run whose outputs are `outs`' memory."""
        key = f"pad{len(xs)}"
        if key not in self._sessions:
            self._sessions[key] = self._session(pad_graph(len(xs), self.dtype))
        sess = self._sessions[key]
        shape, target = xs[0].shape, outs[0].shape
        pads = np.array([0] * len(shape) + [t - s for s, t in zip(shape, target)], np.int64)
        io = sess.io_binding()
        for i, (x, y) in enumerate(zip(xs, outs)):
            io.bind_input(f"x.{i}", self.device, self.device_id, self.dtype.type, list(x.shape), x.ptr)
            io.bind_output(f"y.{i}", self.device, self.device_id, self.dtype.type, list(y.shape), y.ptr)
        io.bind_cpu_input("pads", pads)
        sess.run_with_iobinding(io)

    def concat(self, a: DeviceArray, b: DeviceArray, axis: int) -> DeviceArray:
        return self._run(f"concat{axis}", a=a, b=b)

    def pad_cols(self, x: DeviceArray, n: int) -> DeviceArray:
        """n zero columns (axis 2) in front."""
        return self._run("pad", x=x, pads=np.array([0, 0, n, 0, 0, 0, 0, 0], np.int64)) if n else x

    def cols(self, x: DeviceArray, z: int) -> DeviceArray:
        """Columns z.. (axis 2), a copy."""
        return self._run("cols", x=x, z=np.array([z], np.int64), end=np.array([x.shape[2]], np.int64),
                         axis=np.array([2], np.int64))

    @staticmethod
    def at(x: DeviceArray, i: int, shape) -> DeviceArray:
        return x.at(i, shape)

    def append_slots(self, p: DeviceArray, x: DeviceArray) -> DeviceArray:
        """p (Q, kv, T, d) and the L slots x (L, Q, kv, 1, d) as its next columns: (Q, kv, T + L, d)."""
        return self._run("append_slots", p=p, x=x)
