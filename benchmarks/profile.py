"""Where a decode step of the decode graph spends its time: ONNX Runtime's profiler on
`decode.onnx` at the paper setting (b beams x s candidates, prefix length T, 2 chunk tokens in),
summed by operator type. Random K/V and token ids: the cost does not depend on the values.

    python -m benchmarks.profile --model DIR [--beams 7 --candidates 10 --prefix 47]

Prints ms per step by operator (median step time without the profiler first) and writes the
same as JSON with --out. On the CPU it also prints the step outside its weight matmuls: the median
step less the profiled time (less the profiler's cost, below) of the matrix products whose second
operand comes from the model file (MatMul, Gemm, MatMulNBits and their fused forms; a Q4_1 weight's
min term is one), not those of the attention's scores and values.

With `--provider cuda` the step runs on ORT's CUDA provider with its inputs and outputs bound on the
GPU (as the engine's cache is), and the result adds the graph as ORT runs it there: its nodes by
operator and by provider, the host<->GPU copies ORT inserted (`Memcpy*`), and the step's milliseconds
per node. A node's profiled time on the GPU is its launch on the host, not its kernel.

ORT's profiler records each node's kernel time with its own cost inside it: on a chain of tiny
nodes timed with and without the profiler (2-core Zen 2, 2026-11-25, a one-off probe), a Reshape that costs 0.6 us
was recorded as 9 us, a Relu of 70 x 8 floats (0.5 us) as 6 us, an Add of 70 x 576 (7.6 us) as
14 us. A decode step has ~2,000 such nodes, so the raw profile puts 10-15 ms into operators that
do nothing measurable (the default's 578 Reshapes: 5.7 ms profiled, ~0.3 ms real). So the same
run measures that cost per node (`profiler_overhead_us`: a chain of tiny Relus, recorded minus
unprofiled) and each operator's `ms_less_overhead` is its profiled time less nodes x that cost,
floored at 0: an estimate, with the overhead varying by a few us from node to node.
"""
from __future__ import annotations

import argparse
import collections
import itertools
import json
import statistics
import tempfile
import time
from pathlib import Path

from dbs_fast.bench.machine import machine
from dbs_fast.export.timing import feeds, median_run, median_seconds


def _session(model, threads: int | None, prof_dir: str | None = None, optimize: bool = True,
             provider: str = "cpu", optimized: Path | None = None, dims: dict | None = None,
             cuda_graph: bool = False):
    """An ORT session of `model` (a path or serialized bytes) on `provider`, profiling into `prof_dir`
    if given and writing the graph as ORT optimized it to `optimized` if given; `optimize=False` keeps
    the graph as it is (ORT's default options otherwise, which spin). `dims`: the graph's named
    dimensions fixed (free-dimension overrides: ORT folds the shape arithmetic); `cuda_graph`: ORT
    captures the run as one CUDA graph (`enable_cuda_graph`)."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    for name, value in (dims or {}).items():
        so.add_free_dimension_override_by_name(name, int(value))
    if not optimize:
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    if threads:
        so.intra_op_num_threads = threads
    so.enable_profiling = prof_dir is not None
    if prof_dir is not None:
        so.profile_file_prefix = str(Path(prof_dir) / "p")
    if optimized is not None:                            # weights beside it: a graph over 2 GB cannot be one file
        so.optimized_model_filepath = str(optimized)
        so.add_session_config_entry("session.optimized_model_external_initializers_file_name", "weights.bin")
        so.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
    providers = ["CPUExecutionProvider"]
    if provider == "cuda":
        if "CUDAExecutionProvider" not in ort.get_available_providers():
            raise SystemExit(f"--provider cuda: this onnxruntime ({ort.__version__}) has no CUDA provider")
        if hasattr(ort, "preload_dlls"):
            ort.preload_dlls()
        providers = [("CUDAExecutionProvider", {"enable_cuda_graph": "1"}) if cuda_graph else "CUDAExecutionProvider",
                     "CPUExecutionProvider"]
    return ort.InferenceSession(model if isinstance(model, bytes) else str(model), so, providers=providers)


def _runner(sess, x: dict, provider: str, outputs: list | None = None):
    """One run of `sess` on `x`: on the CUDA provider with inputs and outputs bound on the GPU (copied
    up once), so a run times the graph and not the transfers. `outputs` (the outputs' arrays of a
    run): each output bound to a buffer of that shape allocated once, as a captured CUDA graph needs."""
    if provider != "cuda":
        return lambda: sess.run(None, x)
    import onnxruntime as ort

    binding = sess.io_binding()
    for name, v in x.items():
        binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(v, "cuda", 0))
    for o, like in zip(sess.get_outputs(), outputs or [None] * len(sess.get_outputs())):
        if like is None:
            binding.bind_output(o.name, "cuda", 0)
        else:
            binding.bind_ortvalue_output(o.name, ort.OrtValue.ortvalue_from_numpy(like, "cuda", 0))
    if outputs is None:
        return lambda: sess.run_with_iobinding(binding)
    ro = ort.RunOptions()
    ro.add_run_config_entry("gpu_graph_id", "1")
    return lambda: sess.run_with_iobinding(binding, ro)


def fixed_dims(sess, x: dict) -> dict:
    """The graph's named dimensions at the sizes of the feeds `x`."""
    dims = {}
    for i in sess.get_inputs():
        for d, n in zip(i.shape, x[i.name].shape):
            if isinstance(d, str):
                dims[d] = int(n)
    return dims


def _profiled_events(model, x: dict, repeats: int, threads: int | None, optimize: bool = True,
                     provider: str = "cpu", dims: dict | None = None) -> list[dict]:
    """The profiler's events of 1 + `repeats` runs of `model` on `x` (the first is cold)."""
    with tempfile.TemporaryDirectory() as d:
        sess = _session(model, threads, d, optimize, provider, dims=dims)
        run = _runner(sess, x, provider)
        for _ in range(1 + repeats):
            run()
        return json.loads(Path(sess.end_profiling()).read_text())


def placement(graph: Path, threads: int | None, provider: str, dims: dict | None = None) -> dict:
    """The graph as ORT runs it on `provider` (with `dims` fixed, if given): its nodes by operator, the
    host<->device copies ORT inserted around nodes left to the CPU, and the names of its weight
    matmuls (`weight_matmuls`) (the optimized graph, written out and read back)."""
    import onnx

    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "optimized.onnx"
        _session(graph, threads, provider=provider, optimized=out, dims=dims)
        optimized = onnx.load(str(out), load_external_data=False).graph
    ops = collections.Counter(n.op_type for n in _nodes(optimized))
    raw = onnx.load(str(graph), load_external_data=False).graph
    layers = sum(i.name.startswith("prefix.") for i in raw.input) // 2
    nodes = sum(ops.values())
    return {"nodes": nodes, "layers": layers, "nodes_per_layer": nodes / max(1, layers),
            "memcpy_nodes": sum(n for op, n in ops.items() if op.startswith("Memcpy")),
            "by_operator": dict(ops.most_common()), "weight_matmuls": sorted(weight_matmuls(optimized))}


def _bodies(node):
    """The graphs a node holds (an If's branches, a Loop's or a Scan's body)."""
    for a in node.attribute:
        yield from ([a.g] if a.HasField("g") else []) + list(a.graphs)


def _nodes(graph):
    """Every node of `graph`, those inside its If, Loop and Scan bodies too."""
    for n in graph.node:
        yield n
        for g in _bodies(n):
            yield from _nodes(g)


# the operators that multiply by a matrix: ONNX's, and the fused and quantized forms ORT rewrites them to
MATMULS = ("MatMul", "Gemm", "MatMulNBits", "FusedMatMul", "FusedGemm", "MatMulInteger", "MatMulIntegerToFloat",
           "DynamicQuantizeMatMul", "QGemm")


def weight_matmuls(graph, weights: frozenset = frozenset()) -> set[str]:
    """The names of `graph`'s weight matmuls: its matrix products whose second operand is a weight
    of the model file (an initializer or a Constant, of the graph or of a graph it is a branch of),
    not a tensor of the step (the attention's scores and values)."""
    weights = weights | {i.name for i in graph.initializer} | \
        {o for n in graph.node if n.op_type == "Constant" for o in n.output}
    names = set()
    for n in graph.node:
        if n.op_type in MATMULS and len(n.input) > 1 and n.input[1] in weights:
            names.add(n.name)
        for g in _bodies(n):
            names |= weight_matmuls(g, weights)
    return names


def profile(graph: Path, b: int, s: int, T: int, repeats: int, threads: int | None, provider: str = "cpu",
            context: int | None = None, context_level: bool = False, fixed: bool = False,
            cuda_graph: bool = False) -> dict:
    """`context`: that many context columns before the T prefix tokens (default: export/timing's few);
    `context_level`: the context as a level of its own however short (else as the engine keeps it);
    `fixed`: the graph's dimensions fixed at the step's sizes, as a bucket's session has them
    (`dbs_fast.kv.buckets`); `cuda_graph` (CUDA, fixed): the step replayed as one captured CUDA graph."""
    plain = _session(graph, threads, provider=provider)
    fold = 0 if context_level else None
    x = feeds(plain, b, s, T, fold=fold) if context is None else feeds(plain, b, s, context + T, C=context, fold=fold)
    dims = fixed_dims(plain, x) if fixed or cuda_graph else None
    step_dynamic = None
    if dims is not None:                           # the same step at fixed shapes, beside the dynamic one
        step_dynamic = median_seconds(_runner(plain, x, provider), repeats)
        outputs = plain.run(None, x) if cuda_graph else None
        del plain
        plain = _session(graph, threads, provider=provider, dims=dims, cuda_graph=cuda_graph)
        run = _runner(plain, x, provider, outputs)
        for _ in range(3):                         # a graph is captured at its first runs
            run()
        step = median_seconds(run, repeats)
    else:
        step = median_seconds(_runner(plain, x, provider), repeats)
    del plain
    if cuda_graph:                                 # a replayed graph has no nodes for the profiler to record
        r = {"machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M %Z"), "graph": str(graph),
             "provider": provider, "beams": b, "candidates": s, "prefix": T, "context": context, "dims": dims,
             "cuda_graph": True, "step_ms_median": 1e3 * step, "step_ms_dynamic": 1e3 * step_dynamic, "ops": []}
        r["placement"] = placement(graph, threads, provider, dims)
        return r
    events = _profiled_events(graph, x, repeats, threads, provider=provider, dims=dims)
    dur, count = by_operator(events, skip=1)
    total = sum(dur.values())
    over = profiler_overhead_us(threads) if provider == "cpu" else 0.0
    ops = [{"op": op, "ms_per_step": us / repeats / 1e3, "share": us / total, "nodes_per_step": count[op] / repeats,
            "ms_less_overhead": max(0.0, us - over * count[op]) / repeats / 1e3}
           for op, us in dur.most_common()]
    r = {"machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M %Z"), "graph": str(graph), "provider": provider,
         "beams": b, "candidates": s, "prefix": T, "context": context, "step_ms_median": 1e3 * step,
         "profiled_ms_per_step": total / repeats / 1e3, "profiler_overhead_us": over,
         "ms_less_overhead_per_step": sum(o["ms_less_overhead"] for o in ops), "ops": ops}
    r["nodes_run_per_step"] = sum(o["nodes_per_step"] for o in ops)     # an If's branch not taken runs none
    r["placement"] = placement(graph, threads, provider, dims)
    if provider == "cpu":                          # a GPU node's profiled time is its launch, not its kernel
        matmuls = set(r["placement"]["weight_matmuls"])
        us = [e["dur"] for e in _warm_nodes(events, skip=1) if e["name"].removesuffix("_kernel_time") in matmuls]
        r["weight_matmul_ms_per_step"] = max(0.0, sum(us) - over * len(us)) / repeats / 1e3
        r["outside_weight_matmuls_ms"] = r["step_ms_median"] - r["weight_matmul_ms_per_step"]
    if dims is not None:
        r["dims"], r["step_ms_dynamic"] = dims, 1e3 * step_dynamic
    r["step_us_per_node"] = 1e3 * r["step_ms_median"] / max(1, r["placement"]["nodes"])
    if provider == "cuda":
        nodes = collections.Counter(e["args"].get("provider", "?") for e in _warm_nodes(events, skip=1))
        r["nodes_per_step_by_provider"] = {p: n / repeats for p, n in nodes.items()}
    return r


def profiler_overhead_us(threads: int | None, nodes: int = 400, repeats: int = 7) -> float:
    """ORT's profiler's own cost per node, as it shows in the node's recorded kernel time: a chain
    of `nodes` Relus on 70 x 8 floats (work well under 1 us each) run with and without the profiler;
    the recorded median kernel time less the unprofiled time per node."""
    import numpy as np
    from onnx import TensorProto, helper

    names = ["x"] + [f"y{i}" for i in range(nodes)]
    g = helper.make_graph([helper.make_node("Relu", [a], [z]) for a, z in itertools.pairwise(names)], "chain",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [70, 8])],
                          [helper.make_tensor_value_info(names[-1], TensorProto.FLOAT, [70, 8])])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8).SerializeToString()
    x = {"x": np.ones((70, 8), np.float32)}
    plain = median_run(_session(model, threads, optimize=False), x, repeats) / nodes * 1e6   # keep the chain
    rec = [e["dur"] for e in _warm_nodes(_profiled_events(model, x, repeats, threads, optimize=False), skip=1)]
    return max(0.0, statistics.median(rec) - plain)


def _warm_nodes(events: list[dict], skip: int) -> list[dict]:
    """The node kernel-time events of the profiled runs after the first `skip`."""
    runs = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name") == "model_run")[skip:]
    return [e for e in events if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")
            and any(a <= e["ts"] <= b for a, b in runs)]


def by_operator(events: list[dict], skip: int = 1) -> tuple[collections.Counter, collections.Counter]:
    """Microseconds and node count by operator over the profiled runs after the first `skip`.
    A session's first run is cold (buffers first touched, kernels' first calls): counted in, it
    put 55 ms of FastGelu into a 615 ms GPT-2-large fp32 step whose later runs spend 4.5 ms there."""
    dur, count = collections.Counter(), collections.Counter()
    for e in _warm_nodes(events, skip):
        dur[e["args"]["op_name"]] += e["dur"]
        count[e["args"]["op_name"]] += 1
    return dur, count


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="an export with decode.onnx")
    ap.add_argument("--beams", type=int, default=7)
    ap.add_argument("--candidates", type=int, default=10)
    ap.add_argument("--prefix", type=int, default=47, help="prefix length T (47: the middle of the paper's run)")
    ap.add_argument("--context", type=int, default=None, help="context tokens before the prefix (default: a few)")
    ap.add_argument("--context-level", action="store_true",
                    help="the context as a level of its own however short (default: as the engine keeps it: "
                         "in the beams' prefixes up to FOLD_CONTEXT tokens)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--provider", default="cpu", choices=["cpu", "cuda"],
                    help="cuda: ORT's CUDA provider, inputs and outputs bound on the GPU (onnxruntime-gpu)")
    ap.add_argument("--fixed-shapes", action="store_true",
                    help="the graph's dimensions fixed at the step's sizes, as a bucket's session has them (ORT folds "
                         "the shape arithmetic); the dynamic step's time beside it")
    ap.add_argument("--cuda-graph", action="store_true",
                    help="with --provider cuda: fixed shapes, the step replayed as one captured CUDA graph (its time "
                         "and the graph's nodes; no per-node profile)")
    ap.add_argument("--out", default=None, help="write the result as JSON here")
    a = ap.parse_args(argv)
    graph = Path(a.model) / "decode.onnx"
    if not graph.is_file():
        ap.error(f"{graph} not found: export the model with this version (`dbs-fast export`)")
    if a.cuda_graph and a.provider != "cuda":
        ap.error("--cuda-graph needs --provider cuda")
    r = profile(graph, a.beams, a.candidates, a.prefix, a.repeats, a.threads, a.provider, a.context, a.context_level,
                a.fixed_shapes, a.cuda_graph)
    if a.cuda_graph:
        pl = r["placement"]
        print(f"{graph}: {r['step_ms_median']:.2f} ms per step replayed as one CUDA graph, against "
              f"{r['step_ms_dynamic']:.2f} ms dynamic; {pl['nodes']} nodes at fixed shapes, "
              f"{pl['nodes_per_layer']:.1f} per layer, {pl['memcpy_nodes']} host<->GPU copies")
        if a.out:
            Path(a.out).write_text(json.dumps(r, indent=2))
        return 0
    if "dims" in r:
        print(f"fixed shapes {r['dims']}: {r['step_ms_median']:.1f} ms per step against {r['step_ms_dynamic']:.1f} "
              f"ms with the dimensions dynamic")
    print(f"{graph}: {r['step_ms_median']:.1f} ms per step (median, no profiler); by operator: profiled "
          f"{r['profiled_ms_per_step']:.1f} ms, less the profiler's {r['profiler_overhead_us']:.1f} us per node "
          f"{r['ms_less_overhead_per_step']:.1f} ms")
    for o in r["ops"][:15]:
        print(f"  {o['op']:28s} {o['ms_per_step']:7.1f} ms  {100 * o['share']:5.1f}%  {o['nodes_per_step']:5.0f} nodes"
              f"  less overhead {o['ms_less_overhead']:7.1f} ms")
    pl = r["placement"]
    if "outside_weight_matmuls_ms" in r:
        print(f"  weight matmuls ({len(pl['weight_matmuls'])} nodes whose weights come from the model file) "
              f"{r['weight_matmul_ms_per_step']:.2f} ms less overhead; the step outside them "
              f"{r['outside_weight_matmuls_ms']:.2f} ms")
    print(f"  on {a.provider}: {pl['nodes']} nodes after ORT's optimization, {pl['nodes_per_layer']:.1f} per layer "
          f"({pl['layers']} layers; the step's shared nodes and both branches of an If counted in), "
          f"{r['nodes_run_per_step']:.0f} run in this step, {pl['memcpy_nodes']} host<->GPU copies, "
          f"{r['step_us_per_node']:.2f} us of the step per node"
          + ("; nodes run by provider: " + ", ".join(f"{p} {n:.0f}" for p, n in r["nodes_per_step_by_provider"].items())
             if "nodes_per_step_by_provider" in r else ""))
    print("  optimized graph by operator: " + ", ".join(f"{op} {n}" for op, n in list(pl["by_operator"].items())[:20]))
    if a.out:
        Path(a.out).write_text(json.dumps(r, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
