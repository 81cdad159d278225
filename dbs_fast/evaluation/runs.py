"""`dbs-fast eval`: the paper's keyword-to-phrase evaluation (SPEC, "Evaluation").

Keyword sets: English words ranked 501-1000 by frequency (wordfreq), stop words removed,
5 per set, sampled with a fixed seed (or read from a file, one comma-separated set per line).
Each set runs DBS and the unguided baseline (b = s = 1, no boosts); results are appended to
results.jsonl as they finish (a re-run skips finished sets), then summary.json + summary.md.
"""
from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dbs_fast.errors import DBSError
from dbs_fast.evaluation.metrics import coverage, distinct_n, rep_n, word_loop
from dbs_fast.search.result import json_safe
from dbs_fast.text.words import words

# NLTK's English stop-word list (the corpus download is not available offline).
STOP_WORDS = set("""i me my myself we our ours ourselves you you're you've you'll you'd your yours yourself
yourselves he him his himself she she's her hers herself it it's its itself they them their theirs
themselves what which who whom this that that'll these those am is are was were be been being have has
had having do does did doing a an the and but if or because as until while of at by for with about
against between into through during before after above below to from up down in out on off over under
again further then once here there when where why how all any both each few more most other some such
no nor not only own same so than too very s t can will just don don't should should've now d ll m o re
ve y ain aren aren't couldn couldn't didn didn't doesn doesn't hadn hadn't hasn hasn't haven haven't isn
isn't ma mightn mightn't mustn mustn't needn needn't shan shan't shouldn shouldn't wasn wasn't weren
weren't won won't wouldn wouldn't""".split())


def candidate_words() -> list[str]:
    from wordfreq import top_n_list

    words = top_n_list("en", 1000)[500:1000]                     # frequency ranks 501-1000
    return [str(w) for w in words if w.isalpha() and len(w) >= 3 and w not in STOP_WORDS]


def sample_sets(n: int, seed: int, size: int = 5) -> list[list[str]]:
    rng = np.random.default_rng(seed)
    words = candidate_words()
    return [[str(w) for w in rng.choice(words, size=size, replace=False)] for _ in range(n)]


def read_sets(path: str) -> list[list[str]]:
    p = Path(path)
    if not p.is_file():
        raise DBSError(f"keyword file not found: {path}")
    # comma-separated keywords (phrases may contain spaces); a line without commas is a
    # space-separated set of single words (CommonGen's format)
    return [[w.strip() for w in line.split(",")] if "," in line else line.split()
            for line in p.read_text().splitlines() if line.strip()]


# Built-in keyword sets, copied into the package (dbs_fast/data/README.md gives their sources).
BUILTIN_SETS = {"paper": "paper_50_keyword_sets.txt", "roc": "roc_20_storylines.txt",
                "commongen-dev": "commongen_dev.txt"}
BUILTIN_REFS = {"commongen-dev": "commongen_dev_all_refs.jsonl"}   # every human reference of each set


def _data(name: str) -> str:
    from importlib.resources import files

    return str(files("dbs_fast") / "data" / name)


def builtin_sets(name: str) -> list[list[str]]:
    if name not in BUILTIN_SETS:
        raise DBSError(f"--sets must be one of {sorted([*BUILTIN_SETS, 'chat'])} or a number of sets to sample, "
                       f"got {name!r}")     # chat: its own run (`evaluation.chat`), not keyword sets
    return read_sets(_data(BUILTIN_SETS[name]))


def builtin_refs(name: str) -> list[list[str]] | None:
    """Every human reference of each set, in the sets' order (CommonGen dev: 2-8 a set)."""
    if name not in BUILTIN_REFS:
        return None
    return [json.loads(line)["references"] for line in Path(_data(BUILTIN_REFS[name])).read_text().splitlines()]


# CommonGen's scores: BLEU-4 and CIDEr-D by pycocoevalcap (the code of CommonGen's official script)
# over lower-cased word and punctuation tokens (the official script uses spaCy's tokens, cased),
# every reference of a set at once; BLEU-4 x 100 and CIDEr-D x 10, as papers report them.
TOKENISATION = "lower-cased word and punctuation tokens (regex \\w+|[^\\w\\s])"
_TOKEN = re.compile(r"\w+|[^\w\s]")
_FIRST_SENTENCE = re.compile(r"\s*(.*?[.!?][\"')\]”’]*)(?=\s|$)", re.S)


def caption_tokens(text: str) -> str:
    return " ".join(_TOKEN.findall(text.lower()))


def first_sentence(text: str) -> str:
    """The text up to its first sentence end (all of it when it has none)."""
    m = _FIRST_SENTENCE.match(text)
    return (m.group(1) if m else text).strip()


def caption_scores(hyps: list[str], refs: list[list[str]]) -> dict:
    """Corpus BLEU-4 and CIDEr-D of `hyps` against all of each one's `refs` (pycocoevalcap)."""
    from pycocoevalcap.bleu.bleu import Bleu
    from pycocoevalcap.cider.cider import Cider

    gts = {i: [caption_tokens(r) for r in rs] for i, rs in enumerate(refs)}
    res = {i: [caption_tokens(h)] for i, h in enumerate(hyps)}
    bleu, _ = Bleu(4).compute_score(gts, res, verbose=0)
    cider, _ = Cider().compute_score(gts, res)
    return {"bleu4": 100 * float(bleu[3]), "cider": 10 * float(cider)}


def commongen_scores(rows, refs: list[list[str]]) -> dict:
    """CommonGen's metrics for one run, on the output sentence: the text after the context's last
    line (a context "A" is the sentence's first word; a prompt ending in a line break is not part
    of it) up to its first sentence end. BLEU-4 and CIDEr-D against all of each set's references;
    coverage by lemma of the sentence and of the whole generated text; words per sentence."""
    rs = sorted(rows, key=lambda r: r["set"])
    if not rs:
        return {}
    sentences = [first_sentence(r["context"].rpartition("\n")[2] + r["generated"]) for r in rs]
    cov = [coverage(s, r["keywords"]) for s, r in zip(sentences, rs)]
    return {"coverage": float(np.mean(cov)), "all_covered": float(np.mean([c == 1.0 for c in cov])),
            "coverage_text": float(np.mean([coverage(r["generated"], r["keywords"]) for r in rs])),
            **caption_scores(sentences, [refs[r["set"]] for r in rs]),
            "words": float(np.mean([len(words(s)) for s in sentences])), "tokenisation": TOKENISATION}


def human_anchor(sets, refs: list[list[str]]) -> dict:
    """The same scores for people: each set's first reference against its other references
    (sets with at least two), by the same code."""
    idx = [i for i in range(len(sets)) if len(refs[i]) >= 2]
    hyps = [refs[i][0] for i in idx]
    return {"sets": len(idx), "coverage": float(np.mean([coverage(h, sets[i]) for h, i in zip(hyps, idx)])),
            **caption_scores(hyps, [refs[i][1:] for i in idx]),
            "words": float(np.mean([len(words(h)) for h in hyps]))}


def _row(i, kws, mode, r, n_batch, context) -> dict:
    # r.seconds is the wall time of the whole batch; a set's share is that over the batch size
    return {"set": i, "mode": mode, "keywords": kws, "success_rate": r.success_rate,
            "perplexity": r.perplexity, "success_length": r.success_length, "seconds": r.seconds / n_batch,
            "batch_seconds": r.seconds, "batch_sets": n_batch, "new_tokens": r.new_tokens, "stopped": r.stopped,
            "rep_2": rep_n(r.generated, 2), "rep_4": rep_n(r.generated, 4), "word_loop": float(word_loop(r.generated)),
            "context": context, "generated": r.generated, "text": r.text, "found": r.found,
            "distinct_beams": len({b["text"] for b in r.beams}), "beams": json_safe(r.beams)}


def run_modes(dbs, sets, configs: dict, path: Path, context="It is", batch=4, seed=0, quiet=False,
              desc="eval") -> list[dict]:
    """Every (set, mode) not yet in `path` (JSONL) is generated, batch sets at a time, and appended
    as soon as its batch ends; returns all rows of the file."""
    from tqdm import tqdm

    path.parent.mkdir(parents=True, exist_ok=True)
    done = set()
    if path.is_file():   # a row counts as done only under the same settings (a changed default re-runs)
        done = {(d["set"], d["mode"]) for d in current_rows(map(json.loads, path.read_text().splitlines()), configs)}
    todo = [(i, m) for m in configs for i in range(len(sets)) if (i, m) not in done]
    with open(path, "a") as f, tqdm(total=len(todo), desc=desc, unit="set", disable=quiet) as bar:
        for mode, cfg in configs.items():
            idx = [i for i, m in todo if m == mode]
            for start in range(0, len(idx), batch):
                part = idx[start:start + batch]
                res = dbs.generate_batch([(context, sets[i]) for i in part], seeds=[seed + i for i in part],
                                         config=cfg)
                for i, r in zip(part, res):
                    f.write(json.dumps({**_row(i, sets[i], mode, r, len(part), context), "config": cfg.to_dict()})
                            + "\n")
                f.flush()
                bar.update(len(part))
    return current_rows((json.loads(line) for line in path.read_text().splitlines()), configs)


def current_rows(rows, configs: dict) -> list[dict]:
    """The rows of `configs`' modes made under those very settings (rows of older versions carry no
    config and are taken as they are); the last one per (set, mode) wins."""
    keep = {}
    for d in rows:
        if d["mode"] in configs and d.get("config") in (None, configs[d["mode"]].to_dict()):
            keep[(d["set"], d["mode"])] = d
    return list(keep.values())


METRICS = ("success_rate", "perplexity", "success_length", "seconds")
QUALITY = ("success_rate", "judge_ppl", "perplexity", "rep_2", "rep_4", "word_loop", "success_length", "new_tokens",
           "seconds")


def _aggregate(rows, metrics=METRICS) -> dict:
    out = {}
    for m in metrics:
        v = np.array([r[m] for r in rows if r.get(m) is not None], float)
        v = v[np.isfinite(v)]
        out[m] = {"mean": float(v.mean()) if len(v) else float("nan"), "std": float(v.std()) if len(v) else float("nan"),
                  "median": float(np.median(v)) if len(v) else float("nan")}
    return out


def judge_rows(path: Path, judge, quiet=False) -> list[dict]:
    """Judge perplexity for every row of `path` that has none from this judge; rewritten atomically."""
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    todo = [r for r in rows if r.get("judge") != judge.name and "generated" in r]
    if todo:
        from tqdm import tqdm

        for start in tqdm(range(0, len(todo), 16), desc=f"judge ({judge.name})", unit="16 texts", disable=quiet):
            part = todo[start:start + 16]
            for r, ppl in zip(part, judge.perplexity([(r["context"], r["generated"]) for r in part])):
                r["judge"], r["judge_ppl"] = judge.name, ppl
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
        tmp.replace(path)
    return rows


def reference_scores(sets, refs: list[list[str]], context: str, judge) -> dict:
    """The human reference sentences of `sets` (each set's first) under the same judge and context
    as the generated text, and their coverage by lemma: what text a person would keep scores on
    this ruler."""
    refs = [r[0] for r in refs[:len(sets)]]
    ppl = [p for i in range(0, len(refs), 16) for p in judge.perplexity([(context, r) for r in refs[i:i + 16]])]
    return {"judge_ppl": _aggregate([{"judge_ppl": p} for p in ppl], ("judge_ppl",))["judge_ppl"],
            "coverage": float(np.mean([coverage(r, kw) for r, kw in zip(refs, sets)]))}


def keyword_misses(rows) -> dict:
    """Where DBS falls short: miss rate by the keyword's position in its set, and the missed words."""
    by_pos: dict[int, list[int]] = {}
    missed: dict[str, int] = {}
    for r in rows:
        for pos, kw in enumerate(r["keywords"]):
            hit = r["found"].get(kw) is not None
            by_pos.setdefault(pos + 1, []).append(0 if hit else 1)
            if not hit:
                missed[kw] = missed.get(kw, 0) + 1
    return {"miss_rate_by_position": {p: float(np.mean(v)) for p, v in sorted(by_pos.items())},
            "missed_words": dict(sorted(missed.items(), key=lambda kv: (-kv[1], kv[0])))}


@dataclass(frozen=True)
class EvalSets:
    """What an evaluation generates for: keyword `sets`, the `context` before each, for CommonGen
    every reference of each set (`refs`), and the number of `sets[0]` in its collection (`first`,
    by which the reports name sets)."""

    sets: list[list[str]]
    context: str = "It is"
    refs: list[list[str]] | None = None
    first: int = 0


def run_eval(dbs, task: EvalSets, configs: dict, out: Path, judge=None, batch=4, seed=0, quiet=False) -> dict:
    """Every run of `configs` ({name: DBSConfig}) on every set of `task`; judged, with degeneration
    metrics; with references (CommonGen), coverage by lemma, BLEU-4 and CIDEr-D, beside the same
    scores of the human references. Writes results.jsonl, summary.json, summary.md, quality.png."""
    sets, context, refs = task.sets, task.context, task.refs
    path = out / "results.jsonl"
    rows = run_modes(dbs, sets, configs, path, context, batch, seed, quiet)
    if judge is not None:
        rows = current_rows(judge_rows(path, judge, quiet), configs)
    summary = {"scorer": dbs.scorer_name, "judge": judge.name if judge else None, "model": str(dbs.model_dir),
               "sets": len(sets), "first_set": task.first, "context": context, "date": time.strftime("%Y-%m-%d"),
               "configs": {m: c.to_dict() for m, c in configs.items()}}
    for mode in configs:
        summary[mode] = _mode_summary([r for r in rows if r["mode"] == mode and r["set"] < len(sets)], refs)
    if refs is not None:
        summary["human"] = human_anchor(sets, refs)
    if refs is not None and judge is not None:
        summary["reference"] = reference_scores(sets, refs, context, judge)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    (out / "summary.md").write_text(summary_markdown(summary, task, configs, rows, seed))
    quality_plot(summary, list(configs), out / "quality.png")
    return summary


def _mode_summary(rs: list[dict], refs) -> dict:
    """One run's aggregates over its rows: quality, degeneration, stops, misses (and CommonGen's
    scores with `refs`)."""
    agg = _aggregate(rs, QUALITY)
    gen = [r["generated"] for r in rs]
    agg["distinct_2"], agg["distinct_4"] = distinct_n(gen, 2), distinct_n(gen, 4)
    agg["natural_stop"] = float(np.mean([r.get("stopped") in ("sentence", "eos") for r in rs]))
    agg["ends_at_sentence"] = float(np.mean([r.get("stopped") in ("sentence", "eos", "trimmed") for r in rs]))
    agg["misses"] = keyword_misses(rs)
    have = [r["distinct_beams"] for r in rs if "distinct_beams" in r]
    agg["distinct_beams"] = float(np.mean(have)) if have else None      # different final texts per set
    if refs is not None:
        agg["commongen"] = commongen_scores(rs, refs)
    return agg


def summary_markdown(summary: dict, task: EvalSets, configs: dict, rows: list[dict], seed: int) -> str:
    """summary.md: the runs' table, CommonGen's (with references), misses, and examples picked by
    numpy default_rng(seed)."""
    sets, context, refs, first_set = task.sets, task.context, task.refs, task.first
    span = f" (sets {first_set}-{first_set + len(sets) - 1})" if first_set else ""
    lines = [f"{len(sets)} keyword sets{span}, context {context!r}; judge: {summary['judge']} (perplexity of the "
             f"generated text given the context, judge's own tokenizer); self ppl: the generator grading itself.", "",
             "| run | success rate | judge ppl (mean / median) | self ppl | rep-2 | rep-4 | word loops | distinct-2 | "
             "distinct-4 | success length | new tokens | ends at sentence/EOS | seconds/set |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for mode in configs:
        a = summary[mode]
        lines.append(f"| {mode} | {a['success_rate']['mean']:.2f} ± {a['success_rate']['std']:.2f} | "
                     f"{a['judge_ppl']['mean']:.1f} / {a['judge_ppl']['median']:.1f} | {a['perplexity']['mean']:.1f} | "
                     f"{a['rep_2']['mean']:.3f} | {a['rep_4']['mean']:.3f} | {a['word_loop']['mean']:.3f} | "
                     f"{a['distinct_2']:.3f} | "
                     f"{a['distinct_4']:.3f} | {a['success_length']['mean']:.1f} | {a['new_tokens']['mean']:.1f} | "
                     f"{a['ends_at_sentence']:.2f} | {a['seconds']['mean']:.1f} |")
    if refs is not None:
        lines += ["", "CommonGen, on the output sentence (the text after the context's last line, up to its first "
                  "sentence end): coverage = concepts used, by lemma (lemminflect), in the sentence and in the whole "
                  "text; all = sets with every concept in the sentence; BLEU-4 (x100) and CIDEr-D (x10) by "
                  f"pycocoevalcap against all references of each set, on {TOKENISATION}. Human: each set's first "
                  "reference against its other references, by the same code.", "",
                  "| run | coverage (sentence) | coverage (text) | all concepts | BLEU-4 | CIDEr-D | words |",
                  "|---|---|---|---|---|---|---|"]
        for mode in configs:
            c = summary[mode]["commongen"]
            lines.append(f"| {mode} | {c['coverage']:.3f} | {c['coverage_text']:.3f} | {c['all_covered']:.3f} | "
                         f"{c['bleu4']:.1f} | {c['cider']:.2f} | {c['words']:.1f} |")
        h = summary["human"]
        lines.append(f"| human ({h['sets']} sets) | {h['coverage']:.3f} | | | {h['bleu4']:.1f} | {h['cider']:.2f} | "
                     f"{h['words']:.1f} |")
        if "reference" in summary:
            ref = summary["reference"]
            lines += ["", f"The human references of these sets (the first of each), read by the same judge after the "
                          f"same context: judge ppl {ref['judge_ppl']['mean']:.1f} / {ref['judge_ppl']['median']:.1f} "
                          f"(mean / median), coverage {ref['coverage']:.3f}."]
    lines += ["", "Different final beams per set (mean): " + ", ".join(
        f"{m} {summary[m]['distinct_beams']:.2f} of {configs[m].beams}" for m in configs
        if summary[m]["distinct_beams"] is not None)]
    for mode in configs:
        miss = summary[mode]["misses"]
        lines += ["", f"{mode}: miss rate by keyword position: " + ", ".join(
            f"{p}: {v:.2f}" for p, v in miss["miss_rate_by_position"].items()) + "; missed (times): "
            + (", ".join(f"{w} ({n})" for w, n in list(miss["missed_words"].items())[:12]) or "none")]
    lines += ["", "Examples (sets picked by numpy default_rng(seed), unedited):", ""]
    rng = np.random.default_rng(seed)
    for i in sorted(rng.choice(len(sets), size=min(3, len(sets)), replace=False).tolist()):
        lines.append(f"- set {first_set + i}: {', '.join(sets[i])}")
        for mode in configs:
            r = next((r for r in rows if r["mode"] == mode and r["set"] == i), None)
            if r is not None:
                lines.append(f"  - {mode}: {json.dumps(r['text'])}")
    return "\n".join(lines) + "\n"


def quality_plot(summary, modes, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("success_rate", "success rate"), ("judge_ppl", "judge perplexity (median)"), ("rep_4", "rep-4"),
              ("distinct_4", "distinct-4")]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.6))
    for ax, (m, label) in zip(axes, panels):
        v = [summary[x][m] if isinstance(summary[x][m], float) else
             summary[x][m]["median" if m == "judge_ppl" else "mean"] for x in modes]
        ax.bar(modes, v, color=["tab:blue", "tab:orange", "tab:gray", "tab:green"][:len(modes)])
        ax.set_title(label)
        ax.tick_params(axis="x", rotation=20)
    fig.suptitle(f"{summary['sets']} keyword sets; judge: {summary['judge']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def frontier(dirs: list[Path], out: Path) -> list[dict]:
    """BLEU-4 against judge median perplexity for every run of the CommonGen evals in `dirs`
    (their summary.json), beside the human anchor: frontier.md and frontier.png in `out`."""
    points, human = [], None
    for d in dirs:
        f = d / "summary.json"
        if not f.is_file():
            raise DBSError(f"--frontier: {f} not found (give the --out folders of CommonGen evals)")
        s = json.loads(f.read_text())
        cfgs = s.get("configs", {})
        for run, v in s.items():
            cg = v.get("commongen") if isinstance(v, dict) else None
            if not cg or "judge_ppl" not in v:
                continue
            c = cfgs.get(run, {})
            points.append({"eval": d.name, "run": run, "prompt_style": c.get("prompt_style", "none"),
                           "lam": c.get("lam"), "guarantee": c.get("guarantee"), "bleu4": cg["bleu4"],
                           "cider": cg["cider"], "coverage": cg["coverage"], "words": cg["words"],
                           "judge_ppl_median": v["judge_ppl"]["median"], "rep_4": v["rep_4"]["mean"],
                           "sets": s["sets"]})
        if human is None and "human" in s and "reference" in s:
            human = {**s["human"], "judge_ppl_median": s["reference"]["judge_ppl"]["median"]}
    if not points:
        raise DBSError("--frontier: no CommonGen runs with judge scores in " + ", ".join(map(str, dirs)))
    out.mkdir(parents=True, exist_ok=True)
    lines = ["| eval | run | prompt style | lambda | guarantee | BLEU-4 | CIDEr-D | coverage (sentence) | words | "
             "judge ppl (median) | rep-4 |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in points:
        lines.append(f"| {p['eval']} | {p['run']} | {p['prompt_style']} | {p['lam']} | {p['guarantee']} | "
                     f"{p['bleu4']:.1f} | {p['cider']:.2f} | {p['coverage']:.3f} | {p['words']:.1f} | "
                     f"{p['judge_ppl_median']:.1f} | {p['rep_4']:.3f} |")
    if human:
        lines.append(f"| human | first reference vs the others | | | | {human['bleu4']:.1f} | {human['cider']:.2f} | "
                     f"{human['coverage']:.3f} | {human['words']:.1f} | {human['judge_ppl_median']:.1f} | |")
    (out / "frontier.md").write_text("\n".join(lines) + "\n")
    (out / "frontier.json").write_text(json.dumps({"points": points, "human": human}, indent=2))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 5))
    for p in points:
        ax.scatter(p["judge_ppl_median"], p["bleu4"], marker="s" if p["guarantee"] else "o")
        ax.annotate(f"{p['eval']}/{p['run']}", (p["judge_ppl_median"], p["bleu4"]), fontsize=7,
                    xytext=(3, 3), textcoords="offset points")
    if human:
        ax.scatter(human["judge_ppl_median"], human["bleu4"], marker="*", s=200, color="black")
        ax.annotate("human", (human["judge_ppl_median"], human["bleu4"]), xytext=(4, -10), textcoords="offset points")
    ax.set_xscale("log")
    ax.set_xlabel("judge perplexity, median (lower: likelier text)")
    ax.set_ylabel("BLEU-4 against all references")
    ax.set_title(f"CommonGen dev ({points[0]['sets']} sets): BLEU-4 against judge perplexity")
    fig.tight_layout()
    fig.savefig(out / "frontier.png", dpi=120)
    plt.close(fig)
    print("\n".join(lines))
    return points


# -- hyper-parameter grids (the paper's Figure 1 and Figures 2-3) -------------------------------
LAMBDAS = (5.0, 10.0, 15.0, 20.0, 25.0)
BS_VALUES = (3, 5, 7, 10)
K_VALUES = (2, 5, 10)


def grid_configs(base, which: str, lambdas=LAMBDAS, bs_values=BS_VALUES, k_values=K_VALUES) -> dict:
    """{point name: DBSConfig}. `lambda`: lambda sweep at b = s = k = 5; `bsk`: b, s x k at lambda 20."""
    from dataclasses import replace

    out = {}
    if which in ("lambda", "all"):
        for lam in lambdas:
            out[f"lam={lam:g},b=5,s=5,k=5"] = replace(base, lam=float(lam), beams=5, candidates=5, chunk=5)
    if which in ("bsk", "all"):
        for k in k_values:
            for b in bs_values:
                for s in bs_values:
                    out[f"lam=20,b={b},s={s},k={k}"] = replace(base, lam=20.0, beams=b, candidates=s, chunk=k)
    if not out:
        raise DBSError(f"--grid must be lambda, bsk or all, got {which!r}")
    return out


def run_grid(dbs, sets, out: Path, configs: dict, batch=4, seed=0, quiet=False) -> dict:
    rows = run_modes(dbs, sets, configs, out / "grid.jsonl", batch=batch, seed=seed, quiet=quiet, desc="grid")
    points = []
    for name, cfg in configs.items():
        rs = [r for r in rows if r["mode"] == name and r["set"] < len(sets)]
        points.append({"point": name, "lam": cfg.lam, "beams": cfg.beams, "candidates": cfg.candidates,
                       "chunk": cfg.chunk, "sets": len(rs), **_aggregate(rs)})
    summary = {"scorer": dbs.scorer_name, "model": str(dbs.model_dir), "sets": len(sets),
               "date": time.strftime("%Y-%m-%d"), "points": points}
    (out / "grid.json").write_text(json.dumps(summary, indent=2))
    lines = ["| lambda | b | s | k | success rate | perplexity | success length | seconds/set |",
             "|---|---|---|---|---|---|---|---|"]
    for p in points:
        lines.append(f"| {p['lam']:g} | {p['beams']} | {p['candidates']} | {p['chunk']} | "
                     f"{p['success_rate']['mean']:.2f} ± {p['success_rate']['std']:.2f} | "
                     f"{p['perplexity']['mean']:.1f} | {p['success_length']['mean']:.1f} | {p['seconds']['mean']:.1f} |")
    (out / "grid.md").write_text("\n".join(lines) + "\n")
    grid_plots(points, out)
    return summary


def grid_plots(points, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lam = sorted((p for p in points if p["beams"] == p["candidates"] == p["chunk"] == 5), key=lambda p: p["lam"])
    if len({p["lam"] for p in lam}) > 1:
        fig, ax = plt.subplots(figsize=(5.5, 4))
        xs = [p["lam"] for p in lam]
        ax.errorbar(xs, [p["success_rate"]["mean"] for p in lam], fmt="o-", color="tab:blue", label="success rate")
        ax.set_xlabel("lambda (b = s = k = 5)")
        ax.set_ylabel("success rate", color="tab:blue")
        ax.set_ylim(0, 1.05)
        ax2 = ax.twinx()
        ax2.plot(xs, [p["perplexity"]["mean"] for p in lam], "s--", color="tab:red", label="perplexity")
        ax2.set_ylabel("perplexity", color="tab:red")
        ax.set_title(f"success rate and perplexity per lambda ({lam[0]['sets']} keyword sets)")
        fig.tight_layout()
        fig.savefig(out / "lambda.png", dpi=120)
        plt.close(fig)
    bsk = [p for p in points if p["lam"] == 20.0]
    ks = sorted({p["chunk"] for p in bsk})
    if len(bsk) > 1:
        fig, axes = plt.subplots(3, len(ks), figsize=(4.5 * len(ks), 9), squeeze=False)
        for j, k in enumerate(ks):
            pk = sorted((p for p in bsk if p["chunk"] == k), key=lambda p: (p["beams"], p["candidates"]))
            labels = [f"{p['beams']}x{p['candidates']}" for p in pk]
            for i, (m, lab) in enumerate((("success_rate", "success rate"), ("perplexity", "perplexity"),
                                          ("seconds", "seconds per set"))):
                axes[i][j].bar(labels, [p[m]["mean"] for p in pk])
                axes[i][j].set_ylabel(lab)
                axes[i][j].tick_params(axis="x", rotation=60, labelsize=7)
            axes[0][j].set_title(f"k = {k} (b x s)")
        fig.tight_layout()
        fig.savefig(out / "bsk.png", dpi=120)
        plt.close(fig)


# -- story generation: the four ROC examples of the paper's comparison table --------------------
STORIES = [
    ("He and his friends are bored on a weekend day.", ["go", "decide"]),
    ("He had a heavy duty backpack.", ["took"]),
    ("He hiked up the local hill.", ["top"]),
    ("He liked trading commodities. one day he was trading several products. He noticed that he "
     "gained a lot of money from the new trades.", ["realize"]),
]


def run_stories(dbs, out: Path, seed=0, max_new_tokens: int = 50) -> list[dict]:
    from dataclasses import replace

    cfg = replace(dbs.config, max_new_tokens=max_new_tokens)
    res = dbs.generate_batch(STORIES, seeds=[seed + i for i in range(len(STORIES))], config=cfg)
    rows = [{"context": c, "keywords": k, "text": r.generated, "found": r.found, "success_rate": r.success_rate,
             "perplexity": r.perplexity} for (c, k), r in zip(STORIES, res)]
    out.mkdir(parents=True, exist_ok=True)
    (out / "stories.json").write_text(json.dumps(rows, indent=2))
    return rows
