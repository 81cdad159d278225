"""`dbs-fast export`: checkpoint -> ONNX with KV cache + tokenizer + manifest, atomically.

Everything is written to a temporary directory beside `--out` and moved into place only
after the parity check passed, so a failure (bad model, full disk, Ctrl-C) leaves nothing
that a later load would accept.
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import sys
import tempfile
import time
import warnings
from collections import Counter
from pathlib import Path

from dbs_fast.cpu import cpu_signature
from dbs_fast.errors import DBSError
from dbs_fast.home import embedded_model_dir
from dbs_fast.kv.prefix_cache import DECODE_GRAPH
from dbs_fast.manifest import (
    EXPORT_FORMAT_VERSION,
    MANIFEST,
    current_export,
    stale_embedded,
)
from dbs_fast.model import OnnxModel

from . import parity as parity_mod
from .gguf_weights import ACCURACY, ACCURACY_LEVELS
from .prefix_graph import ATTENTIONS
from .source import (
    Source,
    check_supported,
    gguf_file_type,
    gguf_read_once,
    load_config,
    load_torch_model,
    resolve,
)

TWO_GB = 2 * 1024**3
TASK = "text-generation-with-past"


EXPORT_LOG = "export.log"       # in the model dir: what the exporters wrote to stderr


def _log(msg: str, quiet: bool) -> None:
    if not quiet:
        print(f"[export] {msg}", flush=True)


@contextlib.contextmanager
def _stderr_to(path: Path):
    """Everything written to stderr meanwhile (torch's TracerWarnings, optimum's and onnxruntime's
    logs, C++ included) goes to `path` instead of the screen."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(path, "a") as f, warnings.catch_warnings():
        warnings.simplefilter("default")
        os.dup2(f.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)


def _param_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _onnx_export(checkpoint: str, out: Path, post_process: bool) -> None:
    from optimum.exporters.onnx import main_export

    # Post-processing (decoder merge / tied-weight dedup) hits protobuf's 2 GB limit on big
    # models (GPT-2 large fp32), and is wasted on a graph that only checks the decode graph and goes
    # (`_row_layout_goes`): skipped there; the tied LM head is then stored twice.
    main_export(checkpoint, str(out), task=TASK, do_validation=False, no_post_process=not post_process,
                local_files_only=True)


def _eos_ids(model, tokenizer) -> list[int]:
    ids = []
    for cfg in (getattr(model, "generation_config", None), model.config):
        e = getattr(cfg, "eos_token_id", None)
        ids += e if isinstance(e, list) else ([e] if e is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return sorted(set(int(i) for i in ids))


def _files(folder: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in sorted(folder.iterdir())
            if p.is_file() and p.name != MANIFEST}


def _graph_facts(path: Path) -> tuple[int, int, int]:
    """(opset, KV heads, head size) of the row-layout graph at `path`, as its past keys' input
    takes them: read from the graph, not its weights (a session took 2.4 s on the default)."""
    import onnx

    m = onnx.load(str(path), load_external_data=False)
    past = next(i for i in m.graph.input if i.name.startswith("past_key_values."))
    dims = past.type.tensor_type.shape.dim
    return max(o.version for o in m.opset_import if o.domain in ("", "ai.onnx")), dims[1].dim_value, dims[3].dim_value


def _move_onnx(src_dir: Path, src_name: str, dst_dir: Path) -> None:
    """Move an ONNX model and its external data files into dst_dir as model.onnx (+ data)."""
    for p in src_dir.iterdir():
        if p.name == src_name:
            os.replace(p, dst_dir / "model.onnx")
        elif p.suffix != ".json" and p.name.startswith(Path(src_name).stem):
            os.replace(p, dst_dir / p.name)


def _versions() -> dict:
    import importlib.metadata as md

    out = {}
    for pkg in ("torch", "transformers", "optimum-onnx", "onnxruntime", "onnx"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    return out


def _fix_gguf_tokenizer(src: Source, work: Path, quiet: bool) -> str:
    """SentencePiece GGUF vocabularies (Gemma): transformers' conversion is wrong, rebuild it."""
    if not src.is_gguf:
        return "transformers"
    from .gguf_tokenizer import read_vocab, write_tokenizer

    gguf = Path(src.path) / src.gguf_file
    try:
        read_vocab(gguf)
    except ValueError:
        return "transformers (GGUF)"           # BPE vocabularies (SmolLM2) convert correctly
    _log("rebuilding the SentencePiece BPE tokenizer from the GGUF vocabulary", quiet)
    write_tokenizer(gguf, work)
    return "rebuilt from GGUF vocabulary (export/gguf_tokenizer.py)"


# the decode graph's float type: fp16 (the GPU's) takes the gathered attention (export/prefix_graph.py)
DTYPES = ("fp32", "fp16")
# the decode graph's weights: fp32, or a GGUF file's own 4-bit blocks (export/gguf_weights.py)
WEIGHTS = ("fp32", "gguf")


class ParityFailed(DBSError):
    """The exported graph does not reproduce the checkpoint's logits."""


def _build(src: Source, work: Path, optimize: bool, quantize: str | None, quiet: bool, dtype: str = "fp32",
           weights: str = "fp32", accuracy: int = 0, row_layout: bool = False, attention: str | None = None) -> dict:
    """Write the whole export into `work`; returns the manifest. A decode graph on a GGUF file's
    blocks leaves out model.onnx (the row layout, fp32: four times the file) unless `row_layout`."""
    config = load_config(src)
    check_supported(config)
    t0 = time.perf_counter()
    _log(f"loading {src.name} with transformers", quiet)
    model, tok = load_torch_model(src)
    large = _param_bytes(model) >= TWO_GB - 64 * 1024**2
    checkpoint = src.path
    if src.is_gguf:  # optimum reads safetensors checkpoints: dequantised GGUF -> fp32 checkpoint
        checkpoint = str(work / "_checkpoint")
        model.save_pretrained(checkpoint)
        tok.save_pretrained(checkpoint)
    raw = work / "_onnx"
    _log(f"exporting to ONNX ({TASK}{', external data' if large else ''})", quiet)
    _onnx_export(checkpoint, raw, not large and not _row_layout_goes(config, weights, row_layout))
    onnx_path, steps = raw / "model.onnx", ["export"]
    from .fuse import fuse_attention

    report_fuse = fuse_attention(onnx_path, config)
    _log(f"attention fusion: {report_fuse['reason']}", quiet)
    if report_fuse["applied"]:
        steps.append("fuse_attention")
    report_opt = None
    if optimize:
        from .optimize import optimize as run_optimize

        _log("optimising the graph (onnxruntime transformers optimizer)", quiet)
        (work / "_opt").mkdir()
        report_opt = run_optimize(onnx_path, work / "_opt" / "model.onnx", config, large)
        _log(f"optimisation: {report_opt['reason']} {report_opt['fusions']}", quiet)
        if report_opt["applied"]:
            onnx_path, steps = work / "_opt" / "model.onnx", steps + ["optimize"]
    report_q = None
    if quantize:
        from .quantize import quantize as run_quantize

        _log(f"quantising weights ({quantize})", quiet)
        (work / "_q").mkdir()
        report_q = run_quantize(onnx_path, work / "_q" / "model.onnx", quantize)
        onnx_path, steps = work / "_q" / "model.onnx", steps + ["quantize"]
    _move_onnx(onnx_path.parent, onnx_path.name, work)
    tok.save_pretrained(str(work))
    tokenizer_note = _fix_gguf_tokenizer(src, work, quiet)
    model.config.save_pretrained(str(work))
    for junk in ("_checkpoint", "_onnx", "_opt", "_q"):
        shutil.rmtree(work / junk, ignore_errors=True)
    manifest = {**_describe(src, config, model, tok, work), "dtype": _dtype(quantize),
                "external_data": large, "steps": steps, "attention_fusion": report_fuse, "optimize": report_opt,
                "quantize": report_q, "tokenizer": tokenizer_note, "files": _files(work), "versions": _versions()}
    mode = "int8" if quantize else ("optimize" if "optimize" in steps else "fp32")
    _check_parity(model, work, manifest, mode, src.name, t0, quiet)
    manifest["prefix_decode"] = _prefix_decode(model, work, quantize, quiet, dtype=dtype,
                                               gguf=Path(src.path) / src.gguf_file if weights == "gguf" else None,
                                               accuracy=accuracy, attention=attention)
    if manifest["prefix_decode"]["written"] and _row_layout_goes(config, weights, row_layout):
        (work / "model.onnx").unlink()
        manifest["onnx"] = None
    manifest["files"] = _files(work)
    (work / MANIFEST).write_text(json.dumps(manifest, indent=2))
    return manifest


def _row_layout_goes(config, weights: str, row_layout: bool) -> bool:
    """Whether model.onnx only checks the decode graph and then goes: a decode graph on a GGUF
    file's blocks, of a family that has one, and no `row_layout` asked for. Optimum's
    post-processing of it is then skipped (the tied head stays stored twice, for the check)."""
    from . import prefix_graph

    if weights != "gguf" or row_layout:
        return False
    try:
        prefix_graph.family(config)
    except ValueError:
        return False
    return True


def _dtype(quantize: str | None) -> str:
    """The manifest's dtype of an export quantised by `quantize` (None: fp32)."""
    return {None: "float32", "int8": "int8-dynamic"}.get(quantize, quantize)


def _describe(src: Source, config, model, tok, work: Path) -> dict:
    """The manifest's description of the model exported to `work`/model.onnx: its source, its
    sizes (the KV heads and head size as the graph takes them), its end tokens."""
    opset, kv_heads, head_dim = _graph_facts(work / "model.onnx")
    return {
        "format_version": EXPORT_FORMAT_VERSION,
        "source": src.name,
        "gguf_file": src.gguf_file,
        "gguf_quantization": gguf_file_type(src),
        "architecture": (config.architectures or [type(model).__name__])[0],
        "model_type": config.model_type,
        "vocab_size": int(model.get_output_embeddings().weight.shape[0]),
        "num_layers": int(config.num_hidden_layers),
        "num_heads": int(config.num_attention_heads),
        "num_kv_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_size": int(config.hidden_size),
        "max_positions": int(getattr(config, "max_position_embeddings", 0) or getattr(config, "n_positions", 0)),
        "eos_token_ids": _eos_ids(model, tok),
        "opset": opset,
        "onnx": "model.onnx",
    }


def _check_parity(model, work: Path, manifest: dict, mode: str, name: str, t0: float, quiet: bool) -> None:
    """model.onnx in `work` against the PyTorch model; the result goes into the manifest (written),
    ParityFailed when it does not hold."""
    (work / MANIFEST).write_text(json.dumps(manifest, indent=2))
    _log("parity check: ONNX vs PyTorch (prefill + 3 cached decode steps)", quiet)
    result = parity_mod.run_parity(model, OnnxModel(work))
    ok, why = parity_mod.judge(result, mode)
    manifest["parity"] = dict(result, mode=mode, passed=ok, criterion=why)
    manifest["export_seconds"] = round(time.perf_counter() - t0, 1)
    (work / MANIFEST).write_text(json.dumps(manifest, indent=2))
    _log(f"parity: {why} -> {'ok' if ok else 'FAILED'}", quiet)
    if not ok:
        raise ParityFailed(f"parity check failed for {name} ({mode}): {why}")


def _files_beside(src: Path, work: Path, skip: tuple, link: bool = False) -> None:
    """An export's files into `work`, but its manifest and those starting with `skip`: copied, or
    hard-linked where `link` and the file system allows (a copy elsewhere)."""
    for f in src.iterdir():
        if not f.is_file() or f.name == MANIFEST or f.name.startswith(skip):
            continue
        if link:
            with contextlib.suppress(OSError):      # another file system: copied below
                os.link(f, work / f.name)
                continue
        shutil.copy2(f, work / f.name)


def _quantised_from(fp32: Path, work: Path, method: str, model, quiet: bool) -> dict:
    """A quantised export written into `work` from a finished fp32 export `fp32` of the same model
    (`--quantize auto`): its graphs quantised as `_build` would quantise them, the rest copied,
    the same parity checks; no second export from PyTorch."""
    from .quantize import quantize as run_quantize

    t0 = time.perf_counter()
    base = json.loads((fp32 / MANIFEST).read_text())
    graphs = ("model.onnx", DECODE_GRAPH)
    _files_beside(fp32, work, graphs)        # tokenizer and config files
    _log(f"quantising weights ({method}) from the fp32 export", quiet)
    report_q = run_quantize(fp32 / "model.onnx", work / "model.onnx", method)
    manifest = {k: v for k, v in base.items() if k not in ("parity", "prefix_decode", "quantize_auto")}
    manifest.update(dtype=_dtype(method),
                    steps=base["steps"] + ["quantize"], quantize=report_q, files=_files(work))
    _check_parity(model, work, manifest, "int8", base["source"], t0, quiet)
    fp32_decode = fp32 / DECODE_GRAPH if base.get("prefix_decode", {}).get("written") else None
    manifest["prefix_decode"] = (_prefix_decode(model, work, method, quiet, fp32_graph=fp32_decode) if fp32_decode
                                 else base.get("prefix_decode"))
    manifest["files"] = _files(work)
    (work / MANIFEST).write_text(json.dumps(manifest, indent=2))
    return manifest


def _providers() -> list[str]:
    import onnxruntime as ort

    return ort.get_available_providers()


def float16_from(fp32: Path, out: Path, quiet: bool = False, attention: str | None = None) -> dict:
    """The `--dtype fp16` export of a model at `out`, from a finished fp32 export `fp32` of it: its
    files linked (model.onnx stays fp32), the decode graph exported again with the attention
    `attention` (None: fp16's) and converted to float16, with the same checks as `--dtype fp16`; no
    second export of model.onnx (on GPT-2 large, most of an export's time)."""
    from .source import load_torch_model, resolve

    def write(work: Path) -> dict:
        base = json.loads((Path(fp32) / MANIFEST).read_text())
        _files_beside(Path(fp32), work, (DECODE_GRAPH,), link=True)
        model = load_torch_model(resolve(base["source"]))[0]
        manifest = {k: v for k, v in base.items() if k != "prefix_decode"}
        manifest["files"] = _files(work)
        (work / MANIFEST).write_text(json.dumps(manifest, indent=2))       # what the parity check reads
        manifest["prefix_decode"] = _prefix_decode(model, work, None, quiet, dtype="fp16", attention=attention)
        manifest["files"] = _files(work)
        (work / MANIFEST).write_text(json.dumps(manifest, indent=2))
        return manifest

    return _whole(Path(out).expanduser(), write)


def _gguf_blocks(model, gguf: Path, quiet: bool, accuracy: int) -> dict:
    """The model's linear layers swapped for the GGUF file's blocks (`gguf_weights.quantize_linears`);
    the manifest's record of each tensor's type as stored and as run."""
    from .gguf_weights import quantize_linears

    tensors = quantize_linears(model, gguf, accuracy)
    weights = {"accuracy_level": accuracy, "stored_as_run": dict(Counter(f"{t[1]} -> {t[2]}" for t in tensors.values())),
               "tensors": {name: {"gguf": t[0], "stored": t[1], "run": t[2]} for name, t in tensors.items()}}
    _log(f"the GGUF file's blocks kept: {weights['stored_as_run']}", quiet)
    return weights


def _prefix_decode(model, work: Path, quantize: str | None, quiet: bool, fp32_graph: Path | None = None,
                   dtype: str = "fp32", gguf: Path | None = None, accuracy: int = 0,
                   attention: str | None = None) -> dict:
    """The decode graph (export/prefix_graph.py) beside model.onnx, checked against it;
    optional: a model it cannot serve keeps the row layout, and the manifest says why.
    `fp32_graph`: quantise that decode graph (of an fp32 export of the model) instead of exporting one.
    `dtype` "fp16": the graph with the gathered attention, checked in fp32, then in float16 (the
    GPU's graph; model.onnx stays fp32). `gguf`: the file whose 4-bit blocks the graph keeps (the
    model's linear layers swapped for them, last: nothing uses the model after). `attention`: the
    graph's form (`prefix_graph.ATTENTIONS`; None: gathered for fp16, else split)."""
    from . import prefix_graph

    try:
        prefix_graph.family(model.config)
    except ValueError as e:
        return _left_out(str(e), quiet)
    _log("prefix-shared decode graph + parity against model.onnx", quiet)
    try:
        # in a folder of its own: over 2 GB, torch writes one file per tensor beside the graph
        weights = _gguf_blocks(model, gguf, quiet, accuracy) if gguf is not None else None
        if fp32_graph is None:
            fp32 = work / "_decode" / DECODE_GRAPH
            info = prefix_graph.export_prefix_decoder(model, fp32,
                                                      attention=attention or ("gathered" if dtype == "fp16" else "split"))
        else:
            fp32 = fp32_graph
            info = {k: v for k, v in json.loads((fp32.parent / MANIFEST).read_text())["prefix_decode"].items()
                    if k not in ("written", "criterion", "max_abs_logit_diff", "mean_kl", "quantize")}
        if quantize:                        # the same quantisation as model.onnx
            from .quantize import quantize as run_quantize

            info["quantize"] = run_quantize(fp32, work / DECODE_GRAPH, quantize)
        else:                               # the graph and its one data file (if over 2 GB)
            for f in fp32.parent.glob(DECODE_GRAPH + "*"):
                os.replace(f, work / f.name)
        if weights is not None:
            info["weights"] = weights
        info.update(prefix_graph.parity(work))
        if dtype == "fp16" and info["max_abs_logit_diff"] < 1e-3:
            _log("the decode graph in float16 + parity against model.onnx", quiet)
            info["float32"] = {k: info.pop(k) for k in ("max_abs_logit_diff", "mean_kl", "top1_agreement")}
            info.update(prefix_graph.to_float16(work / DECODE_GRAPH))
            # float16 is the GPU's: checked there where there is one
            on = "cuda" if "CUDAExecutionProvider" in _providers() else "cpu"
            info.update(prefix_graph.parity(work, provider=on), parity_provider=on)
    except Exception as e:                  # noqa: BLE001 -- optional graph: the export stands without it
        for f in work.glob(DECODE_GRAPH + "*"):
            f.unlink()
        return _left_out(f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}", quiet)
    finally:
        shutil.rmtree(work / "_decode", ignore_errors=True)
    # against model.onnx of the same export: fp32 graphs agree to float rounding; int8 ones differ
    # in their activation scales (prefill is column by column here), so the int8 export criterion
    ok, why = parity_mod.judge(info, "int8") if quantize or dtype == "fp16" or (gguf and accuracy) else \
        (info["max_abs_logit_diff"] < 1e-3, f"max |logit diff| {info['max_abs_logit_diff']:.2e}")
    if not ok:
        (work / DECODE_GRAPH).unlink()
        return _left_out(f"parity against model.onnx: {why}", quiet)
    return {"written": True, "criterion": why, **info}


def _left_out(reason: str, quiet: bool) -> dict:
    """The manifest's entry of a decode graph not written, and the export's line that says so: the
    model then generates on model.onnx, one cache row per candidate (slower, the same search)."""
    said = reason if reason.startswith("no prefix-shared") else f"no prefix-shared decode graph: {reason}"
    _log(f"{said}; generation runs on model.onnx, one cache row per candidate", quiet)
    return {"written": False, "reason": reason}


def export_model(model: str, out: str | os.PathLike, optimize: bool = False, quantize: str | None = None,
                 force: bool = False, quiet: bool = False, dtype: str = "fp32", weights: str | None = None,
                 accuracy: int | None = None, row_layout: bool = False, attention: str | None = None) -> dict:
    """`dtype` "fp16": the decode graph in float16 with the gathered attention, for the CUDA provider.
    `weights` "gguf": a GGUF file's 4-bit blocks kept in the decode graph (`export/gguf_weights.py`);
    None: "gguf" for a GGUF source exported in fp32 without `quantize`, else "fp32". `accuracy`: the
    blocks' MatMulNBits accuracy level (`gguf_weights.ACCURACY_LEVELS`; None: `ACCURACY`).
    `row_layout`: keep model.onnx (the row layout) beside a decode graph on a GGUF file's blocks.
    `attention`: the decode graph's attention (`prefix_graph.ATTENTIONS`; None: gathered for fp16,
    else split)."""
    out = Path(out).expanduser()
    from .quantize import AUTO, METHODS

    if quantize is not None and quantize not in METHODS + (AUTO,):
        raise DBSError(f"`--quantize` must be one of {METHODS + (AUTO,)}, got {quantize!r}")
    if dtype not in DTYPES:
        raise DBSError(f"`--dtype` must be one of {DTYPES}, got {dtype!r}", "dtype", dtype)
    if dtype != "fp32" and quantize is not None:
        raise DBSError(f"`--dtype {dtype}` and `--quantize` do not go together: choose one", "dtype", dtype)
    if weights is not None and weights not in WEIGHTS:
        raise DBSError(f"`--weights` must be one of {WEIGHTS}, got {weights!r}", "weights", weights)
    if weights == "gguf" and (quantize is not None or dtype != "fp32"):
        raise DBSError("`--weights gguf` keeps the file's own quantisation: it goes with neither `--quantize` nor "
                       "`--dtype fp16`", "weights", weights)
    if accuracy is not None and accuracy not in ACCURACY_LEVELS:
        raise DBSError(f"`--accuracy-level` must be one of {ACCURACY_LEVELS}, got {accuracy!r}", "accuracy_level", accuracy)
    if attention is not None and attention not in ATTENTIONS:
        raise DBSError(f"`--attention` must be one of {ATTENTIONS}, got {attention!r}", "attention", attention)
    if out.exists() and not force:
        raise DBSError(f"output directory {out} exists; pass --force to replace it")
    src = resolve(model)
    fd, log = tempfile.mkstemp(prefix="dbs-fast-export-", suffix=".log")
    os.close(fd)
    try:
        with _stderr_to(Path(log)), gguf_read_once():
            if quantize == AUTO:
                manifest = _export_auto(src, out, optimize, quiet)
            else:
                manifest = _export_once(src, out, optimize, quantize, quiet, dtype, weights,
                                         ACCURACY if accuracy is None else accuracy, row_layout, attention)
    except BaseException:
        if Path(log).stat().st_size:
            print(f"[export] what the exporters wrote is in {log}", file=sys.stderr, flush=True)
        else:
            Path(log).unlink()           # nothing to read: not left behind in the temp folder
        raise
    lines = len(Path(log).read_text(errors="replace").splitlines())
    shutil.move(log, out / EXPORT_LOG)
    (out / EXPORT_LOG).chmod(0o644)      # mkstemp makes it private; the export's files are ordinary ones
    _log(f"wrote {out} ({sum(manifest['files'].values()) / 1e6:.1f} MB); the exporters' {lines} lines of "
         f"warnings and logs are in {out / EXPORT_LOG}", quiet)
    return manifest


def _export_auto(src: Source, out: Path, optimize: bool, quiet: bool) -> dict:
    """`--quantize auto`: fp32 exported beside `out`, every quantisation made from it (its graphs
    quantised, no second export from PyTorch), each parity-checked;
    one decode step of each that passes is timed on this host (the graph the engine loads, at
    the paper's b x s rows); the fastest (`quantize.choose`) is moved into place, the rest removed.
    The manifest records the host, the times and what parity refused."""
    from .quantize import AUTO, MARGIN, choose, plan
    from .timing import BEAMS, CANDIDATES, PREFIX, step_seconds

    trials: dict[str | None, Path] = {}
    seconds: dict[str | None, float] = {}
    refused: dict[str, str] = {}
    model = None
    try:
        for q in plan(AUTO):
            name = q or "fp32"
            trials[q] = d = out.parent / f".{out.name}.auto-{name}"
            _log(f"--quantize auto: exporting {name}", quiet)
            try:
                if q is None:
                    _export_once(src, d, optimize, q, quiet)
                else:                           # from the fp32 trial: one export from PyTorch in all
                    model = model or load_torch_model(src)[0]
                    _derive_once(trials[None], d, q, model, quiet)
            except ParityFailed as e:
                if q is None:                   # fp32 is the reference: its failure is the export's
                    raise
                refused[name] = str(e)
                _log(f"--quantize auto: {name} refused ({e})", quiet)
                continue
            seconds[q] = step_seconds(d)
            _log(f"--quantize auto: {name}: {1e3 * seconds[q]:.0f} ms per decode step at "
                 f"{BEAMS}x{CANDIDATES} rows", quiet)
        chosen = choose(seconds)
        manifest = json.loads((trials[chosen] / MANIFEST).read_text())
        manifest["quantize_auto"] = {
            "host": cpu_signature(), "chose": chosen or "fp32",
            "step_ms": {(q or "fp32"): round(1e3 * t, 2) for q, t in seconds.items()}, "refused": refused,
            "setting": {"beams": BEAMS, "candidates": CANDIDATES, "prefix": PREFIX, "margin": MARGIN},
            "rule": "the fastest decode step of the graph the engine loads; fp32 unless a quantised export "
                    f"is faster by the margin ({MARGIN:.0%})"}
        with _disk_full_is_clear(out):
            (trials[chosen] / MANIFEST).write_text(json.dumps(manifest, indent=2))
            _place(trials[chosen], out)
        _log(f"--quantize auto: chose {chosen or 'fp32'}", quiet)
    finally:
        for d in trials.values():
            shutil.rmtree(d, ignore_errors=True)
    return manifest


def _export_once(src: Source, out: Path, optimize: bool, quantize: str | None, quiet: bool,
                 dtype: str = "fp32", weights: str | None = "fp32", accuracy: int = 0,
                 row_layout: bool = False, attention: str | None = None) -> dict:
    """One export into a temporary directory beside `out`, moved into place only when it is whole."""
    if weights is None:                 # a GGUF file keeps its blocks where nothing else quantises
        weights = "gguf" if src.is_gguf and quantize is None and dtype == "fp32" else "fp32"
    if weights == "gguf" and not src.is_gguf:
        raise DBSError(f"`--weights gguf` keeps a GGUF file's blocks: {src.name} is not a GGUF file", "weights", weights)
    return _whole(out, lambda work: _build(src, work, optimize, quantize, quiet, dtype, weights, accuracy,
                                                row_layout, attention))


def _derive_once(fp32: Path, out: Path, method: str, model, quiet: bool) -> dict:
    """`_quantised_from` the fp32 export, moved into place at `out` only when it is whole."""
    return _whole(out, lambda work: _quantised_from(fp32, work, method, model, quiet))


def _whole(out: Path, write) -> dict:
    """`write(work)` into a temporary directory beside `out`, then moved into place."""
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=_aside(out, "tmp"), dir=out.parent))
    work.chmod(0o755)  # mkdtemp makes it private; the export is an ordinary directory
    try:
        with _disk_full_is_clear(out):
            manifest = write(work)
            _place(work, out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return manifest


ASIDE = ("tmp", "old")      # the folders beside an export while it is written, and while one is swapped out


def _aside(out: Path, kind: str) -> str:
    """The name prefix of `out`'s folder of `kind` (ASIDE) beside it."""
    return f".{out.name}.{kind}-"


def _place(work: Path, out: Path) -> None:
    """Move a whole export into place; with --force an existing `out` is swapped, then dropped."""
    if out.exists():
        old = Path(tempfile.mkdtemp(prefix=_aside(out, "old"), dir=out.parent))
        os.replace(out, old / "x")
        os.replace(work, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(work, out)


@contextlib.contextmanager
def _disk_full_is_clear(out: Path):
    """A full disk anywhere in an export: a clear error (the temporary directories go with it)."""
    try:
        yield
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise DBSError(f"no space left on the device while exporting to {out}; nothing was written") from None
        raise


def ensure_embedded(name: str = "default", quiet: bool = False, row_layout: bool = False) -> Path:
    """An embedded model (`default`, `gemma3-270m`) exported once under DBS_FAST_HOME and reused
    after; `row_layout`: with model.onnx (the judge's; the generator's decode graph needs none).
    One process exports at a time (a file lock beside the export): the others, such as a Ray
    job's workers or a second server started on a fresh home, wait for it and use its export."""
    d = embedded_model_dir(name)
    if _export_due(d, name, row_layout) is None:
        return d
    with _one_export_at_a_time(d, name, quiet):
        why = _export_due(d, name, row_layout)         # written meanwhile by the process we waited for
        if why is None:
            return d
        _log(why, quiet)
        for left in [p for kind in ASIDE for p in d.parent.glob(_aside(d, kind) + "*")]:
            shutil.rmtree(left, ignore_errors=True)    # a process that died exporting it left these
        from ..numba_runtime import compiled_meanwhile

        with compiled_meanwhile():          # the first generation's kernels, on the other core
            export_model(name, d, force=d.exists(), quiet=quiet, row_layout=row_layout)
    return d


def _export_due(d: Path, name: str, row_layout: bool) -> str | None:
    """Why the embedded model `name` is to be exported into `d` (a line for the log), or None."""
    if not (d / MANIFEST).is_file():
        return f"first use: exporting the embedded model {name!r} to {d} (once)"
    if not current_export(d):
        return (f"the export of {name!r} in {d} is of another format version than this dbs-fast reads "
                f"({EXPORT_FORMAT_VERSION}): exporting it again (once)")
    if why := _decode_graph_due(d, row_layout):
        return f"the export of {name!r} in {d} is not what this version writes ({why}): exporting it again (once)"
    return None


@contextlib.contextmanager
def _one_export_at_a_time(d: Path, name: str, quiet: bool):
    """Hold `d`'s export lock (`.<dir>.lock` beside it), saying so when another process holds it."""
    from filelock import FileLock, Timeout

    lock = FileLock(str(d.parent / f".{d.name}.lock"))
    try:
        d.parent.mkdir(parents=True, exist_ok=True)
        lock.acquire(timeout=0)
    except Timeout:
        _log(f"another process is exporting the embedded model {name!r} to {d}: waiting for it", quiet)
        lock.acquire()
    except OSError as e:
        raise DBSError(f"the embedded model {name!r} is exported on first use into {d.parent}, which cannot be "
                       f"written ({e.strerror}): point DBS_FAST_HOME at a writable folder") from None
    try:
        yield
    finally:
        lock.release()


def _decode_graph_due(d: Path, row_layout: bool = False) -> str | None:
    """Why an export is to be written again (`manifest.stale_embedded`, or an embedded model
    exported before its family had a decode graph), or None."""
    from types import SimpleNamespace

    from . import prefix_graph

    m = json.loads((d / MANIFEST).read_text())
    graph = m.get("prefix_decode") or {}
    why = stale_embedded(m, row_layout)
    if why:
        return why
    if graph.get("written", True) or not str(graph.get("reason", "")).startswith("no prefix-shared decode graph for "
                                                                                  "model type"):
        return None              # written, or left out for another reason (a failed parity stays failed)
    try:
        prefix_graph.family(SimpleNamespace(model_type=m.get("model_type")))
    except (ValueError, AttributeError):
        return None
    return "its family has a decode graph now"

