"""The decode graph's attention against ONNX Runtime's own decode attention ops, one decode step of all
layers at the paper setting (checked before writing our own).

Arms, each one ONNX graph of L attention layers (distinct K/V per layer, so the caches are as
cold as in a real step), the projections left out (the same in every arm):
  prefix `export/prefix_graph.attend` (what decode.onnx runs): the request's context once (here
         two masked columns), each beam's prefix once, (b, kv, T, d), and each row's chunk,
         slot-major, its `used` decoded slots bound (used, b, kv, s, d); plain ONNX ops
  dmmha  com.microsoft.DecoderMaskedMultiHeadAttention with cache_indirection: one cache row per
         candidate, (N, H, max_len, d), written in place (past and present share one buffer
         through IO binding), each row reading its ancestors' positions through the indirection
         table; one batch of N beams so that any candidate can read any row
  mha    com.microsoft.MultiHeadAttention on the row layout (what `export/fuse.py` gives
         model.onnx): past (N, H, T + used, d) in, past + new out, a new buffer every step

Before timing, the dmmha arm is checked against the prefix arm on the same data (the indirection points
each row's prefix positions at the row that holds its beam's prefix): the outputs must agree.

    python -m benchmarks.attention [--layers 36 --heads 20 --head-dim 64 --beams 7
        --candidates 10 --prefix 47 --max-len 92 --chunk 5 --used 2] [--arms prefix,dmmha,mha] [--out FILE.json]

The prefix arm's graph is built by the checkout's own `attend`: `--arms prefix` run at two commits, in
turns, times a change to it.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from dbs_fast.bench.machine import machine
from dbs_fast.export.timing import median_run, median_seconds

K_CHUNK, USED = 5, 2        # chunk length k and the tokens of it already decoded
ARMS = ("prefix", "dmmha", "mha")


def _data(L, H, d, b, s, T, K=K_CHUNK, used=USED, seed=0):
    rng = np.random.default_rng(seed)
    N = b * s
    f = lambda *shape: rng.standard_normal(shape).astype(np.float32)   # noqa: E731
    return {"q": f(N, H, d), "k": f(N, H, d), "v": f(N, H, d),
            "pk": [f(b, H, T, d) for _ in range(L)], "pv": [f(b, H, T, d) for _ in range(L)],
            "ck": [f(N, H, K, d) for _ in range(L)], "cv": [f(N, H, K, d) for _ in range(L)], "used": used}


def prefix_session(x, path: Path, threads):
    import torch

    from dbs_fast.export.prefix_graph import (
        MASKED,
        Biases,
        Dims,
        attend,
        block_biases,
        joint_bias,
    )
    from dbs_fast.runtime import make_session

    L = len(x["pk"])
    scale = 1.0 / np.sqrt(x["q"].shape[-1])

    (b, H, T, d), N, U = x["pk"][0].shape, x["q"].shape[0], x["used"]
    C = 2              # one request's context, the third level, masked: the same keys as the other arms
    dims = Dims(N, 1, b, N // b, T, U, 1, b, C, H, H, d)

    class Layers(torch.nn.Module):
        def forward(self, q, k, v, xbias, pbias, cbias, nbias, beams, slot, *kv):
            q, k, v = q[:, None], k[:, None], v[:, None]
            biases = joint_bias(Biases(xbias, pbias, cbias, nbias, beams, slot))
            return tuple(attend(q, k, v, *kv[6 * i:6 * i + 6], biases, float(scale), dims)[0] for i in range(L))

    cmask = np.ones((N, U), np.int64)                 # the decoded slots, as a step binds them
    cbias, nbias = (t.numpy() for t in block_biases(torch.from_numpy(cmask), torch.ones(N, 1, 1, dtype=torch.bool), dims))
    feed = {"q": x["q"], "k": x["k"], "v": x["v"], "xbias": np.full((1, 1, 1, C), MASKED, np.float32),
            "pbias": np.zeros((b, 1, 1, T), np.float32), "cbias": cbias, "nbias": nbias,
            "beams": np.arange(b)[None], "slot": np.arange(b)}
    ctx = np.random.default_rng(1).standard_normal((2 * L, 1, H, C, d)).astype(np.float32)
    slots = lambda c: np.ascontiguousarray(c[:, :, :U].reshape(b, -1, H, U, d).transpose(3, 0, 2, 1, 4))  # noqa: E731
    for i in range(L):
        feed.update({f"xk{i}": ctx[2 * i], f"xv{i}": ctx[2 * i + 1], f"pk{i}": x["pk"][i], f"pv{i}": x["pv"][i],
                     f"ck{i}": slots(x["ck"][i]),
                     f"cv{i}": slots(x["cv"][i])})
    names = list(feed)
    with torch.no_grad():
        torch.onnx.export(Layers(), tuple(torch.from_numpy(feed[n]) for n in names), str(path), input_names=names,
                          output_names=[f"o{i}" for i in range(L)], opset_version=17, dynamo=False)
    return make_session(path, "cpu", threads), feed


def _contrib_graph(op: str, L: int, H: int, path: Path, **attrs):
    import onnx
    from onnx import TensorProto, helper

    F, I32 = TensorProto.FLOAT, TensorProto.INT32
    ins = [helper.make_tensor_value_info(n, F, None) for n in ("q", "k", "v")]
    nodes, outs = [], []
    if op == "DecoderMaskedMultiHeadAttention":
        ins += [helper.make_tensor_value_info(n, I32, None) for n in ("past_len", "beam_width", "indir")]
    else:
        ins += [helper.make_tensor_value_info("mask", I32, None)]
    for i in range(L):
        ins += [helper.make_tensor_value_info(f"pk{i}", F, None), helper.make_tensor_value_info(f"pv{i}", F, None)]
        o = [f"o{i}", f"presk{i}", f"presv{i}"]
        if op == "DecoderMaskedMultiHeadAttention":
            inputs = ["q", "k", "v", "", "", f"pk{i}", f"pv{i}", "past_len", "beam_width", "indir"]
        else:
            inputs = ["q", "k", "v", "", "mask", "", f"pk{i}", f"pv{i}"]
        nodes.append(helper.make_node(op, inputs, o, domain="com.microsoft", num_heads=H, **attrs))
        outs += [helper.make_tensor_value_info(n, F, None) for n in o]
    g = helper.make_graph(nodes, op, ins, outs)
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)],
                                ir_version=8), str(path))


def dmmha_run(x, path: Path, threads, max_len: int):
    """Session + a run function over IO binding: past and present bound to the same buffers."""
    import onnxruntime as ort

    from dbs_fast.runtime import make_session

    L, (b, H, T, d) = len(x["pk"]), x["pk"][0].shape
    N = x["q"].shape[0]
    s, used = N // b, x["used"]
    _contrib_graph("DecoderMaskedMultiHeadAttention", L, H, path, past_present_share_buffer=1)
    sess = make_session(path, "cpu", threads)
    # row r holds its own chunk at positions T..T+used-1; row (r // s) * s also holds beam r // s's
    # prefix at 0..T-1; the indirection sends every row's prefix positions to that row
    indir = np.zeros((1, N, max_len), np.int32)
    indir[0, :, :T] = (np.arange(N) // s * s)[:, None]
    indir[0, :, T:] = np.arange(N)[:, None]
    bufs = []
    for i in range(L):
        for pre, ch in ((x["pk"][i], x["ck"][i]), (x["pv"][i], x["cv"][i])):
            buf = np.zeros((N, H, max_len, d), np.float32)
            buf[::s, :, :T] = pre
            buf[:, :, T:T + used] = ch[:, :, :used]
            bufs.append(ort.OrtValue.ortvalue_from_numpy(buf))
    io = sess.io_binding()
    flat = lambda a: np.ascontiguousarray(a.reshape(N, 1, H * d))       # noqa: E731
    for n in ("q", "k", "v"):
        io.bind_cpu_input(n, flat(x[n]))
    io.bind_cpu_input("past_len", np.array([T + used], np.int32))
    io.bind_cpu_input("beam_width", np.array([N], np.int32))
    io.bind_cpu_input("indir", indir)
    for i in range(L):
        for j, kind in enumerate("kv"):
            v = bufs[2 * i + j]
            io.bind_ortvalue_input(f"p{kind}{i}", v)
            io.bind_ortvalue_output(f"pres{kind}{i}", v)
        io.bind_output(f"o{i}")

    def run():
        sess.run_with_iobinding(io)
        return io.copy_outputs_to_cpu()[2::3]          # bound per layer: present k, present v, o
    return run, sum(v.numpy().nbytes for v in bufs)


def mha_session(x, path: Path, threads):
    from dbs_fast.runtime import make_session

    L, (b, H, T, d) = len(x["pk"]), x["pk"][0].shape
    N = x["q"].shape[0]
    s, used = N // b, x["used"]
    _contrib_graph("MultiHeadAttention", L, H, path)
    feed = {n: np.ascontiguousarray(x[n].reshape(N, 1, H * d)) for n in ("q", "k", "v")}
    feed["mask"] = np.ones((N, T + used + 1), np.int32)
    for i in range(L):
        for kind, pre, ch in (("k", x["pk"][i], x["ck"][i]), ("v", x["pv"][i], x["cv"][i])):
            feed[f"p{kind}{i}"] = np.concatenate([np.repeat(pre, s, axis=0), ch[:, :, :used]], axis=2)
    return make_session(path, "cpu", threads), feed


def run(layers=36, heads=20, head_dim=64, beams=7, candidates=10, prefix=47, max_len=92, repeats=10,
        threads=None, chunk=K_CHUNK, used=USED, arms=ARMS) -> dict:
    x = _data(layers, heads, head_dim, beams, candidates, prefix, chunk, used)
    N = beams * candidates
    out = {"machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M %Z"),
           "shape": {"layers": layers, "heads": heads, "head_dim": head_dim, "beams": beams,
                     "candidates": candidates, "prefix": prefix, "chunk": chunk, "chunk_used": used,
                     "max_len": max_len}, "arms": {}}
    diff = lambda got: max(float(np.abs(got[i].reshape(N, -1) - ref[i].reshape(N, -1)).max())  # noqa: E731
                           for i in range(layers))
    with tempfile.TemporaryDirectory() as d:
        sess, feed = prefix_session(x, Path(d) / "prefix.onnx", threads)
        ref = sess.run(None, feed)
        if "prefix" in arms:
            out["arms"]["prefix"] = {"ms": 1e3 * median_run(sess, feed, repeats),
                                 "kv_bytes": sum(a.nbytes for k in ("pk", "pv", "ck", "cv") for a in x[k])}
        del sess
        if "dmmha" in arms:
            dm, nbytes = dmmha_run(x, Path(d) / "dmmha.onnx", threads, max_len)
            got = dm()
            out["arms"]["dmmha"] = {"ms": 1e3 * median_seconds(dm, repeats), "kv_bytes": nbytes,
                                    "max_abs_diff_vs_prefix": diff(got)}
        if "mha" in arms:
            sess, feed = mha_session(x, Path(d) / "mha.onnx", threads)
            got = sess.run([f"o{i}" for i in range(layers)], feed)
            out["arms"]["mha"] = {"ms": 1e3 * median_run(sess, feed, repeats),
                                  "kv_bytes": sum(feed[f"p{k}{i}"].nbytes for k in "kv" for i in range(layers)),
                                  "max_abs_diff_vs_prefix": diff(got)}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("layers", 36), ("heads", 20), ("head-dim", 64), ("beams", 7), ("candidates", 10),
                          ("prefix", 47), ("max-len", 92), ("repeats", 10), ("threads", None)):
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--chunk", type=int, default=K_CHUNK, help="chunk slots K in the prefix graph's input")
    ap.add_argument("--used", type=int, default=USED, help="of them, tokens already decoded")
    ap.add_argument("--arms", default=",".join(ARMS), help="comma-separated, of " + ", ".join(ARMS))
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    arms = tuple(a.arms.split(","))
    if not set(arms) <= set(ARMS):
        ap.error(f"--arms: choose from {', '.join(ARMS)}")
    if not 0 < a.used < a.chunk:
        ap.error("need 0 < --used < --chunk")
    r = run(a.layers, a.heads, a.head_dim, a.beams, a.candidates, a.prefix, a.max_len, a.repeats, a.threads,
            a.chunk, a.used, arms)
    print(f"{r['machine']}, {r['date']}: one decode step's attention, {a.layers} layers, "
          f"{a.beams}x{a.candidates} rows, prefix {a.prefix}")
    for name, arm in r["arms"].items():
        extra = f", max |diff| vs prefix {arm['max_abs_diff_vs_prefix']:.1e}" if "max_abs_diff_vs_prefix" in arm else ""
        print(f"  {name:6s} {arm['ms']:7.1f} ms   KV held {arm['kv_bytes'] / 1e6:7.1f} MB{extra}")
    if a.out:
        Path(a.out).write_text(json.dumps(r, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
