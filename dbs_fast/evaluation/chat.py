"""The chat evaluation (`dbs-fast eval --sets chat`): answers to user messages with guide words,
through the chat door, against the model's own answers.

Each message of `data/chat_requests.tsv` (100, half naming their words, half leaving them out) is
rendered by the generator's chat template and answered twice by the same engine with the same
seed: guided (its keywords) and the reference (no keywords: the model's own answer, to its end or
the token budget, since with nothing to place the first sentence end would end it), the reference
cut to as many sentences as the guided answer has. The judge reads each answer after
its message, in the judge's own chat template where it has one. Reported per kind of message and
in all: coverage of the guide words (by lemma), the judge's median perplexity of the answers and
of the references and their ratio, the same over the answers' tokens outside their guide words
(the text around the words: a word the message did not ask for surprises any reader, however
well it is placed), the mean words of both, rep-4 and word loops; three examples picked by numpy
default_rng(seed)."""
from __future__ import annotations

import json
import math
import statistics
import time
from dataclasses import replace
from importlib.resources import files
from pathlib import Path

import numpy as np

from ..errors import DBSError
from ..text import occurrence
from ..text.chat import ChatTemplate
from ..text.constraints import parse_keyword
from .judge import perplexity
from .metrics import coverage, rep_n, word_loop, words

KINDS = ("names", "leaves_out")


def chat_requests() -> list[tuple[str, list[str], str]]:
    """(kind, keywords, message) of every packaged chat request (`data/README.md` gives the source)."""
    out = []
    for line in files("dbs_fast.data").joinpath("chat_requests.tsv").read_text().splitlines():
        kind, kws, message = line.split("\t")
        out.append((kind, kws.split(","), message))
    return out


def sentences(text: str) -> list[str]:
    """`text` cut into sentences (pySBD, as the engine's sentence ends are judged)."""
    import pysbd

    return [s for s in pysbd.Segmenter(language="en", clean=False).segment(text) if s.strip()]


def first_sentences(text: str, n: int) -> str:
    """The first `n` sentences of `text` (all of it if it has no more)."""
    return "".join(sentences(text)[:max(n, 1)]).rstrip()


def own_answer(dbs, context: str, seed: int, cfg) -> str:
    """The model's own answer to a rendered message: the same engine, seed and settings with no
    guide words, to its end or the token budget (with nothing to place, the first sentence end
    would end it); `cut_like` makes the reference of an answer from it."""
    return dbs.generate(context, None, seed=seed, config=replace(cfg, guarantee=False, stop="max")).generated.strip()


def cut_like(own: str, answer: str) -> str:
    """The reference for `answer`: the model's own answer cut to as many sentences."""
    return first_sentences(own, len(sentences(answer)))


def run_chat_eval(dbs, out: Path, judge, seed: int = 0, limit: int | None = None, start: int = 0,
                  config=None) -> dict:
    """Every chat request (`start`, `limit`) answered guided and unguided at `config` (the engine's
    own if None); judged; summary.json and summary.md in `out`."""
    template = dbs.chat_template
    if template is None:
        raise DBSError(f"--sets chat needs a model with a chat template; {dbs.model_dir} has none", "sets", "chat")
    cfg = config or dbs.config
    reqs = chat_requests()[start:][:limit]
    rows = []
    for i, (kind, kws, message) in enumerate(reqs):
        context = template.render([{"role": "user", "content": message}])
        guided = dbs.generate(context, kws, seed=seed + start + i, config=cfg)
        own = own_answer(dbs, context, seed + start + i, cfg)
        rows.append({"kind": kind, "keywords": kws, "message": message, "answer": guided.generated.strip(),
                     "reference": cut_like(own, guided.generated),
                     "found": guided.success_rate, "seconds": guided.seconds})
    judge_rows(judge, rows)
    summary = {"judge": judge.name, "model": str(dbs.model_dir), "date": time.strftime("%Y-%m-%d"),
               "requests": len(rows), "first": start, "seed": seed, "config": cfg.to_dict(),
               **{kind: aggregate([r for r in rows if r["kind"] == kind]) for kind in KINDS},
               "all": aggregate(rows)}
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    (out / "summary.md").write_text(markdown(summary, rows, seed))
    return summary


def judge_rows(judge, rows: list[dict]) -> None:
    """Each row's answer and reference judged after its message (`judge_contexts`): its
    `judge_ppl`, `judge_ppl_around_words` and `reference_judge_ppl` set."""
    judged = judge_contexts(judge, [r["message"] for r in rows])
    for r, lp, b in zip(rows, judge.token_logprobs([(c, r["answer"]) for c, r in zip(judged, rows)]),
                        judge.perplexity([(c, r["reference"]) for c, r in zip(judged, rows)])):
        r["judge_ppl"] = perplexity(lp)
        r["judge_ppl_around_words"] = around_words(lp, judge.offsets(r["answer"]), r["answer"], r["keywords"])
        r["reference_judge_ppl"] = b


def around_words(lp: np.ndarray, offsets, text: str, keywords: list[str]) -> float:
    """The perplexity of `text` over its tokens outside every occurrence of `keywords` (by lemma):
    `lp` the log-probs of its last len(lp) tokens, `offsets` every token's (start, end) characters;
    a token that overlaps an occurrence is left out. nan where no token is left."""
    found = [s for k in keywords for s in occurrence.spans(text, parse_keyword(k), "lemma")]
    offs = list(offsets)[len(offsets) - len(lp):]
    keep = np.array([not any(a < e and s < b for s, e in found) for a, b in offs], bool)
    return perplexity(np.asarray(lp)[keep])


def judge_contexts(judge, messages: list[str]) -> list[str]:
    """The messages as the judge reads them: in its chat template where it has one."""
    template = ChatTemplate.of(judge.dir)
    return [template.render([{"role": "user", "content": m}]) if template else m + "\n" for m in messages]


def aggregate(rows: list[dict]) -> dict:
    if not rows:
        return {}
    a = statistics.median(r["judge_ppl"] for r in rows)
    b = statistics.median(r["reference_judge_ppl"] for r in rows)
    around = [r["judge_ppl_around_words"] for r in rows if math.isfinite(r["judge_ppl_around_words"])]
    around = statistics.median(around) if around else math.nan
    return {"requests": len(rows),
            "coverage": float(np.mean([coverage(r["answer"], r["keywords"]) for r in rows])),
            "judge_ppl_median": a, "reference_judge_ppl_median": b, "judge_ratio": a / b,
            "judge_ppl_around_words_median": around, "around_words_ratio": around / b,
            "words": float(np.mean([len(words(r["answer"])) for r in rows])),
            "reference_words": float(np.mean([len(words(r["reference"])) for r in rows])),
            "rep_4": float(np.mean([rep_n(r["answer"], 4) for r in rows])),
            "word_loops": float(np.mean([word_loop(r["answer"]) for r in rows])),
            "seconds_median": statistics.median(r["seconds"] for r in rows)}


def markdown(summary: dict, rows: list[dict], seed: int) -> str:
    lines = [f"{summary['requests']} chat requests (`dbs_fast/data/chat_requests.tsv`), answered guided and with "
             f"no guide words (the reference, cut to as many sentences); judge {summary['judge']} (the answer after "
             "the message, in the judge's chat template where it has one).", "",
             "| messages | coverage | judge ppl (median): answer / reference = ratio | around the words: answer / "
             "reference | words: answer / reference | rep-4 | word loops | seconds (median) |",
             "|---|---|---|---|---|---|---|---|"]
    for kind in (*KINDS, "all"):
        a = summary[kind]
        if a:
            lines.append(f"| {kind.replace('_', ' ')} ({a['requests']}) | {a['coverage']:.3f} | "
                         f"{a['judge_ppl_median']:.1f} / {a['reference_judge_ppl_median']:.1f} = "
                         f"{a['judge_ratio']:.2f}x | {a['judge_ppl_around_words_median']:.1f} / "
                         f"{a['reference_judge_ppl_median']:.1f} = {a['around_words_ratio']:.2f}x | "
                         f"{a['words']:.1f} / {a['reference_words']:.1f} | "
                         f"{a['rep_4']:.3f} | {a['word_loops']:.3f} | {a['seconds_median']:.1f} |")
    lines += ["", "Examples (requests picked by numpy default_rng(seed), unedited):", ""]
    for i in sorted(np.random.default_rng(seed).choice(len(rows), size=min(3, len(rows)), replace=False).tolist()):
        r = rows[i]
        lines += [f"- {json.dumps(r['message'])} [{', '.join(r['keywords'])}]",
                  f"  - answer: {json.dumps(r['answer'])}", f"  - reference: {json.dumps(r['reference'])}"]
    return "\n".join(lines) + "\n"
