"""`dbs-fast bench`: the engine against the PyTorch baseline and a reference-style loop.

Workload (same seeds and keyword sets for every contender): GPT-2 large shapes (random
weights, the real GPT-2 tokenizer) and the embedded default model, at the paper's setting
b=7, s=10, k=5, lambda=20, context "It is", 90 new tokens (`--quick`: 10 tokens, same shapes).

Contenders, each in its own process (peak memory and cold start are its own):
  onnx-fp32   the engine on the fp32 export, the prefix cache (decode.onnx: one prefix per beam)
  onnx-int8   the engine on the `--quantize int8` export, the prefix cache
  onnx-fp32-rows, onnx-int8-rows   the same on the row layout (one cache row per candidate)
  onnx-fp32-plain   onnx-fp32 with every row computed at every step (`--schedule plain`)
  torch-fp32  the same scheduler over transformers with its KV cache and a torch sampler
  onnx-fp16, torch-fp16, torch-fp16-compile   the GPU's (not run unless named): the `--dtype fp16`
              export, PyTorch in float16, and the same under torch.compile(mode="reduce-overhead")
              on a static cache at bucket shapes (`torch_backend.StaticSteps`)
  onnx-fp16-fused   the fp16 export with the fused attention (`--attention fused`: one ONNX
              Attention node a layer), against onnx-fp16's gathered attention in plain operators
  onnx-fp16-graph   onnx-fp16's export with its decode steps at bucket shapes, one CUDA graph per
              bucket and chunk slot (`cuda_graph=True`, `dbs_fast/kv/buckets.py`; on the CPU the
              same bucketed steps without capture)
  reference   the authors' way as the paper describes it: one candidate at a time, batch 1,
              the whole sequence re-run for every token, no KV cache (PyTorch). Measured on
              one chunk of one beam at the middle of a generation, extrapolated (see JSON).
Also: the kernel on 70 x vocab rows (`dbs_fast/bench/kernel.py`) and this machine's roofline for
the model (ONNX Runtime matmul throughput at the batch's shapes, fp32 and int8, plus the KV
cache read at the measured memory bandwidth). This machine is shared and its speed moves with
the load, so each ONNX contender also times the step's matmuls again right after each of its
generations, in a child process: "x same-load roofline" sets each generation against those.

The prefix-cache contenders and the PyTorch baseline stay loaded side by side and take turns, one
generation each per round (`run_in_turns`; `--one-by-one` runs each contender on its own, as
before), so that the ratios between them are measured under the same load.

    dbs-fast bench --out bench_out            # full (~1 h on 2 cores with the exports)
    dbs-fast bench --quick --out bench_quick  # a few minutes

Writes bench.json, bench.md, stages.png, sweep.png in --out.
"""
from __future__ import annotations

import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from dbs_fast import DirectedBeamSearch
from dbs_fast.bench.machine import machine
from dbs_fast.config import DBSConfig
from dbs_fast.errors import DBSError
from dbs_fast.kv.buckets import Buckets
from dbs_fast.kv.prefix_cache import DECODE_GRAPH
from dbs_fast.manifest import current_export
from dbs_fast.runtime import cuda_fallback_ops, session_options
from dbs_fast.text.embeddings import Embeddings, SimilarityTable

CONTEXT = "It is"
KEYWORD_SETS = [["enemy", "speed", "meet", "colony", "mouth"],
                ["garden", "winter", "doctor", "song", "river"],
                ["market", "storm", "letter", "horse", "silver"]]
CONTENDERS = ("onnx-fp32", "onnx-int8", "onnx-fp32-rows", "onnx-int8-rows", "onnx-fp32-plain", "torch-fp32", "reference",
              "onnx-fp16", "onnx-fp16-fused", "onnx-fp16-graph", "torch-fp16", "torch-fp16-compile")
ENGINES = tuple(c for c in CONTENDERS if c != "reference")
# the GPU's: the fp16 exports (gathered and fused attention) and PyTorch in fp16, eager and compiled; not
# run by default
GPU_CONTENDERS = ("onnx-fp16", "onnx-fp16-fused", "onnx-fp16-graph", "torch-fp16", "torch-fp16-compile")
# the fp16 contenders' attention (`export --attention`)
FP16_FORMS = {"onnx-fp16": "gathered", "onnx-fp16-fused": "fused", "onnx-fp16-graph": "gathered"}
DEFAULT_CONTENDERS = tuple(c for c in CONTENDERS if c not in GPU_CONTENDERS)
TORCH = tuple(c for c in CONTENDERS if c.startswith("torch"))
# seconds per step by stage (the search's `timed` labels): the model call as graph = inside the
# runtime's run (ORT's, or PyTorch's forward) and model_host = the host's work around it (inputs,
# bindings, the cache's bookkeeping; on a GPU, the copies across); sample = guidance and the
# kernel's draw; the kv gather of the kept beams; the scorer; quality = keyword credit and Q; text =
# detokenising and keyword detection; python = the rest (scheduling glue)
STAGES = ("graph", "model_host", "sample", "kv_gather", "scorer", "quality", "text", "python")
ROW_COUNTS = ("model_rows", "plain_row_steps")     # a result's timings that count rows, not seconds
SHARED_TOKENIZER = Path(__file__).resolve().parents[3] / "shared" / "data" / "gpt2-tokenizer"


# -- workload preparation --------------------------------------------------------------------
def _export(src: str, out: Path, quantize: str | None) -> Path:
    if not current_export(out):                      # missing, or of another format version
        from dbs_fast.export.convert import export_model

        print(f"[bench] exporting {src} -> {out}{' (int8)' if quantize else ''}", flush=True)
        # fp32 means fp32 here: a GGUF source (the default) would keep its 4-bit blocks otherwise
        export_model(src, out, quantize=quantize, force=out.exists(), quiet=True,
                     weights="fp32" if quantize is None else None)
    return out


def _fp16(fp32: str, out: Path, attention: str) -> Path:
    """The `--dtype fp16` export beside the fp32 one, made from it (`convert.float16_from`), its
    decode graph's attention `attention`."""
    if not current_export(out):
        from dbs_fast.export.convert import float16_from

        print(f"[bench] the fp16 decode graph of {fp32} ({attention} attention) -> {out}", flush=True)
        if out.exists():
            shutil.rmtree(out)
        float16_from(Path(fp32), out, quiet=True, attention=attention)
    return out


def _fp16_exports(fp32: str, out: Path, contenders) -> dict:
    """{contender: its fp16 export} for the fp16 contenders among `contenders`, beside `fp32`."""
    return {c: str(_fp16(fp32, out.parent / f"{out.name}-{form}", form)) for c, form in FP16_FORMS.items()
            if c in contenders}


def prepare_points(workdir: Path, tokenizer: Path | None, checkpoint: Path | None, shape: str,
                   with_default: bool, int8: bool = True, fp16=()) -> dict:
    """{point: {"checkpoint", "onnx-fp32", "onnx-int8", and each fp16 contender in `fp16`}}; builds and
    exports what is missing (the int8 graphs only when `int8`: a contender runs them)."""
    points = {}
    if checkpoint is None:
        from .checkpoints import make_random_gpt2

        tok = tokenizer or SHARED_TOKENIZER
        if not (Path(tok) / "vocab.json").is_file():
            raise DBSError(f"the GPT-2-shaped workload needs the GPT-2 tokenizer: none at {tok}; pass "
                           f"--tokenizer DIR (vocab.json + merges.txt) or --checkpoint DIR")
        checkpoint = workdir / "ckpt" / f"{shape}-random"
        if not (checkpoint / "config.json").is_file():
            print(f"[bench] building a random {shape} checkpoint in {checkpoint}", flush=True)
            make_random_gpt2(checkpoint, Path(tok), shape)
        name = shape
    else:
        checkpoint = Path(checkpoint)
        if not (checkpoint / "config.json").is_file():
            raise DBSError(f"--checkpoint {checkpoint} is not a transformers checkpoint (no config.json)")
        name = checkpoint.name
    fp32 = str(_export(str(checkpoint), workdir / "onnx" / f"{name}-fp32", None))
    points[name] = {"checkpoint": str(checkpoint), "int8_method": "int8", "onnx-fp32": fp32,
                    "onnx-int8": str(_export(str(checkpoint), workdir / "onnx" / f"{name}-int8", "int8"))
                    if int8 else None, **_fp16_exports(fp32, workdir / "onnx" / f"{name}-fp16", fp16)}
    if with_default:
        # the default in fp32 (its embedded export keeps its GGUF file's 4-bit blocks)
        fp32 = _export("default", workdir / "onnx" / "default-fp32", None)
        # dynamic int8 fails parity on SmolLM2 (activation outliers, see export/quantize.py)
        points["default"] = {"checkpoint": None, "onnx-fp32": str(fp32), "int8_method": "int8-block",
                             "onnx-int8": str(_export("default", workdir / "onnx" / "default-int8-block",
                                                      "int8-block")) if int8 else None,
                             **_fp16_exports(str(fp32), workdir / "onnx" / "default-fp16", fp16)}
    return points


# -- one contender, in its own process ---------------------------------------------------------
def _peak_rss() -> int:
    """This process's peak resident set (VmHWM). Not getrusage's ru_maxrss: on Linux that keeps
    the high-water mark of the parent's memory image from before exec."""
    try:
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _gpu_mib() -> int | None:
    """This process's GPU memory in MiB (nvidia-smi), or None without one."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    mine = [int(f[1]) for f in (line.split(",") for line in out.splitlines()) if len(f) == 2 and f[0].strip() == str(os.getpid())]
    return sum(mine) if mine else None


class SameLoadTimer:
    """`matmul_step_seconds` in a child process that lives as long as the contender's run and times
    the step's matmuls whenever asked (`seconds`): its graphs (up to 256 MB of weights each) must not
    count in the contender's peak RSS, and a process cannot lower its own high-water mark reliably
    (clear_refs resets it to the present RSS, which freed-but-kept memory still holds). One child
    for the run: the interpreter and its imports start once, not after every generation."""

    MARK = "@@same-load"        # its answers' lines: whatever else a library prints is passed over
    CODE = ("import sys; from pathlib import Path; from dbs_fast.bench.suite import matmul_step_seconds\n"
            "a = sys.argv\n"
            f"print('{MARK} ready', flush=True)\n"
            "for _ in sys.stdin:\n"
            "    s = matmul_step_seconds(Path(a[1]), int(a[2]), a[3] == '1', int(a[4]) if a[4] else None)\n"
            f"    print('{MARK}', s, flush=True)")

    def __init__(self, model_dir: str, rows: int, int8: bool, threads: int | None):
        self.err = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen([sys.executable, "-c", self.CODE, str(model_dir), str(int(rows)),
                                      "1" if int8 else "0", "" if threads is None else str(int(threads))],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err, text=True,
                                     env={**os.environ, "PYTHONSAFEPATH": "1"})
        self._line()            # imported: from here on it is idle until asked, never beside a generation

    def _line(self) -> str:
        """Its next answer (what follows MARK on a line of its output)."""
        for line in self.proc.stdout:
            if line.startswith(self.MARK):
                return line[len(self.MARK):].strip()
        self.proc.wait()
        self.err.seek(0)
        raise RuntimeError(f"the same-load roofline failed: {self.err.read().strip().splitlines()[-1:]}")

    def seconds(self) -> float:
        try:
            self.proc.stdin.write("\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass                # it ended: _line says why
        return float(self._line())

    def close(self) -> None:
        if self.proc.stdin and not self.proc.stdin.closed:
            try:
                self.proc.stdin.close()
            except BrokenPipeError:
                pass
        self.proc.wait()
        self.err.close()


def _stage_ms(r, steps: int) -> dict:
    t = dict(r.timings)
    graph = t.pop("graph", 0.0)                     # inside "model"
    per = {s: 1e3 * t.get(s, 0.0) / steps for s in STAGES if s not in ("graph", "model_host", "python")}
    per["graph"], per["model_host"] = 1e3 * graph / steps, 1e3 * (t.get("model", 0.0) - graph) / steps
    per["python"] = 1e3 * (r.seconds - sum(v for k, v in t.items() if k not in ROW_COUNTS)) / steps   # scheduling glue
    per["prefill_total"] = 1e3 * t.get("prefill", 0.0)
    return per


def cpu_nodes_on_cuda(model_dir: str, kv_layout: str, backend: str) -> dict | None:
    """The contender's graph's nodes that ORT's CUDA provider has no kernels for ({op: count})."""
    if backend != "onnx":
        return None
    return cuda_fallback_ops(Path(model_dir) / (DECODE_GRAPH if kv_layout == "prefix" else "model.onnx"))


def worker_engine(spec: dict, order=None) -> dict:
    """One contender's generations: a cold one, then `order` (the generation indices, default
    0..repeats-1; a driven worker gets them from the driver one at a time, `_driven`)."""
    cfg = DBSConfig(**spec["config"])
    backend = "torch" if spec["contender"].startswith("torch") else "onnx"
    t0 = time.perf_counter()
    layout = "rows" if spec["contender"].endswith("-rows") else "auto"
    schedule = "plain" if spec["contender"].endswith("-plain") else "distinct"
    provider = spec.get("provider", "cpu")
    graph = spec["contender"].endswith("-graph")        # on the CPU: the same bucketed steps, no capture
    # no context store: every generation prefills its context, as the PyTorch baseline does
    dbs = DirectedBeamSearch(spec["model_dir"], config=cfg, backend=backend, threads=spec.get("threads"),
                             kv_layout=layout, provider=provider, context_cache_mb=0, schedule=schedule,
                             cuda_graph=graph and provider == "cuda", buckets=Buckets() if graph else None)
    if backend == "torch" and "fp16" in spec["contender"]:
        dbs.backend.set_dtype("float16")
    if spec["contender"].endswith("-compile"):
        dbs.backend.compile()
    init = time.perf_counter() - t0
    gpu_loaded = _gpu_mib() if provider == "cuda" else None
    sets = spec["keyword_sets"]
    context = spec.get("context", CONTEXT)
    first = dbs.generate(context, sets[0], seed=0)
    # The same-load roofline: the step's weight matmuls timed (best of 7, as the run's roofline)
    # right after each generation, in a child process (not counted in this one's peak RSS), so that
    # a slow spell of the machine slows both.
    same_load = backend == "onnx" and spec.get("same_load", True) and provider == "cpu"
    runs, matmul_s, started = [], [], []
    if dbs.decoder is not None:
        dbs.decoder.host_bytes_total = dbs.decoder.calls = 0
    timer = SameLoadTimer(spec["model_dir"], cfg.beams * cfg.candidates, "int8" in spec["contender"],
                          spec.get("threads")) if same_load else None
    try:
        for i in (range(spec["repeats"]) if order is None else order):
            started.append(time.time())
            runs.append(dbs.generate(context, sets[i % len(sets)], seed=i))
            if timer is not None:
                matmul_s.append(timer.seconds())
    finally:
        if timer is not None:
            timer.close()
    secs = [r.seconds for r in runs]
    steps = cfg.max_new_tokens
    stages = {s: statistics.median(_stage_ms(r, steps)[s] for r in runs) for s in (*STAGES, "prefill_total")}
    decode = [r.seconds - r.timings.get("prefill", 0.0) for r in runs]
    tokens = [r.candidate_tokens_per_second * r.seconds for r in runs]
    out = {
        "contender": spec["contender"], "model_dir": spec["model_dir"],
        "kv_layout": "prefix" if dbs.decoder is not None else "rows",
        "kv_cache_bytes": statistics.median(r.kv_cache_bytes for r in runs),
        "seconds_median": statistics.median(secs), "seconds_min": min(secs), "seconds_max": max(secs),
        "seconds_all": secs, "repeats": len(runs), "started_unix": started,
        # model rows the decode steps computed over the plain schedule's row-steps (b*s at every step)
        "model_rows_ratio": sum(r.timings["model_rows"] for r in runs) / max(1, sum(r.timings["plain_row_steps"]
                                                                                  for r in runs)),
        "candidate_tokens_per_second": statistics.median(r.candidate_tokens_per_second for r in runs),
        "step_ms": 1e3 * statistics.median(decode) / steps,
        "decode_seconds": statistics.median(decode), "candidate_tokens": statistics.median(tokens),
        "decode_seconds_all": decode, "candidate_tokens_all": tokens,
        "same_load_matmul_seconds": matmul_s,
        "stage_ms_per_step": stages,
        "cold_start_seconds": init + first.seconds, "session_seconds": init,
        "first_generation_seconds": first.seconds,
        "success_rate": statistics.mean(r.success_rate for r in runs),
        "perplexity": statistics.median(r.perplexity for r in runs),
        "texts": [r.generated for r in runs],
        "prompt_tokens": first.prompt_tokens,
        "provider": provider,
        # where it really ran: ORT's first provider of the decode session, or torch's device
        "ran_on": (dbs.decoder.session.get_providers()[0] if dbs.decoder is not None
                   else str(getattr(dbs.backend, "device", None) or dbs.backend.model.provider)),
        # what a graph call bound from host memory: on CUDA the bytes copied across (PrefixDecoder.host_bytes)
        "host_mb_per_call": (dbs.decoder.host_bytes_total / max(1, dbs.decoder.calls) / 1e6
                             if dbs.decoder is not None else None),
        # nodes ORT's CUDA provider has no kernels for (they run on the CPU): the dynamic-int8 graph's
        "cpu_nodes_on_cuda": cpu_nodes_on_cuda(spec["model_dir"], "prefix" if dbs.decoder is not None else "rows", backend)
                              if provider == "cuda" else None,
    }
    if spec["contender"].endswith("-compile"):   # after the cold generation (compiled and recorded there) and the timed ones
        out["torch_compile"] = dbs.backend.compile_stats()
    if dbs.decoder is not None and dbs.decoder.static is not None:
        out["buckets"] = dbs.decoder.static.stats()
    if provider == "cuda":                        # after loading, and after the generations (arenas, graphs)
        out["gpu_memory_mib"] = {"loaded": gpu_loaded, "after": _gpu_mib()}
    sweep = []
    for b, s in spec.get("sweep", []):
        r = dbs.generate(context, sets[0], seed=0, config=replace(cfg, beams=b, candidates=s))
        sweep.append({"beams": b, "candidates": s, "rows": b * s, "seconds": r.seconds,
                      "kv_cache_bytes": r.kv_cache_bytes})
    out["sweep"] = sweep
    out["peak_rss_bytes"] = _peak_rss()
    return out


def reference_loop(spec: dict) -> dict:
    """One beam's s candidates of one chunk, the authors' way: batch 1, no KV cache, the whole
    sequence re-run for every token, then one more full pass per candidate for its perplexity."""
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    from dbs_fast.torch_backend import torch_sample

    cfg = DBSConfig(**spec["config"])
    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(spec["checkpoint"]).eval()
    tok = Tokenizer.from_file(str(Path(spec["model_dir"]) / "tokenizer.json"))
    V = model.get_output_embeddings().weight.shape[0]
    table = SimilarityTable.for_tokenizer(lambda i: tok.decode([i], skip_special_tokens=False), V,
                                          Embeddings.load("default"))
    boost = torch.from_numpy(table.dense(spec["keyword_sets"][0][0], cfg.lam).astype(np.float32))[None]
    init = time.perf_counter() - t0
    # the prefix at the middle of a generation: context + half of max_new_tokens
    filler = tok.encode(" and the people of the town went out to see what had happened to them" * 8).ids
    prefix = tok.encode(CONTEXT).ids + filler[: cfg.max_new_tokens // 2]
    rng = np.random.default_rng(0)
    n_cand = spec["reference_candidates"]
    per_token = []
    t_all = time.perf_counter()
    with torch.inference_mode():
        for _ in range(n_cand):
            seq = list(prefix)
            for _ in range(cfg.chunk):
                t1 = time.perf_counter()
                logits = model(input_ids=torch.tensor([seq]), use_cache=False).logits[:, -1].float()
                ids, _ = torch_sample(logits, rng.random(1), np.zeros(1, np.int32), boost, cfg, False)
                seq.append(int(ids[0]))
                per_token.append(time.perf_counter() - t1)
            model(input_ids=torch.tensor([seq]), use_cache=False)       # its perplexity: one more pass
    total = time.perf_counter() - t_all
    tokens = n_cand * cfg.chunk
    sec_tok = total / tokens
    rows = cfg.beams * cfg.candidates
    return {
        "contender": "reference", "checkpoint": spec["checkpoint"], "prefix_tokens": len(prefix),
        "measured_candidates": n_cand, "measured_tokens": tokens, "measured_seconds": total,
        "seconds_per_candidate_token": sec_tok,
        "seconds_per_token_forward_median": statistics.median(per_token),
        "extrapolated_seconds_per_generation": sec_tok * rows * cfg.max_new_tokens,
        "extrapolation": (f"{tokens} candidate tokens measured at a {len(prefix)}-token prefix (the middle of a "
                          f"{cfg.max_new_tokens}-token generation), each one full forward plus one scoring pass "
                          f"per candidate; x {rows} candidates x {cfg.max_new_tokens} tokens"),
        "cold_start_seconds": init, "peak_rss_bytes": _peak_rss(),
    }


# -- roofline ----------------------------------------------------------------------------------
def linear_shapes(model_dir: Path) -> list[tuple[int, int, int]]:
    """(in, out, count) of every weight matmul of one step (all layers + LM head)."""
    c = json.loads((Path(model_dir) / "config.json").read_text())
    m = json.loads((Path(model_dir) / "dbs_fast_model.json").read_text())
    h, L, V = m["hidden_size"], m["num_layers"], m["vocab_size"]
    if c.get("model_type") == "gpt2":
        inner = c.get("n_inner") or 4 * h
        layer = [(h, 3 * h), (h, h), (h, inner), (inner, h)]
    else:                                           # Llama-style: q, k, v, o, gate, up, down
        q, kv = m["num_heads"] * m["head_dim"], m["num_kv_heads"] * m["head_dim"]     # Gemma 3: q wider than h
        inner = c["intermediate_size"]
        layer = [(h, q), (h, kv), (h, kv), (q, h), (h, inner), (h, inner), (inner, h)]
    shapes: dict[tuple[int, int], int] = {}
    for s in layer:
        shapes[s] = shapes.get(s, 0) + L
    shapes[(h, V)] = shapes.get((h, V), 0) + 1
    return [(k, n, cnt) for (k, n), cnt in shapes.items()]


def matmul_step_seconds(model_dir: Path, rows: int, int8: bool, threads: int | None) -> float:
    """The roofline's matmul time of one step at `rows` rows: every weight matmul at ORT's best."""
    return sum(c * _matmul_seconds(rows, k, n, int8, threads) for k, n, c in linear_shapes(model_dir))


def _matmul_seconds(rows: int, k: int, n: int, int8: bool, threads: int | None, repeats: int = 7) -> float:
    """ORT's best time for one (rows x k) @ (k x n) MatMul: several independent copies (distinct
    weights, so no cache reuse) in one graph amortise the per-run overhead; spinning allowed."""
    sess, x, copies = matmul_session(rows, k, n, int8, threads)
    sess.run(None, x)
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        sess.run(None, x)
        ts.append(time.perf_counter() - t0)
    return min(ts) / copies                          # the machine's best: a roofline is a bound


def matmul_session(rows: int, k: int, n: int, int8: bool, threads: int | None):
    """(session, feeds, copies): the roofline's graph of `copies` independent (rows x k) @ (k x n)
    MatMuls (fp32, or int8 by ORT's dynamic quantisation)."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    copies = int(max(1, min(8, 256e6 // (4 * k * n))))
    ws = [numpy_helper.from_array((rng.standard_normal((k, n)) * 0.02).astype(np.float32), f"W{i}")
          for i in range(copies)]
    g = helper.make_graph([helper.make_node("MatMul", ["X", f"W{i}"], [f"Y{i}"]) for i in range(copies)], "mm",
                          [helper.make_tensor_value_info("X", TensorProto.FLOAT, [rows, k])],
                          [helper.make_tensor_value_info(f"Y{i}", TensorProto.FLOAT, [rows, n])
                           for i in range(copies)], ws)

    so = session_options(threads)     # the engine's: spinning stops when a run ends (several sessions may live)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "mm.onnx"
        onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), str(path))
        if int8:
            from onnxruntime.quantization import QuantType, quantize_dynamic

            quantize_dynamic(str(path), str(Path(d) / "q.onnx"), weight_type=QuantType.QInt8)
            path = Path(d) / "q.onnx"
        sess = ort.InferenceSession(str(path), sess_options=so, providers=["CPUExecutionProvider"])
    return sess, {"X": rng.standard_normal((rows, k)).astype(np.float32)}, copies


def memory_bandwidth(nbytes: int = 512 * 2**20) -> float:
    """Bytes per second of a large copy (read + write counted)."""
    a = np.ones(nbytes // 4, np.float32)
    b = np.empty_like(a)
    ts = []
    for _ in range(5):
        t0 = time.perf_counter()
        np.copyto(b, a)
        ts.append(time.perf_counter() - t0)
    return 2 * nbytes / min(ts)


def roofline(model_dir: Path, cfg: DBSConfig, context_tokens: int, threads: int | None) -> dict:
    """Minimum step time of this model at b*s rows on this machine."""
    m = json.loads((Path(model_dir) / "dbs_fast_model.json").read_text())
    rows = cfg.beams * cfg.candidates
    shapes = linear_shapes(model_dir)
    flops = sum(2 * rows * k * n * c for k, n, c in shapes)
    out = {"rows": rows, "matmul_gflop_per_step": flops / 1e9}
    for kind, int8 in (("fp32", False), ("int8", True)):
        sec = matmul_step_seconds(model_dir, rows, int8, threads)
        out[f"{kind}_matmul_seconds_per_step"] = sec
        out[f"{kind}_gflops"] = flops / sec / 1e9
    bw = memory_bandwidth()
    avg_len = context_tokens + cfg.max_new_tokens / 2
    per_token = 2 * m["num_layers"] * m["num_kv_heads"] * m["head_dim"] * 4
    kv_bytes = per_token * rows * avg_len                       # rows: every candidate its own copy
    # the prefix cache: each beam's prefix once + each candidate's chunk (half a chunk on average)
    kv_prefix = per_token * (cfg.beams * avg_len + rows * cfg.chunk / 2)
    out.update(memory_bandwidth_gbs=bw / 1e9, kv_read_bytes_per_step=kv_bytes, kv_read_seconds=kv_bytes / bw,
               kv_read_bytes_per_step_prefix=kv_prefix)
    for kind in ("fp32", "int8"):
        out[f"{kind}_step_seconds"] = out[f"{kind}_matmul_seconds_per_step"] + kv_bytes / bw
        out[f"{kind}_step_seconds_prefix"] = out[f"{kind}_matmul_seconds_per_step"] + kv_prefix / bw
    out["definition"] = ("min step at b*s rows = sum over the step's weight matmuls of ORT's best time for "
                         "that (rows x in x out) MatMul + reading the KV cache once at the average length "
                         "(context + max_new_tokens/2) at the measured copy bandwidth: b*s copies of it on the "
                         "row layout, b copies + each row's half chunk on the prefix cache's (`*_prefix`). A "
                         "generation's minimum is its candidate tokens x (min step / rows): the first chunk "
                         "runs b rows, not b*s")
    return out


# -- driver ------------------------------------------------------------------------------------
def _worker_cmd(spec: dict, workdir: Path) -> tuple[list[str], Path, Path]:
    with tempfile.NamedTemporaryFile("w", suffix=".json", dir=workdir, delete=False) as f:
        json.dump(spec, f)
    out = Path(f.name).with_suffix(".out.json")
    return [sys.executable, "-m", "dbs_fast.bench.suite", "--worker", f.name, str(out)], Path(f.name), out


def _worker_env() -> dict:
    """PYTHONSAFEPATH: `-m` must not put the cwd first on sys.path, where another checkout's
    dbs_fast/ folder would shadow the installed package."""
    return {**os.environ, "PYTHONSAFEPATH": "1"}


def _result(spec: dict, spec_file: Path, out: Path, returncode: int, log: list[str]) -> dict:
    spec_file.unlink(missing_ok=True)
    if returncode != 0 or not out.is_file():
        tail = "\n".join(log[-15:])
        return {"contender": spec["contender"], "error": f"worker exited {returncode}: {tail}"}
    res = json.loads(out.read_text())
    out.unlink()
    return res


def _spawn(spec: dict, workdir: Path) -> dict:
    cmd, spec_file, out = _worker_cmd(spec, workdir)
    print(f"[bench] {spec['point']}: {spec['contender']} ...", flush=True)
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_worker_env())
    return _result(spec, spec_file, out, proc.returncode, proc.stdout.splitlines())


class DrivenWorker:
    """A contender's worker that stays loaded and runs one generation when told (`generate`), so
    that the contenders of a point take turns: a slow spell of this shared machine then falls on
    all of them alike, where one contender after another let it fall on whichever ran then."""

    def __init__(self, spec: dict, workdir: Path):
        self.spec = {**spec, "driven": True}
        cmd, self.spec_file, self.out = _worker_cmd(self.spec, workdir)
        print(f"[bench] {spec['point']}: {spec['contender']} loading ...", flush=True)
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=_worker_env())
        self.log: list[str] = []
        self.alive = self._until(READY)

    def _until(self, marker: str) -> bool:
        """Read the worker's output up to `marker`; False when it ended first."""
        for line in self.proc.stdout:
            if line.startswith(marker):
                return True
            self.log.append(line.rstrip("\n"))
        return False

    def generate(self, i: int) -> None:
        if self.alive:
            print(f"[bench]   {self.spec['contender']}: generation {i}", flush=True)
            self.proc.stdin.write(f"{i}\n")
            self.proc.stdin.flush()
            self.alive = self._until(DONE)

    def finish(self) -> dict:
        if self.alive:
            self.proc.stdin.write(FINISH + "\n")
            self.proc.stdin.close()
            self.log += [line.rstrip("\n") for line in self.proc.stdout]     # the rest, to its end
        return _result(self.spec, self.spec_file, self.out, self.proc.wait(), self.log)


def run_in_turns(specs: list[dict], workdir: Path, repeats: int) -> dict:
    """Each spec's worker loaded in turn, then `repeats` rounds in which every contender runs one
    generation, in ABC CBA order; results by contender."""
    workers = [DrivenWorker(spec, workdir) for spec in specs]
    for i in range(repeats):
        for w in (workers if i % 2 == 0 else workers[::-1]):
            w.generate(i)
    return {w.spec["contender"]: w.finish() for w in workers}


def _budget(model_dir: str, kv_layout: str) -> int:
    """The memory budget: the weight files of the graph the engine loads + 1.5 GB."""
    m = json.loads((Path(model_dir) / "dbs_fast_model.json").read_text())
    graph = "decode.onnx" if kv_layout == "prefix" else "model.onnx"
    return int(sum(v for k, v in m["files"].items() if k.startswith(graph)) + 1.5e9)


def run_bench(out: Path, workdir: Path, quick: bool = False, repeats: int | None = None,
              max_new_tokens: int | None = None, contenders=DEFAULT_CONTENDERS, tokenizer: Path | None = None,
              checkpoint: Path | None = None, shape: str = "gpt2-large", with_default: bool = True,
              threads: int | None = None, sweep=None, reference_candidates: int | None = None,
              kernel_repeats: int = 20, in_turns: bool = True, provider: str = "cpu") -> dict:
    """`in_turns`: the prefix-cache contenders (onnx-fp32, onnx-int8) and the PyTorch baseline of a
    point stay loaded together and take turns generation by generation (`run_in_turns`); the
    row-layout ones (their caches take ~10 GB on GPT-2 large) and the reference run after them,
    one after another. False: every contender on its own, one after another."""
    out.mkdir(parents=True, exist_ok=True)
    workdir.mkdir(parents=True, exist_ok=True)
    bad = [c for c in contenders if c not in CONTENDERS]
    if bad:
        raise DBSError(f"unknown contender(s) {bad}; choose from {list(CONTENDERS)}")
    cfg = DBSConfig.paper(max_new_tokens=max_new_tokens or (10 if quick else 90))  # fixed length: same work
    repeats = repeats or (1 if quick else 2)
    sweep = [tuple(x) for x in (sweep if sweep is not None else ([(1, 5), (3, 5)] if quick else
                                                                [(1, 5), (3, 5), (5, 5), (5, 10)]))]
    ref_cands = reference_candidates or (1 if quick else 2)
    points = prepare_points(workdir, tokenizer, checkpoint, shape, with_default,
                            int8=any("int8" in c for c in contenders), fp16=contenders)
    report = {"machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M %Z"), "quick": quick, "provider": provider,
              "config": cfg.to_dict(), "context": CONTEXT, "keyword_sets": KEYWORD_SETS, "points": {}}
    from .kernel import run as kernel_run

    first_fp32 = Path(next(iter(points.values()))["onnx-fp32"])
    vocab = json.loads((first_fp32 / "dbs_fast_model.json").read_text())["vocab_size"]
    report["kernel"] = kernel_run(cfg.beams * cfg.candidates, vocab, kernel_repeats, threads)
    print(f"[bench] kernel {report['kernel']['numba']['ms_median']:.1f} ms on "
          f"{cfg.beams * cfg.candidates}x{vocab}", flush=True)
    for name, p in points.items():
        ctx_tokens = len(_encode(p["onnx-fp32"], CONTEXT))
        # the roofline is ORT's CPU matmul: none for a CUDA run
        roof = roofline(Path(p["onnx-fp32"]), cfg, ctx_tokens, threads) if provider == "cpu" else None
        res = {"models": p, "roofline": roof,
               "memory_budget_bytes": {}, "contenders": {}}
        specs = {c: {"point": name, "contender": c, "config": cfg.to_dict(), "keyword_sets": KEYWORD_SETS,
                     "repeats": repeats, "threads": threads, "provider": provider,
                     "model_dir": p["onnx-int8" if "int8" in c else c if c in FP16_FORMS else "onnx-fp32"],
                     "checkpoint": p["checkpoint"], "reference_candidates": ref_cands,
                     "sweep": sweep if c.startswith("onnx") and name == next(iter(points)) else []}
                 for c in contenders if c != "reference" or p["checkpoint"] is not None}
        # (the default is a GGUF: the reference runs on the GPT-2 point only)
        turns = [c for c in specs if in_turns and c != "reference" and not c.endswith("-rows")]
        done = run_in_turns([specs[c] for c in turns], workdir, repeats) if len(turns) > 1 else {}
        res["in_turns"] = list(done)
        for c, spec in specs.items():
            res["contenders"][c] = _contender(c, spec, done, workdir, res["memory_budget_bytes"])
        _ratios(res, cfg)
        report["points"][name] = res
        # after every point, so that a run cut short (a device call's time limit) keeps the points it finished
        (out / "bench.json").write_text(json.dumps(report, indent=2))
        (out / "bench.md").write_text(markdown(report))
    plots(report, out)
    print(markdown(report))
    return report


def _contender(c: str, spec: dict, done: dict, workdir: Path, budgets: dict) -> dict:
    """One contender's figures at a point: from the turns (`done`) or its own process; its memory
    budget into `budgets`; a line of progress."""
    r = done[c] if c in done else _spawn(spec, workdir)
    if "error" in r:
        print(f"[bench]   failed: {r['error']}", flush=True)
    elif c != "reference":
        budgets[c] = _budget(spec["model_dir"], r["kv_layout"])
        print(f"[bench]   {r['seconds_median']:.2f} s/generation, step {r['step_ms']:.0f} ms, "
              f"peak {r['peak_rss_bytes'] / 1e9:.2f} GB", flush=True)
    else:
        print(f"[bench]   {r['seconds_per_candidate_token'] * 1e3:.0f} ms/candidate token", flush=True)
    return r


def _encode(model_dir: str, text: str) -> list[int]:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json")).encode(text).ids


def _ratios(res: dict, cfg: DBSConfig) -> None:
    c = {k: v for k, v in res["contenders"].items() if "error" not in v}
    r = {}
    for t in (t for t in TORCH if t in c):           # onnx-fp32_vs_torch (fp32), onnx-fp16_vs_torch-fp16, ...
        for k in (e for e in ENGINES if e.startswith("onnx")):
            if k in c:
                r[f"{k}_vs_{'torch' if t == 'torch-fp32' else t}"] = c[t]["seconds_median"] / c[k]["seconds_median"]
    if "reference" in c:
        ref = c["reference"]["seconds_per_candidate_token"]
        for k in ENGINES:
            if k in c:
                r[f"{k}_vs_reference_per_candidate_token"] = ref * c[k]["candidate_tokens_per_second"]
    roof = res["roofline"]
    for k in ENGINES:
        if k not in c:
            continue
        if roof is not None:                # none for a CUDA run (the roofline is ORT's CPU matmul)
            layout = "_prefix" if c[k].get("kv_layout") == "prefix" else ""
            q = "int8" if "int8" in k else "fp32"
            base = roof[q + "_step_seconds" + layout]
            r[f"{k}_step_vs_roofline"] = c[k]["decode_seconds"] / (c[k]["candidate_tokens"] * base / roof["rows"])
            mm = c[k].get("same_load_matmul_seconds")
            if mm:                          # each generation against the matmuls timed right after it
                kv = base - roof[q + "_matmul_seconds_per_step"]
                r[f"{k}_step_vs_roofline_same_load"] = statistics.median(
                    d / (n * (m + kv) / roof["rows"])
                    for d, n, m in zip(c[k]["decode_seconds_all"], c[k]["candidate_tokens_all"], mm))
        st = c[k]["stage_ms_per_step"]
        r[f"{k}_scheduling_share"] = (st["kv_gather"] + st["python"] + st["text"] + st["quality"]) / c[k]["step_ms"]
        r[f"{k}_peak_vs_budget"] = c[k]["peak_rss_bytes"] / res["memory_budget_bytes"][k]
    res["ratios"] = r


def markdown(report: dict) -> str:
    cfg = report["config"]
    lines = [f"Benchmark: {report['machine']}, {report['date']}; b={cfg['beams']}, s={cfg['candidates']}, "
             f"k={cfg['chunk']}, lambda={cfg['lam']}, {cfg['max_new_tokens']} new tokens, context "
             f"\"{report['context']}\"{' (quick)' if report['quick'] else ''}.", ""]
    k = report["kernel"]
    lines += [f"Logits kernel, {k['rows']} x {k['vocab']}: Numba {k['numba']['ms_median']:.1f} ms (median), NumPy "
              f"reference {k['numpy']['ms_median']:.0f} ms ({k['speedup_vs_numpy']:.0f}x)"
              + (f", torch sort-based top-p {k['torch']['ms_median']:.0f} ms ({k['speedup_vs_torch']:.0f}x)"
                 if "torch" in k else "") + ".", ""]
    for name, res in report["points"].items():
        roof = res["roofline"]
        roof_line = (f"Roofline at {roof['rows']} rows: {roof['matmul_gflop_per_step']:.1f} GFLOP/step; ORT matmul "
                     f"{roof['fp32_gflops']:.0f} GFLOP/s fp32, {roof['int8_gflops']:.0f} GFLOP/s int8; copy bandwidth "
                     f"{roof['memory_bandwidth_gbs']:.1f} GB/s; min step {roof['fp32_step_seconds'] * 1e3:.0f} ms fp32, "
                     f"{roof['int8_step_seconds'] * 1e3:.0f} ms int8 on the row layout, "
                     f"{roof['fp32_step_seconds_prefix'] * 1e3:.0f} / {roof['int8_step_seconds_prefix'] * 1e3:.0f} ms "
                     f"on the prefix cache's (it reads b prefixes, not b*s)." if roof else
                     f"Provider {report.get('provider')}: no roofline (the bench's is ORT's CPU matmul); host<->device "
                     f"MB per graph call: " + ", ".join(f"{c} {r['host_mb_per_call']:.2f}" for c, r in
                                                        res["contenders"].items() if r.get("host_mb_per_call")) + "."
                     + "".join(f" {c}: {', '.join(f'{n} {op}' for op, n in r['cpu_nodes_on_cuda'].items())} "
                               f"nodes have no CUDA kernel and run on the CPU." for c, r in res["contenders"].items()
                               if r.get("cpu_nodes_on_cuda"))
                     + " Ran on: " + ", ".join(f"{c} {r['ran_on']}" for c, r in res["contenders"].items()
                                                if r.get("ran_on")) + ".")
        lines += [f"### {name} (onnx-int8 = `--quantize {res['models'].get('int8_method', 'int8')}`)", "",
                  roof_line
                  + (f" {', '.join(res['in_turns'])} took turns, one generation each per round (ABC CBA ...); "
                     f"the others ran one after another." if res.get("in_turns") else ""), "",
                  "| contender | KV layout | s/generation (median, min-max; model rows / plain schedule) | candidate tok/s | step ms | x roofline | "
                  "x same-load roofline | graph | model host | sample | kv gather | scorer | quality | text | python | KV cache MB | "
                  "peak RSS GB (budget) | cold start s |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        ratios = res.get("ratios", {})
        for c, r in res["contenders"].items():
            if "error" in r:
                err = r["error"].splitlines()          # "worker exited N: <its log's last lines>": the last one says why
                lines.append(f"| {c} | failed: {err[-1].strip()[:120]} |" + " |" * 15)
            elif c == "reference":
                lines.append(f"| reference (batch 1, no cache) | none | {r['extrapolated_seconds_per_generation']:.0f} "
                             f"(extrapolated) | {1 / r['seconds_per_candidate_token']:.2f} | "
                             f"{r['seconds_per_candidate_token'] * 1e3:.0f} per token | | | | | | | | | | | "
                             f"{r['peak_rss_bytes'] / 1e9:.2f} | {r['cold_start_seconds']:.1f} |")
            else:
                st = r["stage_ms_per_step"]
                lines.append(
                    f"| {c} | {r.get('kv_layout', 'rows')} | {r['seconds_median']:.1f} "
                    f"({r['seconds_min']:.1f}-{r['seconds_max']:.1f}; rows {r.get('model_rows_ratio', 1.0):.2f}x) | "
                    f"{r['candidate_tokens_per_second']:.0f} | {r['step_ms']:.0f} | "
                    f"{ratios.get(c + '_step_vs_roofline', float('nan')):.2f} | "
                    f"{ratios.get(c + '_step_vs_roofline_same_load', float('nan')):.2f} | "
                    + " | ".join(f"{st[s]:.0f}" for s in STAGES)
                    + f" | {r.get('kv_cache_bytes', 0) / 1e6:.0f} | {r['peak_rss_bytes'] / 1e9:.2f} "
                      f"({res['memory_budget_bytes'][c] / 1e9:.2f}) | "
                      f"{r['cold_start_seconds']:.1f} |")
        lines += ["", "Ratios: " + ", ".join(f"{k} {v:.2f}" for k, v in ratios.items()), ""]
        for c, r in res["contenders"].items():
            if "buckets" in r:
                bk, mem = r["buckets"], r.get("gpu_memory_mib") or {}
                lines += [f"{c}: {bk['sessions_created']} bucket sessions ({bk['session_seconds']:.1f} s to make), "
                          f"{bk['slot_graphs']} slot graphs{' captured' if bk['cuda_graph'] else ''}, fixed buffers "
                          f"{bk['buffer_bytes'] / 1e6:.1f} MB, shared weights {bk['shared_weight_bytes'] / 1e6:.0f} MB"
                          + (f"; GPU memory {mem['loaded']} MiB loaded, {mem['after']} MiB after the generations"
                             if mem.get("loaded") is not None else "") + ".", ""]
    return "\n".join(lines) + "\n"


def plots(report: dict, out: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        print("[bench] no plots: matplotlib is not installed (the bench or dev extra)", flush=True)
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = list(report["points"].items())
    fig, axes = plt.subplots(1, len(pts), figsize=(6 * len(pts), 4.5), squeeze=False)
    for ax, (name, res) in zip(axes[0], pts):
        cs = [(c, r) for c, r in res["contenders"].items() if "error" not in r and c != "reference"]
        bottom = np.zeros(len(cs))
        for s in STAGES:
            v = np.array([r["stage_ms_per_step"][s] for _, r in cs])
            ax.bar([c for c, _ in cs], v, bottom=bottom, label=s)
            bottom += v
        for kind, key in (("fp32", "fp32_step_seconds"), ("int8", "int8_step_seconds")) if res["roofline"] else ():
            ax.axhline(res["roofline"][key] * 1e3, ls="--", lw=1, color="k" if kind == "fp32" else "grey")
            ax.text(len(cs) - 0.5, res["roofline"][key] * 1e3, f" roofline {kind}", va="bottom", ha="right",
                    fontsize=8)
        ax.set_title(f"{name}: one decode step by stage")
        ax.set_ylabel("ms per step")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "stages.png", dpi=120)
    plt.close(fig)
    name, res = pts[0]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for c, r in res["contenders"].items():
        if "error" in r or not r.get("sweep"):
            continue
        xs = np.array([p["rows"] for p in r["sweep"]] + [report["config"]["beams"] * report["config"]["candidates"]])
        order = np.argsort(xs)
        for ax, key, med, scale in ((axes[0], "seconds", "seconds_median", 1), (axes[1], "kv_cache_bytes",
                                                                                 "kv_cache_bytes", 1e6)):
            ys = np.array([p.get(key, 0) for p in r["sweep"]] + [r.get(med, 0)]) / scale
            ax.plot(xs[order], ys[order], "o-" if r.get("kv_layout") == "prefix" else "s--",
                    label=f"{c} ({r.get('kv_layout', 'rows')})")
    for ax, label in ((axes[0], "seconds per generation"), (axes[1], "KV cache MB (peak over the steps)")):
        ax.set_xlabel("b x s (rows decoded together)")
        ax.set_ylabel(label)
        ax.set_title(f"{name}, {report['config']['max_new_tokens']} new tokens")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "sweep.png", dpi=120)
    plt.close(fig)


def worker_main(spec_path: str, out_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    if spec["contender"] == "reference":
        res = reference_loop(spec)
    else:
        res = worker_engine(spec, _driven() if spec.get("driven") else None)
    Path(out_path).write_text(json.dumps(res))


READY, DONE, FINISH = "@@bench-worker ready", "@@bench-worker done", "finish"


def _driven():
    """The generation indices a driven worker runs, read from stdin one at a time: it says READY
    (loaded and warm), then DONE after each generation, and stops at FINISH."""
    print(READY, flush=True)
    for line in sys.stdin:
        if line.strip() == FINISH:
            return
        yield int(line)
        print(DONE, flush=True)


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] != "--worker":
        sys.exit("a contender's worker, started by `dbs-fast bench`: --worker SPEC.json OUT.json")
    worker_main(sys.argv[2], sys.argv[3])
