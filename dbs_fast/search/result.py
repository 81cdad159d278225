"""What a finished request gives back: its best beam (cut back to a sentence end where asked),
where each keyword landed, and the stats of its run. Built from the scheduler's `Finished` rows
with the tables it needs passed in (the detokeniser, the EOS ids, the sentence-end tokens)."""
from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass, field
from typing import Callable

import numpy as np

from ..config import DBSConfig
from ..text import occurrence
from ..text.constraints import Keyword
from ..text.words import word_loop, words
from .beam import Finished
from .quality import perplexity
from .rows import Rows


@dataclass
class GenerationResult:
    text: str                     # context + generated text of the best beam
    context: str
    generated: str
    keywords: list[str]
    found: dict                   # keyword -> {"char": offset in generated, "end": offset after it, "token":
    #                               tokens until it is complete} or None
    success_rate: float
    success_length: int           # generated tokens until every keyword occurred (all if never)
    stopped: str                  # "sentence" / "eos": ended naturally (or a copy kept at a sentence end near
    #                               the budget); "trimmed": cut back to the last sentence end after the keywords
    #                               at max_new_tokens; "max": budget
    perplexity: float             # exp(-mean scorer log-prob) of the generated tokens
    new_tokens: int
    beams: list[dict]             # every different final beam (with stop="sentence", every different finished
    #                               candidate if there was one; with a copy kept near the budget returned, those
    #                               copies too), the returned one first, then by score: text, score
    #                               (Q summed over its chunks; ranked per chunk among candidates of several chunks),
    #                               finished (every keyword, then a sentence end or EOS), logprob (mean per token),
    #                               tokens (generated, its EOS among them)
    seconds: float
    tokens_per_second: float      # generated tokens of the result / seconds
    candidate_tokens_per_second: float  # all sampled candidate tokens / seconds (batch-wide)
    candidate_tokens: int = 0     # candidate tokens the batch sampled while this request was in
    timings: dict = field(default_factory=dict)  # seconds by stage (batch-wide); this request's
    #                               "model_rows" (rows its decode steps computed) and "plain_row_steps"
    #                               (b*s rows at every step: the plain schedule's)
    kv_cache_bytes: int = 0       # peak bytes of the batch's KV cache over its steps (0: not known)
    prompt_tokens: int = 0        # tokens of the context as the model read it
    logprobs: list | None = None  # with the `logprobs` option, per token of `generated` (EOS left out): its
    #                               id, text and log-probability (the model's own at the sampling temperature)
    #                               and the likeliest tokens there, each {"id", "token", "logprob"}, as "top"
    #                               (each beam in `beams` then has its own "logprobs" too)

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self) -> dict:
        """`to_dict` as strict JSON: a non-finite float (the score of a dropped beam, the
        perplexity of an empty text) becomes null. What `generate --json` and the service send."""
        return json_safe(self.to_dict())


def json_safe(x):
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    return x


def found_at(texts: list[str], keywords: list[Keyword], rule: str = "stem") -> dict:
    """keyword text -> first occurrence {"char", "end", "token"} in the final text (texts: every token
    prefix of it), or None."""
    generated = texts[-1] if texts else ""
    found = {}
    for kw in keywords:
        span = occurrence.first_match(generated, kw, rule)  # its tokens: those that complete it
        found[kw.text] = None if span is None else {
            "char": span[0], "end": span[1], "token": next(n + 1 for n, t in enumerate(texts) if len(t) >= span[1])}
    return found


BLEND_WEIGHT = 0.5    # "blend": the weight of a beam's place by likelihood beside its place by Q


def pick(rule: str, beams: list[dict], length_penalty: float = 1.0) -> int:
    """Which of `beams` (dicts of text, score, finished, logprob, tokens; by score, best first) is returned:
    "q" the first (the paper's); otherwise among the finished beams (else those still scored, else
    all), those without a word loop where any has none (a word of several tokens, which the
    kernel's word-loop rule does not see: "a racket racket"), "likelihood" the best log-prob summed
    over its tokens over their number to the power `length_penalty` (1: the mean; transformers' rule),
    "consensus" the one with the highest mean BLEU-4 against the others (minimum Bayes risk
    decoding; nltk's BLEU, smoothed) and
    "blend" the smallest place by Q plus half its place by likelihood (rank fusion: 0 is the
    best). Ties go to the better score."""
    if rule == "q" or len(beams) == 1:
        return 0
    pool = [j for j, b in enumerate(beams) if b["finished"]] or \
        [j for j, b in enumerate(beams) if math.isfinite(b["score"])] or [0]
    pool = [j for j in pool if not word_loop(beams[j]["text"])] or pool   # no word loop where one has none
    def logprob(j: int) -> float:
        lp, n = beams[j]["logprob"], beams[j].get("tokens", 1)
        if not math.isfinite(lp):
            return -math.inf
        return lp if length_penalty == 1 else lp * n ** (1 - length_penalty)    # mean * n = the sum

    if rule == "likelihood":
        return max(pool, key=lambda j: (logprob(j), -j))
    if rule == "blend":       # rank fusion: the place by Q plus BLEND_WEIGHT x the place by likelihood
        place = {j: n for n, j in enumerate(sorted(pool, key=lambda j: (-logprob(j), j)))}
        return min((n + BLEND_WEIGHT * place[j], j) for n, j in enumerate(pool))[1]
    if len(pool) == 1:
        return pool[0]
    from nltk.translate.bleu_score import SmoothingFunction, sentence_bleu

    toks = {j: words(beams[j]["text"]) for j in pool}
    smooth = SmoothingFunction().method1

    def agreement(j: int) -> float:
        return float(np.mean([sentence_bleu([toks[o]], toks[j], smoothing_function=smooth) if toks[j] else 0.0
                              for o in pool if o != j]))

    return max(pool, key=lambda j: (agreement(j), -j))


def tokens_with_logprobs(rows: Rows, i: int, n: int, eos_ids, decode_one: Callable[[int], str],
                         tail: int, K: int) -> list[dict]:
    """Row i's first `n` generated tokens (a last EOS left out) as the `logprobs` option returns
    them: each token's id, text (the first without the `tail` characters of the context it
    re-writes) and log-prob, and its K likeliest alternatives ("top": id, text, log-prob; the rows
    may hold more, for another request of their batch)."""
    c = int(rows.col0[i])
    ids = rows.tokens[i, c:c + n]
    if n and int(ids[-1]) in set(eos_ids):
        n -= 1
    out = []
    for j in range(n):
        text = decode_one(int(ids[j]))
        own, top = rows.alt_logp[i, c + j], rows.alt_ids[i, c + j]      # the drawn token, then the likeliest
        out.append({"id": int(ids[j]), "token": text[tail:] if j == 0 else text, "logprob": float(own[0]),
                    "top": [{"id": int(a), "token": decode_one(int(a)), "logprob": float(lp)}
                            for a, lp in zip(top[1:1 + K], own[1:1 + K])]})
    return out


def build_result(fin: Finished, cfg: DBSConfig, decode_batch: Callable[[list], list[str]], eos_ids,
                 sentence_end: np.ndarray | None, timings: dict, kv_bytes: int = 0,
                 decode_one: Callable[[int], str] | None = None) -> GenerationResult:
    """The result of a request that left the batch: its best beam, trimmed, with its stats.
    `sentence_end`: (V,) bool, needed with stop="sentence"; `decode_one` (one token's text, special
    tokens written out), needed with `logprobs`."""
    rows, seconds, context, kws = fin.rows, fin.seconds, fin.request.context, fin.request.keywords
    budget = fin.request.budget(cfg)
    tail = len(fin.request.heal.tail) if fin.request.heal else 0   # the healed context's end: not generated

    def decode(seqs):
        return [t[tail:] for t in decode_batch(seqs)]

    beams, seen = [], set()                 # every different final beam (copies once), by score

    def add_beams(first: int = 0) -> None:
        """`beams` gains rows[first:], each text once, by score."""
        rank = rows.cum
        if fin.pooled or first:     # candidates of different chunks: Q per chunk, not Q summed
            rank = rows.cum / np.maximum(1, np.ceil(rows.n_tok / cfg.chunk))
        order = first + np.argsort(-rank[first:], kind="stable")
        every = (1 << len(kws)) - 1
        finished = rows.ended & np.isfinite(rows.cum) & ((rows.found & every) == every)   # all keywords, then an end
        for i, t in zip(order, decode([rows.tokens[i, : rows.n_tok[i]] for i in order])):
            if t not in seen:
                seen.add(t)
                n = int(rows.n_tok[i])
                beams.append({"text": t, "score": float(rows.cum[i]), "rank": len(beams),
                              "finished": bool(finished[i]),
                              "logprob": float(rows.logp[i, :n].mean()) if n else float("nan"), "tokens": n,
                              "row": int(i)})

    add_beams()
    ends = {}

    def ending(i: int):
        """Row i's token prefixes' texts, its keywords' occurrences and, where the budget ran out
        (it did not end), the last sentence end after them that it can be cut back to (None: none)."""
        if i not in ends:
            n_gen = int(rows.n_tok[i])
            toks = rows.tokens[i, :n_gen]
            texts = decode([toks[:n] for n in range(1, n_gen + 1)]) or [""]
            found = found_at(texts, kws, cfg.match)
            need = max([f["token"] for f in found.values() if f is not None] + [fin.committed], default=0)
            cut = None
            if cfg.finishes and not rows.ended[i]:
                cut = next((n for n in range(n_gen, max(need, 1) - 1, -1) if sentence_end[toks[n - 1]]
                            and occurrence.ends_generated_sentence(context, texts[n - 1])), None)
            ends[i] = texts, found, cut
        return ends[i]

    if fin.open_from is not None:   # beams the budget ended beside too few finished: finished where they
        for b in [b for b in beams if b["row"] >= fin.open_from]:   # can be cut back to a sentence end
            i = b["row"]                                                # after every keyword, as cut back
            texts, found, cut = ending(i)
            if cut is None or None in found.values():
                continue
            if texts[cut - 1] != b["text"] and texts[cut - 1] in seen:         # another beam's text
                beams.remove(b)
                continue
            seen.add(texts[cut - 1])
            b.update(text=texts[cut - 1], finished=True, logprob=float(rows.logp[i, :cut].mean()), tokens=cut)

    def placed(j: int) -> int:
        return sum(f is not None for f in ending(beams[j]["row"])[1].values())

    def landing(chosen: int) -> list[int]:
        """The beams that can be cut back to a sentence end after as many keywords as `chosen`."""
        least = placed(chosen)
        return [j for j in range(len(beams)) if ending(beams[j]["row"])[2] is not None and placed(j) >= least]

    chosen = pick(cfg.pick, beams, cfg.length_penalty)
    if cfg.finishes and not rows.ended[beams[chosen]["row"]] and ending(beams[chosen]["row"])[2] is None:
        # the budget ran out in the sentence of the chosen beam's last keyword: another beam that
        # can be cut back to a sentence end after as many keywords is returned instead, where one
        # can, else a copy kept at such an end near the budget (`Finished.landings`)
        ends_at = landing(chosen)
        if not ends_at and fin.landings is not None:
            first, rows = len(rows.req), Rows.stack([rows, fin.landings], eos_ids[0] if eos_ids else 0)
            add_beams(first)
            ends_at = [j for j in landing(chosen) if beams[j]["row"] >= first]
        if ends_at:
            chosen = ends_at[pick(cfg.pick, [beams[j] for j in ends_at], cfg.length_penalty)]
    beams.insert(0, beams.pop(chosen))
    best = beams[0]["row"]
    K = fin.request.alternatives(cfg)
    asked = K is not None
    token_text = functools.cache(decode_one) if asked else None      # beams share most of their tokens
    for b in beams:
        row = b.pop("row")
        if asked:
            b["logprobs"] = tokens_with_logprobs(rows, row, int(rows.n_tok[row]), eos_ids, token_text, tail, K)
    texts, found, cut = ending(best)
    n_gen = int(rows.n_tok[best])
    toks = rows.tokens[best, :n_gen]
    stopped = "max"
    if rows.ended[best]:
        stopped = "eos" if n_gen and toks[-1] in eos_ids else "sentence"
    elif cut is not None:   # budget ran out: cut back to the last sentence end after the keywords
        n_gen, stopped = cut, ("trimmed" if cut < n_gen else "sentence")
        toks, texts = toks[:n_gen], texts[:n_gen]
    generated = texts[-1] if texts else ""
    hits = [found[k.text]["token"] for k in kws if found[k.text] is not None]   # a keyword listed twice counts twice
    success_length = max(hits, default=0) if len(hits) == len(kws) else budget
    lp = rows.logp[best, :n_gen]
    return GenerationResult(
        text=context + generated, context=context, generated=generated, keywords=[k.text for k in kws],
        found=found, success_rate=len(hits) / len(kws) if kws else 1.0, success_length=int(success_length), stopped=stopped,
        perplexity=perplexity(lp) if n_gen else float("nan"), new_tokens=n_gen,
        beams=beams, seconds=seconds, tokens_per_second=n_gen / seconds,
        candidate_tokens_per_second=fin.candidate_tokens_per_second, candidate_tokens=fin.candidate_tokens,
        timings={**timings, "model_rows": fin.model_rows, "plain_row_steps": fin.plain_rows},
        kv_cache_bytes=kv_bytes, prompt_tokens=len(fin.request.context_ids),
        logprobs=beams[0]["logprobs"][:n_gen] if asked else None)     # the returned beam's, as trimmed
