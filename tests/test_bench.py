"""The benchmark's code paths at toy size: every contender runs, the report has every field.
No timing assertions: the benchmark reports speed, the tests check behaviour."""
import json
from pathlib import Path

import pytest

from dbs_fast.cli import main as cli

pytest.importorskip("optimum.exporters.onnx")
pytest.importorskip("matplotlib")


def _work_with_fp32_export(tmp_path, exported) -> Path:
    """The bench's work folder holding the fp32 export it makes of the tiny GPT-2 (the same
    `export_model` on the same checkpoint), copied from the session's rather than made again."""
    import shutil

    work = tmp_path / "work"
    shutil.copytree(exported["gpt2"], work / "onnx" / "gpt2-fp32")
    return work


@pytest.mark.integration
def test_bench_on_a_tiny_model(checkpoints, exported, tmp_path):
    from dbs_fast.bench.suite import DEFAULT_CONTENDERS, STAGES, run_bench

    out = tmp_path / "out"
    rep = run_bench(out, _work_with_fp32_export(tmp_path, exported), max_new_tokens=5, repeats=2, checkpoint=checkpoints["gpt2"],
                    with_default=False, sweep=[(1, 2)], reference_candidates=1, kernel_repeats=1)
    on_disk = json.loads((out / "bench.json").read_text())
    assert on_disk["points"].keys() == rep["points"].keys() == {"gpt2"}
    for f in ("bench.md", "stages.png", "sweep.png"):
        assert (out / f).stat().st_size > 0
    k = on_disk["kernel"]
    assert k["numba_equals_numpy"] and k["numba"]["ms_median"] > 0 and "speedup_vs_torch" in k
    point = on_disk["points"]["gpt2"]
    roof = point["roofline"]
    for key in ("fp32_step_seconds", "int8_step_seconds", "fp32_gflops", "int8_gflops", "memory_bandwidth_gbs"):
        assert roof[key] > 0
    assert set(point["contenders"]) == set(DEFAULT_CONTENDERS)
    for c, r in point["contenders"].items():
        assert "error" not in r, r
        assert r["peak_rss_bytes"] > 0 and r["cold_start_seconds"] > 0
        if c == "reference":
            assert r["measured_tokens"] == 5 and r["seconds_per_candidate_token"] > 0
            assert r["extrapolated_seconds_per_generation"] > r["measured_seconds"]
            continue
        assert r["seconds_min"] <= r["seconds_median"] <= r["seconds_max"] and r["repeats"] == 2
        assert set(STAGES) <= set(r["stage_ms_per_step"]) and r["candidate_tokens_per_second"] > 0
        assert 0.0 <= r["success_rate"] <= 1.0 and all(isinstance(t, str) and t for t in r["texts"])
        if c.startswith("onnx"):          # the sweep: time and KV bytes per layout
            assert [p["rows"] for p in r["sweep"]] == [2] and r["sweep"][0]["kv_cache_bytes"] > 0
            assert len(r["same_load_matmul_seconds"]) == 2 and min(r["same_load_matmul_seconds"]) > 0
            assert point["ratios"][f"{c}_step_vs_roofline_same_load"] > 0
            assert r["kv_layout"] == ("rows" if c.endswith("-rows") else "prefix")
        else:
            assert not r.get("same_load_matmul_seconds")
    # the prefix-cache contenders and PyTorch took turns (ABC CBA), loaded together; the row layouts after
    turns = point["in_turns"]
    assert turns == ["onnx-fp32", "onnx-int8", "onnx-fp32-plain", "torch-fp32"]
    started = sorted((t, c, i) for c in turns for i, t in enumerate(point["contenders"][c]["started_unix"]))
    assert [(c, i) for _, c, i in started] == [(c, 0) for c in turns] + [(c, 1) for c in turns[::-1]]
    last = max(t for t, _, _ in started)
    assert all(min(point["contenders"][c]["started_unix"]) > last for c in ("onnx-fp32-rows", "onnx-int8-rows"))
    fp32, rows = point["contenders"]["onnx-fp32"], point["contenders"]["onnx-fp32-rows"]
    assert fp32["texts"] == rows["texts"] and fp32["kv_cache_bytes"] > 0 and rows["kv_cache_bytes"] > 0
    # the plain schedule: the same texts, every row computed; the distinct one computed fewer
    plain = point["contenders"]["onnx-fp32-plain"]
    assert plain["texts"] == fp32["texts"] and plain["model_rows_ratio"] == 1.0 > fp32["model_rows_ratio"] > 0
    # same seeds and keywords: the fp32 engine and the PyTorch baseline write the same text
    assert point["contenders"]["onnx-fp32"]["texts"] == point["contenders"]["torch-fp32"]["texts"]
    ratios = point["ratios"]
    for key in ("onnx-fp32_vs_torch", "onnx-int8_vs_torch", "onnx-fp32_vs_reference_per_candidate_token",
                "onnx-fp32_step_vs_roofline", "onnx-fp32_scheduling_share", "onnx-fp32_peak_vs_budget"):
        assert ratios[key] > 0
    # the figures agree with each other: a ratio is its two medians' quotient, the stages add up to
    # the step (two repeats: the median is the mean, so medians add), the scheduling share is its stages'
    torch = point["contenders"]["torch-fp32"]
    for c in ("onnx-fp32", "onnx-int8"):
        r = point["contenders"][c]
        assert ratios[f"{c}_vs_torch"] == pytest.approx(torch["seconds_median"] / r["seconds_median"])
    for c, r in point["contenders"].items():
        if c != "reference":
            st = r["stage_ms_per_step"]
            assert sum(st[s] for s in STAGES) == pytest.approx(r["step_ms"], rel=1e-6), c
            assert ratios[f"{c}_scheduling_share"] == pytest.approx(
                (st["kv_gather"] + st["python"] + st["text"] + st["quality"]) / r["step_ms"])
            assert 0 < r["candidate_tokens"] <= 7 * 5     # 5 tokens: one chunk of the b = 7 first beams
    assert "| onnx-int8 | prefix |" in (out / "bench.md").read_text()
    assert "| onnx-int8-rows | rows |" in (out / "bench.md").read_text()
    # what each graph call binds from host memory (on CUDA: copied across), the prefix-cache contenders
    assert all(point["contenders"][c]["host_mb_per_call"] > 0 for c in ("onnx-fp32", "onnx-int8"))
    assert on_disk["provider"] == "cpu" and point["contenders"]["onnx-fp32"]["provider"] == "cpu"
    # a CUDA run has no roofline (the bench's is ORT's CPU matmul): the report is written without it
    from dbs_fast import DBSConfig
    from dbs_fast.bench.suite import _ratios, markdown, plots

    on_disk["provider"] = "cuda"
    point["roofline"] = None
    _ratios(point, DBSConfig(**on_disk["config"]))
    assert "onnx-fp32_vs_torch" in point["ratios"] and not any("roofline" in k for k in point["ratios"])
    from dbs_fast.bench.suite import cpu_nodes_on_cuda

    for c, r in point["contenders"].items():    # what a CUDA worker records: the graph's nodes with no CUDA kernel
        if c.startswith("onnx"):
            r["cpu_nodes_on_cuda"] = cpu_nodes_on_cuda(r["model_dir"], r["kv_layout"], "onnx")
    assert point["contenders"]["onnx-fp32"]["cpu_nodes_on_cuda"] == {}
    assert cpu_nodes_on_cuda(point["contenders"]["onnx-fp32"]["model_dir"], "prefix", "torch") is None
    dynamic = point["models"].get("int8_method", "int8") == "int8"
    assert bool(point["contenders"]["onnx-int8"]["cpu_nodes_on_cuda"]) == dynamic
    md = markdown(on_disk)
    assert "Provider cuda: no roofline" in md and "host<->device MB per graph call: onnx-fp32" in md
    assert ("MatMulInteger nodes have no CUDA kernel and run on the CPU" in md) == dynamic
    plots(on_disk, tmp_path)


def test_a_driven_worker_that_fails_to_load_reports_its_error(tmp_path):
    from dbs_fast.bench.suite import KEYWORD_SETS, run_in_turns
    from dbs_fast.config import DBSConfig

    spec = {"point": "p", "contender": "onnx-fp32", "config": DBSConfig.paper().to_dict(), "keyword_sets": KEYWORD_SETS,
            "repeats": 1, "threads": 1, "model_dir": str(tmp_path / "missing"), "checkpoint": None, "sweep": []}
    r = run_in_turns([spec], tmp_path, repeats=1)["onnx-fp32"]
    assert r["contender"] == "onnx-fp32" and "worker exited 1" in r["error"] and "missing" in r["error"]
    assert list(tmp_path.iterdir()) == []                  # spec file removed, no half-written result


@pytest.mark.parametrize("args,msg", [(["--sweep", "7by10"], "--sweep"), (["--contenders", "tensorflow"], "unknown"),
                                      (["--repeats", "0"], ">= 1")])
def test_bench_bad_input_exits_2(args, msg, tmp_path, capsys):
    code = cli(["bench", "--no-default", "--tokenizer", str(tmp_path / "none"), "--workdir", str(tmp_path),
                "--out", str(tmp_path / "o"), *args])
    assert code == 2 and msg in capsys.readouterr().err


def test_attention_probe_arms_compute_the_same_attention(tmp_path):
    """`benchmarks/attention.py` at toy size: ORT's DecoderMaskedMultiHeadAttention (cache
    indirection, shared past/present buffer) and MultiHeadAttention (row layout) give the prefix cache's
    attention on the same data, so the probe compares like with like."""
    from benchmarks.attention import main as probe

    out = tmp_path / "a.json"
    assert probe(["--layers", "2", "--heads", "4", "--head-dim", "8", "--beams", "2", "--candidates", "3",
                  "--prefix", "5", "--max-len", "12", "--repeats", "1", "--out", str(out)]) == 0
    arms = json.loads(out.read_text())["arms"]
    assert set(arms) == {"prefix", "dmmha", "mha"}
    for name in ("dmmha", "mha"):
        assert arms[name]["max_abs_diff_vs_prefix"] < 1e-4 and arms[name]["ms"] > 0
    # one cache row per candidate up to max_len, against one prefix per beam + the chunks
    assert arms["dmmha"]["kv_bytes"] > arms["prefix"]["kv_bytes"]


def test_attention_probe_times_only_the_arms_asked_for(tmp_path, capsys):
    """`--arms prefix` (how a change to `attend` is timed at two commits) builds and times the prefix arm
    alone; an unknown arm is a usage error (exit 2), not a traceback."""
    from benchmarks.attention import main as probe

    out = tmp_path / "a.json"
    toy = ["--layers", "2", "--heads", "4", "--head-dim", "8", "--beams", "2", "--candidates", "3",
           "--prefix", "5", "--max-len", "12", "--repeats", "1"]
    assert probe(toy + ["--arms", "prefix", "--out", str(out)]) == 0
    arms = json.loads(out.read_text())["arms"]
    assert set(arms) == {"prefix"} and arms["prefix"]["ms"] > 0
    with pytest.raises(SystemExit) as e:
        probe(toy + ["--arms", "prefix,flash"])
    assert e.value.code == 2 and "--arms" in capsys.readouterr().err


def test_in_generation_probe_repeats_each_call_without_changing_the_text(exported, tmp_path):
    from benchmarks.in_generation import main as probe
    from dbs_fast import DirectedBeamSearch
    from dbs_fast.bench.suite import CONTEXT, KEYWORD_SETS
    from dbs_fast.config import DBSConfig

    out = tmp_path / "g.json"
    assert probe(["--model", str(exported["gpt2"]), "--max-new-tokens", "6", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["calls"] >= 6 and r["in_generation_ms"]["median"] > 0 and r["back_to_back_ms"]["median"] > 0
    plain = DirectedBeamSearch(str(exported["gpt2"]), config=DBSConfig.paper(max_new_tokens=6))
    assert r["text"] == plain.generate(CONTEXT, KEYWORD_SETS[1], seed=1).generated


def test_the_same_load_timer_answers_each_request_and_names_why_it_failed(exported, tmp_path):
    """The bench's same-load roofline child: one process answers every request with the step's
    matmul seconds; a child that cannot time (no export there) fails with its own error."""
    from dbs_fast.bench.suite import SameLoadTimer

    timer = SameLoadTimer(str(exported["gpt2"]), 6, False, 1)
    try:
        pid = timer.proc.pid
        assert timer.seconds() > 0 and timer.seconds() > 0 and timer.proc.pid == pid
    finally:
        timer.close()
    assert timer.proc.returncode == 0
    broken = SameLoadTimer(str(tmp_path / "nothing"), 6, False, 1)
    with pytest.raises(RuntimeError, match="same-load roofline failed.*config.json"):
        broken.seconds()
    broken.close()


@pytest.mark.integration
def test_the_gpu_contenders_run_on_a_tiny_model(checkpoints, exported, tmp_path):
    """The GPU's contenders, here on the CPU: the engine on the two fp16 exports (made from the fp32
    one: its decode graph float16 with the gathered and with the fused attention, model.onnx
    shared) on the prefix cache, the gathered one also at bucket shapes (the CUDA-graph path,
    uncaptured: the same texts), PyTorch in float16, taking turns; the ratios in the same dtype."""
    from dbs_fast.bench.suite import markdown, run_bench

    contenders = ["onnx-fp16", "onnx-fp16-fused", "onnx-fp16-graph", "torch-fp16"]
    rep = run_bench(tmp_path / "out", _work_with_fp32_export(tmp_path, exported), max_new_tokens=4, repeats=1, checkpoint=checkpoints["gpt2"],
                    with_default=False, sweep=[], kernel_repeats=1, contenders=contenders)
    point = rep["points"]["gpt2"]
    assert point["in_turns"] == contenders
    for c, form in (("onnx-fp16", "gathered"), ("onnx-fp16-fused", "fused"), ("onnx-fp16-graph", "gathered")):
        fp16 = point["contenders"][c]
        assert "error" not in fp16 and fp16["kv_layout"] == "prefix" and all(fp16["texts"])
        assert point["ratios"][f"{c}_vs_torch-fp16"] > 0
        m = json.loads((Path(point["models"][c]) / "dbs_fast_model.json").read_text())
        assert m["prefix_decode"]["dtype"] == "float16" and m["prefix_decode"]["attention"] == form
        same = Path(point["models"]["onnx-fp32"]) / "model.onnx"
        assert (Path(point["models"][c]) / "model.onnx").stat().st_size == same.stat().st_size
    assert "error" not in point["contenders"]["torch-fp16"]
    graph = point["contenders"]["onnx-fp16-graph"]
    assert graph["texts"] == point["contenders"]["onnx-fp16"]["texts"]
    assert graph["buckets"]["slot_graphs"] >= 1 and not graph["buckets"]["cuda_graph"]
    assert "onnx-fp16-graph: " in markdown(rep) and "bucket sessions" in markdown(rep)


def test_profile_counts_the_warm_runs_only(exported, tmp_path):
    from benchmarks.profile import by_operator
    from benchmarks.profile import main as probe

    def node(op, ts, dur):
        return {"cat": "Node", "name": f"{op}_kernel_time", "ts": ts, "dur": dur, "args": {"op_name": op}}
    runs = [{"name": "model_run", "ts": t, "dur": 100} for t in (0, 200, 400)]
    events = runs + [node("Gemm", 10, 90), node("Gemm", 210, 40), node("Add", 250, 5), node("Gemm", 410, 50)]
    dur, count = by_operator(events, skip=1)                # the cold first run (ts 0-100) left out
    assert dur == {"Gemm": 90, "Add": 5} and count == {"Gemm": 2, "Add": 1}

    out = tmp_path / "p.json"
    assert probe(["--model", str(exported["gpt2"]), "--beams", "2", "--candidates", "3", "--prefix", "5",
                  "--repeats", "2", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["step_ms_median"] > 0 and r["profiled_ms_per_step"] > 0
    assert sum(o["share"] for o in r["ops"]) == pytest.approx(1.0)
    assert {"MatMul", "Softmax"} <= {o["op"] for o in r["ops"]}
    # the profiler's own cost per node, measured on a chain of tiny nodes, taken off each operator
    over = r["profiler_overhead_us"]
    assert over > 0                                         # recorded kernel times include the profiler's own
    for o in r["ops"]:
        assert o["ms_less_overhead"] == pytest.approx(max(0.0, o["ms_per_step"] - over * o["nodes_per_step"] / 1e3))
    assert r["ms_less_overhead_per_step"] == pytest.approx(sum(o["ms_less_overhead"] for o in r["ops"]))
    # the weight matmuls are the products by the model file's weights (GPT-2's q/k/v, projections, MLP
    # and head), not the attention's products of scores and values
    assert len(r["placement"]["weight_matmuls"]) == 4 * r["placement"]["layers"] + 1
    assert 0 < r["weight_matmul_ms_per_step"] <= r["ms_less_overhead_per_step"]
    assert r["outside_weight_matmuls_ms"] == pytest.approx(r["step_ms_median"] - r["weight_matmul_ms_per_step"])
    # the dimensions fixed at the step's sizes (a bucket's session): ORT folds the shape arithmetic
    assert probe(["--model", str(exported["gpt2"]), "--beams", "2", "--candidates", "3", "--prefix", "5",
                  "--repeats", "2", "--fixed-shapes", "--out", str(out)]) == 0
    fixed = json.loads(out.read_text())
    assert fixed["dims"]["rows"] == 6 and fixed["dims"]["prefix"] == 5 and fixed["step_ms_dynamic"] > 0
    assert fixed["placement"]["nodes"] < r["placement"]["nodes"]
    with pytest.raises(SystemExit):                         # a CUDA graph needs the CUDA provider
        probe(["--model", str(exported["gpt2"]), "--cuda-graph"])


@pytest.mark.parametrize("int8", [False, True])
def test_overhead_probe_times_the_step_and_its_matmuls_in_turn(exported, tmp_path, int8):
    from benchmarks.overhead import main as probe
    from dbs_fast.bench.suite import linear_shapes

    out = tmp_path / "o.json"
    assert probe(["--model", str(exported["llama"]), "--rounds", "2", "--beams", "2", "--candidates", "3",
                  "--prefix", "5", "--out", str(out)] + (["--int8"] if int8 else [])) == 0
    r = json.loads(out.read_text())
    assert r["matmuls"] == ("int8 (dynamic)" if int8 else "fp32")
    assert [tuple(x) for x in r["shapes_in_out_count"]] == linear_shapes(exported["llama"])
    assert len(r["step_ms_per_round"]) == len(r["matmul_ms_per_round"]) == 2
    assert all(a > 0 and m > 0 for a, m in zip(r["step_ms_per_round"], r["matmul_ms_per_round"]))
    ratios = [a / m for a, m in zip(r["step_ms_per_round"], r["matmul_ms_per_round"])]
    assert r["step_over_matmuls_per_round"] == pytest.approx(ratios)
    assert r["step_over_matmuls"] == pytest.approx(sum(ratios) / 2)        # the median of two rounds


@pytest.mark.integration
def test_kernel_against_another_version_times_both_and_compares_draws(tmp_path):
    """`benchmarks/kernel.py --against FILE`: a copy of the kernel module loads beside this one,
    both are timed alternately, and the same kernel draws the same ids (log-probs equal)."""
    from pathlib import Path

    import dbs_fast.kernels
    from dbs_fast.bench.kernel import against

    copy = tmp_path / "kernels_copy.py"
    copy.write_text(Path(dbs_fast.kernels.__file__).read_text())
    r = against(str(copy), rows=4, vocab=300, rounds=2)
    for kind in ("plain", "flat", "anti_repetition"):
        assert r[kind]["same_ids"] and r[kind]["max_logp_diff"] == 0.0
        assert r[kind]["ms_median"]["this"] > 0 and r[kind]["ms_median"]["against"] > 0


@pytest.mark.integration
def test_transfers_counts_what_a_step_moves_with_the_cache_on_host_and_on_device(exported, tmp_path):
    """The same generation with the KV cache in NumPy arrays and as ORT tensors on a device (the
    CUDA path, run by the CPU provider): the same text; the device path moves less per call, and
    the difference is the cache the host path binds."""
    from benchmarks.transfers import main as transfers

    out = tmp_path / "t.json"
    assert transfers(["--model", str(exported["gpt2"]), "--keywords", "colony,river", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["same_text"] and r["host"]["graph_calls"] == r["device"]["graph_calls"] > 0
    assert 0 < r["device"]["mb_per_call"] < r["host"]["mb_per_call"]
    assert r["cache_mb_per_call_on_host_path"] == pytest.approx(r["host"]["mb_per_call"] - r["device"]["mb_per_call"])


@pytest.mark.integration
def test_scorer_probe_times_both_scorers_and_a_scorer_equal_to_the_generator_keeps_its_texts(exported, tmp_path):
    """The generator exported again as its own second model scores what `self` scores: the same
    texts; the probe times both in turns and counts the scorer's share of a generation."""
    from benchmarks.scorer import main as probe

    probe(["--model", str(exported["gpt2"]), "--scorer", str(exported["gpt2"]), "--sets", "2", "--rounds", "1",
           "--out", str(tmp_path)])
    r = json.loads((tmp_path / "scorer.json").read_text())
    assert r["same_texts"] == 2 and len(r["pairs"]) == 1 and r["scorer_over_self"] > 0
    assert r["scorer_share_of_time"]["scorer"] > 0 and r["scorer_share_of_time"]["self"] < r["scorer_share_of_time"]["scorer"]
