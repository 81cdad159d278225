"""`dbs-fast` command line: export, generate, bench, eval, serve, run-batch. Bad input -> message + exit 2."""
from __future__ import annotations

import argparse
import json
import sys

from .config import (
    CHOICES,
    COMMONGEN,
    COMMONGEN_CONTEXT,
    DEFAULT_CONTEXT,
    OPTIONS,
    PAPER,
    SEED_MAX,
    TASKS,
    DBSConfig,
    preset,
)
from .errors import DBSError
from .export.gguf_weights import ACCURACY, ACCURACY_LEVELS
from .export.prefix_graph import ATTENTIONS

FLAG = {name: flag for name, flag, *_ in OPTIONS}            # DBSConfig field -> CLI flag
PROVIDER_HELP = "execution provider: cuda needs onnxruntime-gpu (see the GPU guide); falls back to cpu with a warning"
CUDA_GRAPH_HELP = ("with --provider cuda: each decode step one captured CUDA graph, at bucket shapes (an fp16 or "
                   "--attention gathered export; see the GPU guide)")
THREADS_HELP = "threads for ONNX Runtime and the kernel (default: $DBS_FAST_THREADS, else all cores)"


class HelpFormatter(argparse.HelpFormatter):
    """Every flag's help ends with its default, where it has one and the help does not say it."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "%(default)" in text or "(default" in text or action.default is None or action.default is False \
                or action.default == argparse.SUPPRESS or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)"


class Parser(argparse.ArgumentParser):
    """A bad value is one line on stderr and exit 2; an unknown or missing flag also shows the
    command's usage."""

    def error(self, message):
        if message.startswith(("unrecognized arguments", "the following arguments are required")):
            self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}\n")


def seed(v: str) -> int:
    """argparse type of --seed: an integer in 0..2**63-1."""
    n = int(v)
    if not 0 <= n <= SEED_MAX:
        raise argparse.ArgumentTypeError(f"must be an integer in 0..{SEED_MAX}, got {v}")
    return n


def threads(v: str) -> int:
    n = int(v)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {v}")
    return n


def _add_export(sub):
    p = sub.add_parser("export", help="Hugging Face checkpoint -> ONNX with KV cache + manifest")
    p.add_argument("--model", required=True, help="a local transformers checkpoint dir, a GGUF file (FILE.gguf), "
                                                  "`default` (SmolLM2-135M) or `gemma3-270m` (the embedded models), "
                                                  "or a hub id where the hub is reachable")
    p.add_argument("--out", required=True, help="output directory (refused if it exists, unless --force)")
    p.add_argument("--optimize", action="store_true", help="onnxruntime transformer graph fusions")
    p.add_argument("--quantize", choices=["int8", "int8-block", "int4-block", "auto"],
                   help="int8: dynamic (fastest; fails parity on outlier-heavy models such as the default); "
                        "int8-block: weight-only 8-bit blocks of 32 (MatMul layers only); int4-block: the same in 4 bits; "
                        "auto: exports fp32, int8 and int8-block, times a decode step of each that passes parity on this CPU and keeps "
                        "the fastest (fp32 unless a quantised one is 5%% faster)")
    p.add_argument("--dtype", choices=["fp32", "fp16"], default="fp32",
                   help="fp16: the decode graph in float16 with one attention per candidate over its own keys, "
                        "for --provider cuda (model.onnx stays fp32); default %(default)s")
    p.add_argument("--weights", choices=["fp32", "gguf"], default=None,
                   help="gguf: keep a GGUF file's blocks (Q4_0, Q4_1, Q4_K; Q8_0, Q5_0, Q6_K at --accuracy-level 4) "
                        "in the decode graph as ONNX Runtime's MatMulNBits and the embeddings as "
                        "GatherBlockQuantized, instead of fp32 copies (other types run in fp32), and leave out "
                        "model.onnx unless --row-layout; default gguf for a GGUF file (the embedded models too) "
                        "without --quantize or --dtype fp16, else fp32")
    p.add_argument("--accuracy-level", type=int, choices=ACCURACY_LEVELS, default=None,
                   help="with --weights gguf, MatMulNBits' accuracy level: 0 computes on the blocks in fp32, exact "
                        "(Q8_0 then runs in fp32, which has no fast 8-bit kernel at level 0); 4 quantizes the "
                        "activations to int8 per block, as llama.cpp does, and keeps Q8_0 as blocks too (smaller "
                        f"and faster, not exact); default {ACCURACY}")
    p.add_argument("--attention", choices=ATTENTIONS, default=None,
                   help="the decode graph's attention: split reads each request's context and each beam's prefix "
                        "once (long contexts, many candidates); gathered gives each candidate its own copy of its "
                        "keys in fewer nodes (a GPU, or one candidate over a short context); fused is gathered as one "
                        "ONNX Attention node a layer (opset 23); default gathered for --dtype fp16, else split")
    p.add_argument("--row-layout", action="store_true",
                   help="with --weights gguf, write model.onnx too (the row layout, --kv-layout rows: fp32, "
                        "about four times the GGUF file); without it the export holds the decode graph alone")
    p.add_argument("--force", action="store_true", help="replace an existing output directory")
    p.add_argument("--quiet", action="store_true", help="print only the manifest's summary")
    p.set_defaults(func=_run_export)


def _run_export(a) -> int:
    try:
        from .export.convert import export_model
    except ImportError as e:
        raise DBSError(f"export needs the export extra (`pip install 'dbs-fast[export]'`): {e}") from None
    m = export_model(a.model, a.out, optimize=a.optimize, quantize=a.quantize, force=a.force, quiet=a.quiet,
                     dtype=a.dtype, weights=a.weights, accuracy=a.accuracy_level,
                     row_layout=a.row_layout, attention=a.attention)
    keys = ("source", "architecture", "dtype", "steps", "parity") + (("quantize_auto",) if a.quantize == "auto" else ())
    print(json.dumps({k: m[k] for k in keys}, indent=2))
    return 0


KEYWORD_SYNTAX = ('comma-separated; a phrase is words separated by spaces ("ice cream"), alternatives are '
                  'separated by | ("run|ran|running"): any one satisfies the keyword')


def _add_config_flags(p, title: str) -> None:
    d = DBSConfig()
    g = p.add_argument_group(title)
    for name, flag, typ, text in OPTIONS:
        if typ == "switch":
            g.add_argument(flag, dest=name, action="store_true", default=None, help=text)
        else:
            g.add_argument(flag, dest=name, type=typ, default=None, choices=CHOICES.get(name),
                           help=f"{text} (default {getattr(d, name)!r})")
    g.add_argument("--paper", action="store_true",
                   help="the paper's protocol: no repetition control, fixed max-new-tokens (flags above override)")


def config_from_args(a, task: str | None = None, chat: bool = False, **extra) -> tuple[DBSConfig, str]:
    """The config and the context from the parsed flags: the preset (`config.preset`: the task's,
    --paper's, the chat door's or the default), then the flags given, then `extra`."""
    from dataclasses import replace

    base, context = preset(task, a.paper, chat)
    given = {name: getattr(a, name) for name, *_ in OPTIONS if getattr(a, name) is not None}
    return replace(base, **given, **extra), (context if a.context is None else a.context)


def _add_kv_layout(p):
    from .backend import SCHEDULES
    from .kv.prefix_cache import KV_LAYOUTS

    p.add_argument("--kv-layout", default="auto", choices=KV_LAYOUTS,
                   help="KV cache: prefix = the prefix cache (each request's context and each beam's prefix once; needs decode.onnx from this "
                        "version's export), rows = one cache row per candidate, auto = prefix where available")
    p.add_argument("--schedule", default="distinct", choices=SCHEDULES,
                   help="distinct (default): each distinct candidate history through the model once, a chunk's last "
                        "token for the kept beams only (on the prefix cache); plain: every row at every step. The "
                        "same texts either way")


def preset_flags(settings: dict, quoted: bool = False) -> list[str]:
    """A preset's settings as the flags that give them ("--lambda 1.0"; "no --lambda-ahead" for one it
    leaves unset, which no flag gives)."""
    return [f"no {FLAG[k]}" if v is None else f"{FLAG[k]} {v!r}" if quoted else f"{FLAG[k]} {v}"
            for k, v in settings.items()]


def _add_generate(sub):
    p = sub.add_parser("generate", help="Directed Beam Search: text that contains the keywords, in order")
    p.add_argument("--keywords", help=f'guide words, e.g. "enemy,speed,meet": {KEYWORD_SYNTAX} (none: the '
                   "model's own text, unguided)")
    p.add_argument("--ban", default=None, help='words that must not appear, e.g. "war,gun" (same syntax; every '
                                               'case and leading-space variant is banned)')
    p.add_argument("--context", default=None, help=f"text to continue; '' starts a new document (default: "
                                                   f"{DEFAULT_CONTEXT}; with --task commongen, the task's context)")
    p.add_argument("--task", default=None, choices=TASKS,
                   help="a task preset: commongen = one sentence from unordered concepts (" + " ".join(
                       preset_flags(COMMONGEN)) + " and the task's context, as `eval "
                        "--sets commongen-dev`; flags given override)")
    p.add_argument("--model", default="default", help="exported model dir, `default` (embedded SmolLM2-135M) or `gemma3-270m`")
    p.add_argument("--scorer", default="self", help="`self` or an exported model dir sharing the tokenizer")
    p.add_argument("--embeddings", default="default", help="`default` (GloVe 6B 50-d), GloVe .txt, word2vec .txt/.bin")
    _add_config_flags(p, "search settings")
    p.add_argument("--unguided", action="store_true", help="baseline: no boosts (use with --beams 1 --candidates 1)")
    p.add_argument("--seed", type=seed, default=0, help=f"random seed, 0..{SEED_MAX}: the same seed gives the "
                                                      f"same text")
    p.add_argument("--backend", default="onnx", choices=["onnx", "torch"],
                   help="onnx: the engine; torch: the PyTorch baseline (needs the export extra)")
    _add_kv_layout(p)
    p.add_argument("--provider", default="cpu", choices=["cpu", "cuda"], help=PROVIDER_HELP)
    p.add_argument("--cuda-graph", action="store_true", help=CUDA_GRAPH_HELP)
    p.add_argument("--threads", type=threads, default=None, help=THREADS_HELP)
    p.add_argument("--format", default=None, choices=["text", "json", "markdown"],
                   help="text (keywords in colour on a terminal), json (one object) or markdown (keywords in "
                        "**bold**); default: text")
    p.add_argument("--json", action="store_true", help="the same as --format json")
    p.set_defaults(func=_run_generate)


def highlight(text: str, found: dict, style: str, offset: int = 0) -> str:
    """`text` with the places where the search found each keyword (`found`, as a result gives it:
    spans in the generated text, which starts at `offset` of `text`) marked: "ansi" (colour),
    "markdown" (**bold**) or "text" (unmarked)."""
    if style == "text":
        return text
    on, off = ("\033[1;32m", "\033[0m") if style == "ansi" else ("**", "**")
    spans = sorted({(f["char"] + offset, f["end"] + offset) for f in found.values() if f is not None})
    out, at = [], 0
    for start, end in spans:
        if start >= at:                               # overlapping spans (a keyword listed twice): once
            out += [text[at:start], on, text[start:end], off]
            at = end
    return "".join(out) + text[at:]


def text_style(fmt: str | None) -> str:
    """How text output marks keywords: colour on a terminal, **bold** for markdown, else plain."""
    if fmt == "markdown":
        return "markdown"
    return "ansi" if fmt in (None, "text") and sys.stdout.isatty() else "text"


class Progress:
    """A progress bar on stderr, drawn from the first chunk on (so that an error before any work
    prints on a line of its own) and closed by `close`."""

    def __init__(self, desc: str):
        self.desc, self.bar = desc, None

    def __call__(self, done: int, total: int) -> None:
        if self.bar is None:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=done, unit="chunk", desc=self.desc, leave=False,
                            file=sys.stderr)      # the rate counts from the first chunk, not from 0
        self.bar.total, self.bar.n = total, done
        self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _run_generate(a) -> int:
    fmt = "json" if a.json else a.format
    own_context = a.context is not None or a.task is None     # a task's context is the preset's, not the user's
    cfg, a.context = config_from_args(a, a.task, guided=not a.unguided)
    from .api import DirectedBeamSearch, parse_constraints, resolve_model_dir
    from .preflight import preflight

    parse_constraints(a.keywords, a.ban)       # bad keywords and sizes fail before the model loads
    preflight(resolve_model_dir(a.model, quiet=fmt == "json", row_layout=a.kv_layout == "rows"), cfg, a.context,
              kv_layout=a.kv_layout)
    dbs = DirectedBeamSearch(a.model, a.embeddings, cfg, scorer=a.scorer, backend=a.backend,
                             provider=a.provider, threads=a.threads,
                             quiet=fmt == "json", kv_layout=a.kv_layout, schedule=a.schedule, cuda_graph=a.cuda_graph)
    progress = None if fmt == "json" else Progress("generating")
    try:
        r = dbs.generate(a.context, a.keywords, seed=a.seed, progress=progress, ban=a.ban)
    finally:
        if progress is not None:
            progress.close()
    if fmt == "json":
        print(json.dumps(r.to_json(), allow_nan=False))
        return 0
    if own_context:
        print(highlight(r.text, r.found, text_style(fmt), offset=len(r.context)))
    else:                                   # a task's answer: the generated text alone
        lead = len(r.generated) - len(r.generated.lstrip())
        print(highlight(r.generated.strip(), r.found, text_style(fmt), offset=-lead))
    grader = "the generator grading itself" if a.scorer == "self" else f"scorer {a.scorer}"
    found = sum(r.found.get(k) is not None for k in r.keywords)    # per listed word, as the success rate counts
    words = (f"found {found}/{len(r.keywords)} (success rate {r.success_rate:.2f}, success length "
             f"{r.success_length})" if r.keywords else "no keywords (the model's own text)")
    print(f"\n{words}, stopped: {r.stopped}, "
          f"perplexity {r.perplexity:.2f} [{grader}], {r.seconds:.1f} s, {r.tokens_per_second:.1f} tokens/s "
          f"({r.candidate_tokens_per_second:.0f} candidate tokens/s, backend {a.backend})")
    return 0


def _add_eval(sub):
    p = sub.add_parser("eval", help="evaluation judged by an independent LM: the paper's keyword sets (DBS vs "
                                    "unguided), CommonGen, chat messages, ROC stories")
    p.add_argument("--sets", default="paper",
                   help="paper: the paper's 50 keyword sets (default); roc: 20 ROC storylines; chat: 100 user "
                        "messages with guide words, answered through the chat template, against the model's own "
                        "answers (judged); commongen-dev: the "
                        "993 CommonGen dev concept sets (defaults then: " + ", ".join(
                            preset_flags(COMMONGEN, quoted=True))
                        + f", --context {COMMONGEN_CONTEXT!r}; coverage and BLEU-4 reported); a number N: "
                        "N sets sampled from wordfreq ranks 501-1000 without stop words (with --seed)")
    p.add_argument("--limit", type=int, default=None, help="only the first N sets (after --start)")
    p.add_argument("--start", type=int, default=0, help="skip the first N sets: --start 893 --limit 100 takes "
                                                        "sets 893-992")
    p.add_argument("--seed", type=seed, default=0, help="seed of the generations and of sampled keyword sets")
    p.add_argument("--keywords-file", help="one keyword set per line, comma-separated (or space-separated single "
                                           "words) (instead of --sets)")
    p.add_argument("--context", default=None, help=f"text before every generation (default {DEFAULT_CONTEXT!r}; "
                                                   f"'' starts a document)")
    p.add_argument("--runs", default="dbs,paper,unguided",
                   help="comma-separated: dbs (the settings below), paper (the same with the paper's protocol: "
                        "no repetition control, fixed length), guarantee (the settings below with --guarantee), "
                        "unguided (b = s = 1, no boosts, paper protocol)")
    p.add_argument("--judge", default="auto",
                   help="model that scores the texts: auto (the other embedded model: gemma3-270m for the "
                        "default, default for gemma3-270m), an exported dir, or none")
    p.add_argument("--out", default="eval_out", help="results.jsonl (resumable), summary.json, summary.md, quality.png")
    p.add_argument("--model", default="default", help="exported model dir, `default` or `gemma3-270m`")
    p.add_argument("--scorer", default="self", help="`self` or an exported model dir sharing the tokenizer")
    p.add_argument("--embeddings", default="default", help="`default` (GloVe 6B 50-d), GloVe .txt, word2vec .txt/.bin")
    _add_config_flags(p, "search settings of the `dbs` run")
    p.add_argument("--batch", type=int, default=4, help="keyword sets decoded together in one batch")
    _add_kv_layout(p)
    p.add_argument("--threads", type=threads, default=None, help=THREADS_HELP)
    p.add_argument("--grid", choices=["lambda", "bsk", "all"],
                   help="hyper-parameter sweep instead: lambda in --grid-lambdas at b=s=k=5, and/or "
                        "b, s in --grid-bs x k in --grid-k at lambda 20 (grid.jsonl resumable, grid.md, PNGs)")
    p.add_argument("--grid-lambdas", default="5,10,15,20,25", help="lambda values of --grid lambda")
    p.add_argument("--grid-bs", default="3,5,7,10", help="values for both b and s")
    p.add_argument("--grid-k", default="2,5,10", help="chunk sizes k of --grid bsk")
    p.add_argument("--stories", action="store_true",
                   help="the paper's four ROC story contexts and keywords, printed with keywords highlighted")
    p.add_argument("--frontier", default=None,
                   help="comma-separated --out folders of CommonGen evals: no generation; BLEU-4 against judge "
                        "perplexity for every run in them, beside the human anchor (frontier.md, frontier.png in --out)")
    p.set_defaults(func=_run_eval)


EVAL_RUNS = ("dbs", "paper", "guarantee", "unguided")


def eval_configs(cfg, runs: str) -> dict:
    """{run name: DBSConfig} for `eval`: the given settings, the paper protocol, the unguided baseline."""
    from dataclasses import replace

    names = [r.strip() for r in runs.split(",") if r.strip()]
    bad = [r for r in names if r not in EVAL_RUNS]
    if not names or bad:
        raise DBSError(f"--runs takes a comma-separated subset of {EVAL_RUNS}, got {runs!r}")
    paper = replace(cfg, **PAPER)
    every = {"dbs": cfg, "paper": paper, "guarantee": replace(cfg, guarantee=True),
             "unguided": replace(paper, beams=1, candidates=1, guided=False)}
    return {n: every[n] for n in names}


def _eval_sets(a):
    from .evaluation.runs import builtin_sets, read_sets, sample_sets

    if a.keywords_file:
        return read_sets(a.keywords_file)
    if str(a.sets).isdigit():
        if int(a.sets) < 1:
            raise DBSError(f"`--sets` must be >= 1, got {a.sets}")
        return sample_sets(int(a.sets), a.seed)
    return builtin_sets(a.sets)


def _run_grid(a, dbs, cfg, sets, seed: int) -> int:
    from pathlib import Path

    from .evaluation.runs import grid_configs, run_grid

    try:
        lams = [float(x) for x in a.grid_lambdas.split(",")]
        bs = [int(x) for x in a.grid_bs.split(",")]
        ks = [int(x) for x in a.grid_k.split(",")]
    except ValueError:
        raise DBSError("--grid-lambdas, --grid-bs and --grid-k are comma-separated numbers") from None
    run_grid(dbs, sets, Path(a.out), grid_configs(cfg, a.grid, lams, bs, ks), batch=a.batch, seed=seed)
    print((Path(a.out) / "grid.md").read_text())
    print(f"scorer: {dbs.scorer_name}; model: {dbs.model_dir}; plots in {a.out}")
    return 0


def _eval_engine(a, cfg):
    """The engine `eval` generates with, from its flags."""
    from .api import DirectedBeamSearch

    return DirectedBeamSearch(a.model, a.embeddings, cfg, scorer=a.scorer, threads=a.threads, kv_layout=a.kv_layout,
                              schedule=a.schedule)


def _eval_judge(a, dbs):
    """The judge `--judge` names (auto: the other embedded model), or None for `none`."""
    if a.judge == "none":
        return None
    from .evaluation.judge import Judge, judge_for

    return Judge(judge_for(a.model) if a.judge == "auto" else a.judge, generator_dir=dbs.model_dir, threads=a.threads)


def _run_chat_eval(a, cfg) -> int:
    from pathlib import Path

    from .evaluation.chat import run_chat_eval

    if a.judge == "none":
        raise DBSError("--sets chat is judged: give --judge (auto: the other embedded model)")
    dbs = _eval_engine(a, cfg)
    run_chat_eval(dbs, Path(a.out), _eval_judge(a, dbs), seed=a.seed, limit=a.limit, start=a.start, config=cfg)
    print((Path(a.out) / "summary.md").read_text())
    return 0


def _run_eval(a) -> int:
    from pathlib import Path

    from .evaluation.runs import run_eval

    if a.frontier is not None:
        from .evaluation.runs import frontier

        frontier([Path(d) for d in a.frontier.split(",") if d.strip()], Path(a.out))
        return 0
    if a.batch < 1:
        raise DBSError(f"`--batch` must be >= 1, got {a.batch}")
    if a.limit is not None and a.limit < 1:
        raise DBSError(f"`--limit` must be >= 1, got {a.limit}")
    if a.start < 0:
        raise DBSError(f"`--start` must be >= 0, got {a.start}")
    commongen = a.sets == "commongen-dev" and not a.keywords_file
    cfg, a.context = config_from_args(a, "commongen" if commongen else None,   # the task's preset for its sets
                                      chat=a.sets == "chat")
    if a.sets == "chat":
        return _run_chat_eval(a, cfg)
    configs = eval_configs(cfg, a.runs)
    sets = _eval_sets(a)
    if a.start >= len(sets):
        raise DBSError(f"`--start` must be below the number of sets ({len(sets)}), got {a.start}")
    sets = sets[a.start:][: a.limit]
    seed = a.seed + a.start               # set i's seed is seed + i, as in a run from set 0
    dbs = _eval_engine(a, cfg)
    if a.stories:
        from .evaluation.runs import run_stories

        style = text_style(None)
        for r in run_stories(dbs, Path(a.out), seed=a.seed):
            print(f"{r['context']}  [{', '.join(r['keywords'])}]\n  -> {highlight(r['text'], r['found'], style)}"
                  f"\n     success {r['success_rate']:.2f}, perplexity {r['perplexity']:.1f}\n")
        return 0
    if a.grid:
        return _run_grid(a, dbs, cfg, sets, seed)
    judge = _eval_judge(a, dbs)
    from .evaluation.runs import EvalSets, builtin_refs

    task = EvalSets(sets, a.context, builtin_refs(a.sets)[a.start:] if commongen else None, a.start)
    s = run_eval(dbs, task, configs, Path(a.out), judge=judge, batch=a.batch, seed=seed)
    print((Path(a.out) / "summary.md").read_text())
    print(f"judge: {s['judge']}; model: {s['model']}; plot: {Path(a.out) / 'quality.png'}")
    return 0


def _add_bench(sub):
    from .backend import SCHEDULES

    p = sub.add_parser("bench", help="speed: the ONNX exports vs PyTorch vs a reference-style loop, "
                                     "a decode step's time by stage, roofline")
    p.add_argument("--out", default="bench_out", help="bench.json, bench.md, stages.png, sweep.png")
    p.add_argument("--workdir", default="bench_work", help="checkpoints and exports, reused across runs")
    p.add_argument("--quick", action="store_true", help="10 new tokens, 1 repeat: a few minutes")
    p.add_argument("--repeats", type=int, default=None, help="timed generations per contender (after a cold one)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="new tokens per generation (default 90; "
                                                                      "--quick: 10)")
    p.add_argument("--contenders", default=None,
                   help="comma-separated (default: all of dbs_fast/bench/suite.py's CONTENDERS but the GPU's onnx-fp16, torch-fp16 "
                        "and torch-fp16-compile); onnx-fp32/onnx-int8 "
                        "run the prefix cache (decode.onnx), the -rows ones the row layout, onnx-fp32-plain the prefix "
                        "cache with every row computed (the plain schedule)")
    p.add_argument("--tokenizer", default=None, help="GPT-2 tokenizer dir (default ../shared/data/gpt2-tokenizer)")
    p.add_argument("--checkpoint", default=None, help="a transformers checkpoint instead of random GPT-2 large")
    p.add_argument("--shape", default="gpt2-large", choices=["gpt2-large", "gpt2", "distilgpt2"],
                   help="the random checkpoint's shape")
    p.add_argument("--no-default", action="store_true", help="skip the embedded default model's point")
    p.add_argument("--sweep", default=None, help='b x s points for the plot, e.g. "1x5,3x5,5x10"')
    p.add_argument("--threads", type=threads, default=None, help=THREADS_HELP)
    p.add_argument("--provider", default="cpu", choices=["cpu", "cuda"],
                   help="cuda: the ONNX contenders on the CUDA provider (cache on the GPU), PyTorch on the GPU; "
                        "no roofline (it is ORT's CPU matmul); needs the gpu extra and a CUDA torch")
    p.add_argument("--one-by-one", action="store_true",
                   help="run each contender on its own, one after another (default: onnx-fp32, onnx-int8 and "
                        "torch-fp32 stay loaded together and take turns, generation by generation)")
    p.add_argument("--contexts", default=None, help="only the context-length arm (on --model), e.g. "
                   "2,256,1024,2048: seconds per generation, KV bytes and peak RSS per length (contexts.md)")
    p.add_argument("--model", default=None, help="with --contexts: an exported model dir or an embedded name "
                   "(default: the embedded default)")
    p.add_argument("--shared", type=int, default=None, help="with --contexts: also the time to the first chunk "
                   "of a request whose first N context tokens another request's context shares (the context store)")
    p.add_argument("--schedule", default=None, choices=SCHEDULES,
                   help="with --contexts: distinct (default) computes each distinct row once; plain every row at "
                        "every step, the same rows at every length, so the growth over the floor is the cache's own")
    p.set_defaults(func=_run_bench)


def _numbers(text: str, flag: str, what: str, sep: str = ",") -> list[int]:
    try:
        return [int(x) for x in text.split(sep) if x.strip()]
    except ValueError:
        raise DBSError(f"{flag} must be {what}, got {text!r}") from None


def _run_bench(a) -> int:
    from pathlib import Path

    if a.contexts is not None:
        lengths = _numbers(a.contexts, "--contexts", "comma-separated token counts in 2..100000")
        if not lengths or min(lengths) < 2 or max(lengths) > 100_000:
            raise DBSError(f"--contexts must be comma-separated token counts in 2..100000, got {a.contexts!r}")
        from .bench.contexts import run_contexts

        run_contexts(sorted(lengths), Path(a.out), Path(a.workdir), repeats=a.repeats or 2, threads=a.threads,
                     model=a.model or "default", shared=a.shared, schedule=a.schedule or "distinct")
        return 0
    if a.schedule is not None:
        raise DBSError("`--schedule` goes with `--contexts`; the bench's other arms run both schedules as "
                       "contenders (onnx-fp32 distinct, onnx-fp32-plain plain)")
    for flag, value in (("--model", a.model), ("--shared", a.shared)):
        if value is not None:
            raise DBSError(f"`{flag}` goes with `--contexts`; the bench's other arms run the embedded default "
                           f"and a checkpoint of `--shape` (or `--checkpoint`)")
    try:
        from .bench.suite import DEFAULT_CONTENDERS, run_bench
    except ImportError as e:
        raise DBSError(f"bench needs the export and dev extras: pip install 'dbs-fast[export,dev]' ({e})") from None
    sweep = None
    if a.sweep is not None:
        what = "beams x candidates pairs like 1x5,3x5"
        sweep = [tuple(_numbers(x, "--sweep", what, sep="x")) for x in a.sweep.split(",") if x]
        if not all(len(t) == 2 and min(t) >= 1 for t in sweep):
            raise DBSError(f"--sweep must be {what}, got {a.sweep!r}")
    if (a.repeats is not None and a.repeats < 1) or (a.max_new_tokens is not None and a.max_new_tokens < 1):
        raise DBSError("--repeats and --max-new-tokens must be >= 1")
    run_bench(Path(a.out), Path(a.workdir), quick=a.quick, repeats=a.repeats, max_new_tokens=a.max_new_tokens,
              contenders=[c.strip() for c in a.contenders.split(",") if c.strip()] if a.contenders else DEFAULT_CONTENDERS,
              tokenizer=Path(a.tokenizer) if a.tokenizer else None,
              checkpoint=Path(a.checkpoint) if a.checkpoint else None, shape=a.shape,
              with_default=not a.no_default, threads=a.threads, sweep=sweep, in_turns=not a.one_by_one,
              provider=a.provider)
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = Parser(prog="dbs-fast", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True, parser_class=Parser)
    _add_export(sub)
    _add_generate(sub)
    _add_eval(sub)
    _add_bench(sub)
    _add_serve(sub)
    _add_run_batch(sub)
    for p in sub.choices.values():
        p.formatter_class = HelpFormatter
        p.set_defaults(parser=p)            # an unknown flag is reported with this command's usage
    return ap



def _add_serve(sub):
    from .serving.service import ServiceOptions

    d = ServiceOptions()
    p = sub.add_parser("serve", help="HTTP service: OpenAI's /v1/completions and /v1/chat/completions, POST "
                                     "/v1/generate (JSON or streamed), /health, /metrics, /docs; continuous "
                                     "batching at chunk boundaries (needs the serve extra)")
    p.add_argument("--model", default=d.model, help="exported model dir, `default` (embedded SmolLM2-135M) or `gemma3-270m`")
    p.add_argument("--embeddings", default=d.embeddings, help="`default` (GloVe 6B 50-d), GloVe .txt, word2vec "
                                                               ".txt/.bin")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8000, help="TCP port, 1..65535")
    p.add_argument("--max-rows", type=int, default=d.max_rows,
                   help=f"candidate rows decoded together (a request takes beams x candidates; default {d.max_rows}: "
                        f"two paper-setting requests)")
    p.add_argument("--max-queue", type=int, default=d.max_queue, help="waiting requests beyond this get 429")
    p.add_argument("--threads", type=threads, default=None, help=THREADS_HELP)
    p.add_argument("--provider", default=d.provider, choices=["cpu", "cuda"], help=PROVIDER_HELP)
    p.add_argument("--cuda-graph", action="store_true", help=CUDA_GRAPH_HELP)
    _add_kv_layout(p)
    p.add_argument("--timeout", type=float, default=d.timeout, help="seconds per request (at most)")
    p.add_argument("--grace", type=float, default=d.grace, help="seconds to finish running requests at shutdown")
    p.add_argument("--admit-wait", type=float, default=d.admit_wait,
                   help=f"seconds to wait at a chunk boundary where requests ended for their clients' next requests "
                        f"(default {d.admit_wait}; 0: never wait)")
    p.add_argument("--no-chunked-prefill", dest="chunked_prefill", action="store_false",
                   help="admit a long context joining running requests in one prefill (default: one 256-token "
                        "slice per chunk boundary, so the running requests wait at most one slice)")
    p.add_argument("--api-key", default=None,
                   help="requests to /v1/* need `Authorization: Bearer KEY` (default: $DBS_FAST_API_KEY; unset: open)")
    p.add_argument("--auth-health", action="store_true", help="/health and /metrics need the API key too")
    p.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes,
                   help="a larger request body is refused with 413")
    p.add_argument("--cors-origin", action="append", default=[],
                   help="an origin allowed by CORS (repeat for several; default: none, no CORS headers)")
    p.add_argument("--ray-replicas", type=int, default=None,
                   help="serve N replicas on Ray Serve instead (each its own engine; needs the ray extra)")
    p.add_argument("--ray-address", default=None, help="a running Ray cluster (`auto`), else a local Ray is started")
    p.add_argument("--ray-cpus", type=float, default=None, help="CPUs each replica reserves (default --threads or 1)")
    p.add_argument("--ray-gpus", type=float, default=None,
                   help="GPUs each replica reserves with --provider cuda (default 1; a fraction shares one)")
    p.set_defaults(func=_run_serve)


def _add_run_batch(sub):
    from .serving.service import ServiceOptions

    d = ServiceOptions()
    p = sub.add_parser("run-batch", help="a file of requests, offline: OpenAI's batch format (JSONL) or plain "
                                         "JSONL/CSV with keywords; resumable (needs the serve extra)")
    p.add_argument("-i", "--input", required=True, help="JSONL: OpenAI batch lines ({custom_id, method, url, body}) "
                                                         "or plain objects ({keywords, context?, id?, seed?, and any field of /v1/generate: "
                                                         "beams, guarantee, ...}); "
                                                         "or .csv with columns keywords, context, id, seed")
    p.add_argument("-o", "--output", required=True, help="JSONL, one line per request ({id, custom_id, response, "
                                                          "error}); what it holds already is skipped (resume)")
    p.add_argument("--model", default=d.model, help="exported model dir, `default` (embedded SmolLM2-135M) or `gemma3-270m`")
    p.add_argument("--embeddings", default=d.embeddings, help="`default` (GloVe 6B 50-d), GloVe .txt, word2vec "
                                                               ".txt/.bin")
    p.add_argument("--seed", type=seed, default=0, help="the job's seed: a request without one gets a seed from it "
                                                        "and its custom_id, the same in a resumed run")
    p.add_argument("--max-rows", type=int, default=d.max_rows, help="candidate rows decoded together")
    p.add_argument("--max-queue", type=int, default=d.max_queue, help="requests read ahead of the engine")
    p.add_argument("--threads", type=threads, default=None, help=THREADS_HELP)
    p.add_argument("--provider", default=d.provider, choices=["cpu", "cuda"], help=PROVIDER_HELP)
    _add_kv_layout(p)
    p.add_argument("--ray", nargs="?", const="local", default=None, metavar="ADDRESS",
                   help="run on Ray Data: an actor pool of engines on a Ray cluster (ADDRESS, e.g. auto; alone: a "
                        "local Ray); needs the ray extra")
    p.add_argument("--ray-workers", type=threads, default=2, help="engines in the actor pool (default 2)")
    p.add_argument("--ray-cpus", type=float, default=1.0, help="CPUs each engine reserves (default 1)")
    p.set_defaults(func=_run_run_batch)


def _run_run_batch(a) -> int:
    from pathlib import Path

    try:
        import pydantic  # noqa: F401  (the bodies' schemas)
    except ImportError:
        raise DBSError("run-batch needs the serve extra: pip install 'dbs-fast[serve]'") from None
    from .serving.batch_jobs import run_batch
    from .serving.service import ServiceOptions

    opts = ServiceOptions(model=a.model, embeddings=a.embeddings, max_rows=a.max_rows, max_queue=a.max_queue,
                          threads=a.threads, provider=a.provider, kv_layout=a.kv_layout, schedule=a.schedule,
                          timeout=float("inf"))
    if a.ray is not None:
        try:
            import ray.data  # noqa: F401
        except ImportError as e:
            raise DBSError(f"--ray needs the ray extra: pip install 'dbs-fast[ray]' (missing: {e.name})") from None
        from .serving.batch_jobs import run_batch_ray

        c = run_batch_ray(Path(a.input), Path(a.output), opts, job_seed=a.seed,
                          address=None if a.ray == "local" else a.ray, workers=a.ray_workers, cpus_per_worker=a.ray_cpus)
    else:
        c = run_batch(Path(a.input), Path(a.output), opts, job_seed=a.seed)
    print(f"run-batch: {c['ok']} answered, {c['failed']} failed, {c['skipped']} done before; {c['seconds']:.1f} s "
          f"-> {a.output} ({c['failed_in_output']} error lines in it)", file=sys.stderr)
    return 1 if c["failed_in_output"] else 0          # the whole output file, resumed or not


def _run_serve(a) -> int:
    import os

    from .home import EMBEDDED_DIRS
    from .serving.service import ServiceOptions, serve

    key = a.api_key if a.api_key is not None else os.environ.get("DBS_FAST_API_KEY") or None
    opts = ServiceOptions(model=a.model, embeddings=a.embeddings, max_rows=a.max_rows, max_queue=a.max_queue,
                          threads=a.threads, provider=a.provider, timeout=a.timeout, grace=a.grace,
                          kv_layout=a.kv_layout, schedule=a.schedule, admit_wait=a.admit_wait, chunked_prefill=a.chunked_prefill, api_key=key, auth_health=a.auth_health,
                          max_body_bytes=a.max_body_bytes, cors_origins=tuple(a.cors_origin), cuda_graph=a.cuda_graph)
    if not 0 < a.port < 65536:
        raise DBSError(f"`--port` must be in 1..65535, got {a.port}")
    if a.model not in EMBEDDED_DIRS:          # a wrong directory fails here, not in the background
        from .api import resolve_model_dir
        from .manifest import read_manifest

        read_manifest(resolve_model_dir(a.model))
    if a.ray_replicas is not None:
        from .serving.deploy import run

        run(opts, a.ray_replicas, a.host, a.port, a.ray_address, a.ray_cpus, a.ray_gpus)
        return 0
    serve(opts, a.host, a.port)
    return 0


def main(argv=None) -> int:
    ap = build_parser()
    try:            # argparse prints the usage and the error itself (code 2; --help: 0)
        a, unknown = ap.parse_known_args(argv)
        if unknown:
            a.parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 2
    try:
        return a.func(a) or 0
    except DBSError as e:
        print(f"dbs-fast {a.command}: error: {e.in_cli()}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
