"""The beam scheduler of Directed Beam Search (SPEC, "The algorithm, precisely", steps 3-6).

All b*s candidate rows of all requests are one batch: the contexts are prefilled once, every
chunk starts from the kept beams' KV caches (one gather that both keeps and repeats), and the
prefix is never re-encoded. Per-row state lives in `Rows`, a few arrays gathered together.
"""
from __future__ import annotations

import math
import time
from collections import defaultdict
from dataclasses import dataclass, field, fields

import numpy as np

from . import occurrence
from .config import DBSConfig


@dataclass
class Request:
    context_ids: list[int]
    keywords: list[str]
    word_base: int            # row of its first keyword in the CSR boost table
    seed: int


@dataclass
class Rows:
    """Per-candidate state; every field has the row count as its leading dimension."""

    req: np.ndarray           # (R,) request index
    ptr: np.ndarray           # (R,) index of the current guide word
    cum: np.ndarray           # (R,) float64 cumulative quality score
    ended: np.ndarray         # (R,) bool, emitted EOS
    tokens: np.ndarray        # (R, L) int64 generated tokens (EOS padded after the end)
    logp: np.ndarray          # (R, L) float32 scorer log-probabilities of those tokens
    n_tok: np.ndarray         # (R,) tokens that count (up to and including EOS)

    def take(self, rows: np.ndarray) -> "Rows":
        return Rows(*(getattr(self, f.name)[rows] for f in fields(self)))


@dataclass
class Timings:
    seconds: dict = field(default_factory=lambda: defaultdict(float))

    def add(self, stage: str, t0: float) -> float:
        t = time.perf_counter()
        self.seconds[stage] += t - t0
        return t


class BeamSearch:
    """One run of DBS over a batch of requests with a backend (model + sampler) and a scorer."""

    def __init__(self, backend, scorer, cfg: DBSConfig, csr, requests: list[Request], progress=None,
                 sentence_end: np.ndarray | None = None):
        self.be, self.scorer, self.cfg, self.csr = backend, scorer, cfg, csr
        self.requests = requests
        if cfg.stop == "sentence" and sentence_end is None:   # (V,) bool; the API passes a cached one
            sentence_end = occurrence.sentence_end_tokens(backend.decode_one, backend.vocab_size)
        self.sentence_end = sentence_end
        ctx_len = np.array([len(r.context_ids) for r in requests])
        self.ctx = np.zeros((len(requests), ctx_len.max()), np.int64)      # left-padded contexts
        for q, r in enumerate(requests):
            self.ctx[q, self.ctx.shape[1] - len(r.context_ids):] = r.context_ids
        self.ctx_start = (self.ctx.shape[1] - ctx_len).astype(np.int32)
        self.rngs = [np.random.default_rng(r.seed) for r in requests]
        self.n_kw = np.array([len(r.keywords) for r in requests])
        self.word_base = np.array([r.word_base for r in requests])
        self.pad = backend.pad_id
        self.eos = np.array(sorted(backend.eos_ids) or [-1])
        self.progress = progress
        self.t = Timings()
        self.candidate_tokens = 0

    # -- the loop ---------------------------------------------------------------------------
    def run(self) -> Rows:
        cfg = self.cfg
        t0 = time.perf_counter()
        pending, cache = self.be.prefill([r.context_ids for r in self.requests])   # (Q, V)
        self.scorer.prefill([r.context_ids for r in self.requests])
        t0 = self.t.add("prefill", t0)
        Q = len(self.requests)
        first = np.repeat(np.arange(Q), cfg.beams)            # step 1: b beams per request
        rows = Rows(first, np.zeros(len(first), np.int64), np.zeros(len(first)), np.zeros(len(first), bool),
                    np.zeros((len(first), 0), np.int64), np.zeros((len(first), 0), np.float32),
                    np.zeros(len(first), np.int64))
        pending, cache = self.be.take(pending, first), self.be.select(cache, first)
        self.scorer.select(first)
        n_chunks = math.ceil(cfg.max_new_tokens / cfg.chunk)
        for c in range(n_chunks):
            k = min(cfg.chunk, cfg.max_new_tokens - c * cfg.chunk)
            last = c == n_chunks - 1
            prefix = self._texts(rows)
            rows, chunk, pending, cache = self._decode_chunk(rows, prefix, k, pending, cache, last)
            rows = self._score(rows, prefix, chunk, last)
            if cfg.stop == "sentence":
                rows = self._finish_requests(rows)
            keep = self._select_best(rows)
            if last:
                rows = rows.take(keep)
                break
            grow = np.repeat(keep, cfg.candidates)            # keep and repeat: one gather
            t0 = time.perf_counter()
            rows = rows.take(grow)
            pending, cache = self.be.take(pending, grow), self.be.select(cache, grow)
            self.scorer.select(grow)
            self.t.add("kv_gather", t0)
            dup = rows.ended & (np.arange(len(grow)) % cfg.candidates > 0)
            rows.cum[dup] = -np.inf                           # an ended beam is one candidate, not s
            if self.progress:
                self.progress(c + 1, n_chunks)
            if rows.ended.all():
                break
        if self.progress:
            self.progress(n_chunks, n_chunks)
        return rows

    # -- steps ------------------------------------------------------------------------------
    def _texts(self, rows: Rows) -> list[str]:
        t0 = time.perf_counter()
        out = self.be.decode_batch([rows.tokens[i, : rows.n_tok[i]] for i in range(len(rows.req))])
        self.t.add("text", t0)
        return out

    def _guide_words(self, rows: Rows) -> np.ndarray:
        """Global boost-table row of each row's current guide word, -1 when unguided."""
        on = (rows.ptr < self.n_kw[rows.req]) if self.cfg.guided else np.zeros(len(rows.req), bool)
        return np.where(on, self.word_base[rows.req] + rows.ptr, -1).astype(np.int32)

    def _uniforms(self, rows: Rows) -> np.ndarray:
        counts = np.bincount(rows.req, minlength=len(self.rngs))
        return np.concatenate([g.random(n) for g, n in zip(self.rngs, counts)])

    def _history(self, rows: Rows, n_gen: int):
        """Each row's tokens so far (context + generated) for the kernel's repetition rules."""
        if not self.cfg.shapes_logits:
            return None, None
        return np.concatenate([self.ctx[rows.req], rows.tokens[:, :n_gen]], axis=1), self.ctx_start[rows.req]

    def _decode_chunk(self, rows: Rows, prefix: list[str], k: int, pending, cache, last: bool):
        R = len(rows.req)
        word = self._guide_words(rows)
        active = word >= 0
        guided_at_start = active.copy()
        last_word = rows.ptr == self.n_kw[rows.req] - 1
        base = rows.tokens.shape[1]
        boost_first = self._boost_first(rows, base + k)
        rows.tokens = np.concatenate([rows.tokens, np.full((R, k), self.pad, np.int64)], axis=1)  # (R, L+k)
        rows.logp = np.concatenate([rows.logp, np.zeros((R, k), np.float32)], axis=1)
        for j in range(k):
            t0 = time.perf_counter()
            hist, hstart = self._history(rows, base + j)
            ids, lp = self.be.sample(pending, self._uniforms(rows), np.where(active, word, -1), self.csr, self.cfg,
                                     hist, hstart, boost_first)
            t0 = self.t.add("kernel", t0)
            ids = np.where(rows.ended, self.pad, ids)
            rows.tokens[:, base + j], rows.logp[:, base + j] = ids, lp
            live = ~rows.ended                         # rows that drew a real token this step
            self.candidate_tokens += int(live.sum())
            rows.n_tok += live
            rows.ended |= np.isin(ids, self.eos)
            if active.any():
                active &= ~self._word_seen(rows, prefix, word, active)
            if self.cfg.stop == "sentence":   # all keywords in (before or in this chunk) + sentence end
                all_in = (rows.ptr >= self.n_kw[rows.req]) | (last_word & guided_at_start & ~active)
                rows.ended |= live & all_in & self.sentence_end[ids]
            t0 = time.perf_counter()
            if not (last and j == k - 1):
                pending, cache = self.be.step(ids, cache)
            self.t.add("model", t0)
        return rows, rows.tokens[:, base:], pending, cache

    def _word_seen(self, rows: Rows, prefix, word, active) -> np.ndarray:
        """Rows whose current guide word appeared in the chunk so far (guidance then stops)."""
        t0 = time.perf_counter()
        idx = np.flatnonzero(active)
        seen = np.zeros(len(rows.req), bool)
        for i, text in zip(idx, self._chunk_texts(rows, prefix, idx)):
            kw = self.requests[rows.req[i]].keywords[rows.ptr[i]]
            seen[i] = occurrence.count_new(prefix[i], text, kw) > 0
        self.t.add("text", t0)
        return seen

    def _chunk_texts(self, rows: Rows, prefix, idx) -> list[str]:
        """Text each row in `idx` added after its prefix (decoded whole: no broken boundaries)."""
        full = self.be.decode_batch([rows.tokens[i, : rows.n_tok[i]] for i in idx])
        return [f[len(prefix[i]):] for f, i in zip(full, idx)]

    def _score(self, rows: Rows, prefix: list[str], chunk: np.ndarray, last: bool) -> Rows:
        """Quality Q of every candidate's chunk, added to its parent's cumulative score."""
        t0 = time.perf_counter()
        k = chunk.shape[1]
        lp = self.scorer.score(chunk, rows.logp[:, -k:], last)
        rows.logp[:, -k:] = lp
        t0 = self.t.add("scorer", t0)
        base = rows.tokens.shape[1] - k
        n_new = np.clip(rows.n_tok - base, 0, k)
        idx = np.flatnonzero(n_new > 0)
        texts = self._chunk_texts(rows, prefix, idx)
        cfg = self.cfg
        alpha = self._alphas(rows)
        for i, text in zip(idx, texts):
            pp = math.exp(-float(lp[i, : n_new[i]].mean()))
            kws = self.requests[rows.req[i]].keywords
            c = occurrence.count_new(prefix[i], text, kws[rows.ptr[i]]) if rows.ptr[i] < len(kws) else 0
            q = math.exp(-((c if c > 0 else cfg.c_star) + alpha[i] * pp))
            if c > 0:
                rows.ptr[i] += 1
            rows.cum[i] += q
        self.t.add("text", t0)
        return rows

    def _on_time(self, rows: Rows, tokens_after: int) -> np.ndarray:
        """Rows ahead of their deadline: after `tokens_after` generated tokens, at least
        `reserve_per_keyword` tokens are left per keyword still to place."""
        left = self.cfg.max_new_tokens - tokens_after
        return left >= (self.n_kw[rows.req] - rows.ptr) * self.cfg.reserve_per_keyword

    def _alphas(self, rows: Rows) -> np.ndarray:
        """Weight of perplexity in each row's Q: `alpha_fluent` while the row is ahead of its
        deadline (this chunk included), else the paper's alpha."""
        cfg = self.cfg
        if cfg.alpha_fluent is None:
            return np.full(len(rows.req), cfg.alpha)
        return np.where(self._on_time(rows, rows.tokens.shape[1]), cfg.alpha_fluent, cfg.alpha)

    def _boost_first(self, rows: Rows, tokens_after: int):
        """Per-row boost order: the configured one, and boost-then-filter for rows behind their
        deadline when `late_boost_first` (their word may lie outside the nucleus)."""
        first = self.cfg.boost_order == "boost_then_filter"
        if not self.cfg.late_boost_first or first:
            return first
        return ~self._on_time(rows, tokens_after)

    def _finish_requests(self, rows: Rows) -> Rows:
        """stop="sentence": a request with a finished beam (every keyword, then a sentence end or
        EOS) is done; its unfinished beams are dropped, so only finished ones can be chosen."""
        finished = rows.ended & (rows.ptr >= self.n_kw[rows.req])
        done = np.zeros(len(self.requests), bool)
        done[rows.req[finished]] = True
        drop = done[rows.req] & ~finished
        rows.cum[drop] = -np.inf
        rows.ended |= done[rows.req]
        return rows

    def _select_best(self, rows: Rows) -> np.ndarray:
        """Best `beams` rows of every request by cumulative score (stable on ties)."""
        order = np.lexsort((np.arange(len(rows.req)), -rows.cum, rows.req))
        req_sorted = rows.req[order]
        starts = np.searchsorted(req_sorted, req_sorted, side="left")
        rank = np.arange(len(order)) - starts
        return np.sort(order[rank < self.cfg.beams])
