"""The quality score Q of a candidate's chunk and the choice of the beams kept (SPEC, steps 5-6),
as functions of arrays: keyword credit, perplexity's weight, the deadline, selection.

Row arrays are (R,), R the candidate rows of the batch; keyword sets are int64 bitmasks."""
from __future__ import annotations

import math

import numpy as np

from ..config import DBSConfig
from ..text import occurrence
from ..text.constraints import Keyword


def popcount(x: np.ndarray) -> np.ndarray:
    if hasattr(np, "bitwise_count"):
        return np.bitwise_count(x).astype(np.int64)
    return np.array([bin(int(v)).count("1") for v in x], np.int64)


def lowest_bit(x: np.ndarray) -> np.ndarray:
    return x & -x


def bits(mask: int):
    """(bit, keyword index) of every set bit of `mask`, lowest first."""
    while mask:
        b = mask & -mask
        mask ^= b
        yield b, b.bit_length() - 1


def on_time(cfg: DBSConfig, done: np.ndarray, remaining: np.ndarray, budget=None,
            reserve: int | None = None) -> np.ndarray:
    """Rows ahead of their deadline: with `done` tokens generated of their `budget` (per row, or
    the config's `max_new_tokens` if None), at least `reserve` tokens (`reserve_per_keyword` if
    None) are left per keyword still to place (`remaining`: their bits)."""
    end = cfg.deadline_within(cfg.max_new_tokens if budget is None else budget)
    left = end - np.minimum(done, end)
    return left >= popcount(remaining) * (cfg.reserve_per_keyword if reserve is None else reserve)


def alphas(cfg: DBSConfig, ahead: np.ndarray) -> np.ndarray:
    """Weight of perplexity in each row's Q: `alpha_fluent` while the row is `ahead` of its
    deadline (this chunk included), else the paper's alpha."""
    if cfg.alpha_fluent is None:
        return np.full(len(ahead), cfg.alpha)
    return np.where(ahead, cfg.alpha_fluent, cfg.alpha)


def boost_first(cfg: DBSConfig, done: np.ndarray, remaining: np.ndarray, budget=None):
    """Per-row boost order: the configured one, and boost-then-filter for rows behind their
    deadline when `late_boost_first` (their word may lie outside the nucleus); with
    `boost_first_reserve`, behind that later deadline only (before it the full boost waits for the
    word to enter the nucleus)."""
    first = cfg.boost_order == "boost_then_filter"
    if not cfg.late_boost_first or first:
        return first
    return ~on_time(cfg, done, remaining, budget, cfg.boost_first_reserve or None)


def count_new(cfg: DBSConfig, text_before: str, text: str, kw: Keyword, open_end: bool, final: bool,
              unfinished: bool) -> int:
    """Occurrences of `kw` that `text` adds after `text_before`, by the config's rule; an `unfinished`
    row's last word is still being written (a forced word piece follows); with `open_end` a
    keyword at the very end waits for the next token (it may still grow into a longer word)."""
    return occurrence.count_new(text_before, text, kw, open_end or unfinished, final and not unfinished, cfg.match)


def credit(cfg: DBSConfig, kws: list[Keyword], rem: int, text_before: str, text: str, open_end: bool,
           final: bool = False, unfinished: bool = False) -> tuple[float, int]:
    """Q's keyword term for a chunk, sum of exp(-c) over the keywords it places (c: their
    occurrences in the chunk), and their bits. `next` places the next keyword in order (the
    paper; under `guarantee` also the ones after it, in order, which forcing can put in the
    same chunk); `any`, whichever of the remaining ones appear."""
    total, new = 0.0, 0
    for b, k in bits(rem):
        c = count_new(cfg, text_before, text, kws[k], open_end, final, unfinished)
        if c > 0:
            total += math.exp(-c)
            new |= b
        if cfg.order == "next" and (c == 0 or not cfg.guarantee):
            break
    return total, new


def chunk_quality(cfg: DBSConfig, keyword_credit: float, placed: int, perplexity: float, alpha: float) -> float:
    """Q of one chunk: its keyword credit (exp(-c_star) when it places none) times exp(-alpha * PP)."""
    return (keyword_credit if placed else math.exp(-cfg.c_star)) * math.exp(-alpha * perplexity)


MAX_NATS = 700.0        # exp of more overflows float64


def perplexity(logps) -> float:
    """exp(-mean log-prob), at most exp(MAX_NATS): at a low temperature a forced token's log-prob
    can be thousands of nats below zero (a saturated perplexity scores as nothing does)."""
    return math.exp(min(-float(np.mean(logps)), MAX_NATS))


def chunk_scores(cfg: DBSConfig, keywords: list, remaining: np.ndarray, texts_before: list[str], texts: list[str],
                 logps: list, alpha: np.ndarray, final: np.ndarray, unfinished: np.ndarray, open_end: bool):
    """(Q of each row's chunk, the bits of the keywords it places), n rows given per row: its
    request's keywords, the bits still to place, its text before the chunk and the chunk's, the
    scorer's log-probs of the chunk's tokens, its perplexity weight, whether it is final and
    whether its last word is unfinished."""
    q, placed = np.zeros(len(texts)), np.zeros(len(texts), np.int64)
    for j, (kws, rem, text_before, text, lp) in enumerate(zip(keywords, remaining, texts_before, texts, logps)):
        c, placed[j] = credit(cfg, kws, int(rem), text_before, text, open_end, final[j], unfinished[j])
        q[j] = chunk_quality(cfg, c, placed[j], perplexity(lp), alpha[j])
    return q, placed


def seen(cfg: DBSConfig, keywords: list, texts_before: list[str], texts: list[str], masks: np.ndarray,
         final: np.ndarray, unfinished: np.ndarray, open_end: bool) -> np.ndarray:
    """Bits of each row's `masks` whose keyword its chunk so far added (n rows given per row: its
    request's keywords, its text before the chunk and the chunk's so far)."""
    out = np.zeros(len(texts), np.int64)
    for j, (kws, text_before, text) in enumerate(zip(keywords, texts_before, texts)):
        for b, k in bits(int(masks[j])):
            if count_new(cfg, text_before, text, kws[k], open_end, final[j], unfinished[j]) > 0:
                out[j] |= b
    return out


def select_best(req: np.ndarray, cum: np.ndarray, beams: int) -> np.ndarray:
    """Best `beams` rows of every request by cumulative score (stable on ties), in row order.
    Identical candidates may both be kept: a beam kept twice gets twice the candidates next
    chunk, which measured better than dropping the copy (docs/design/decisions.md); the result's
    beams are made distinct instead (`result.build_result`)."""
    order = np.lexsort((np.arange(len(req)), -cum, req))
    req_sorted = req[order]
    starts = np.searchsorted(req_sorted, req_sorted, side="left")
    rank = np.arange(len(order)) - starts
    return np.sort(order[rank < beams])


def keep_going(rows, keep: np.ndarray, stay: np.ndarray, remaining: np.ndarray) -> np.ndarray:
    """The kept rows `keep` (indices into `rows`, from `select_best`), where for a request q with
    `stay[q]` every kept beam ended at EOS before its words (`remaining`: their bits; or scored
    -inf), the best candidate that goes on in the worst kept one's place: the request goes on to
    place its words, where it would have ended without them. A kept beam that ended with every
    word in (a request without keywords: at its EOS) ends the request as it would."""
    live = np.isfinite(rows.cum) & ~rows.ended
    whole = live | (np.isfinite(rows.cum) & rows.ended & (remaining == 0))   # goes on, or ended complete
    stuck = stay & (np.bincount(rows.req[keep[whole[keep]]], minlength=len(stay)) == 0)
    stuck &= np.bincount(rows.req[live], minlength=len(stay)) > 0
    if not stuck.any():
        return keep
    keep = keep.copy()
    for q in np.flatnonzero(stuck):
        at = np.flatnonzero(rows.req[keep] == q)
        on = np.flatnonzero((rows.req == q) & live)
        keep[at[np.argmin(rows.cum[keep[at]])]] = on[np.argmax(rows.cum[on])]
    return keep


def finished_rows(ended: np.ndarray, remaining: np.ndarray) -> np.ndarray:
    """stop="sentence": the finished candidates, every keyword in then a sentence end or EOS, (R,) bool."""
    return ended & (remaining == 0)
