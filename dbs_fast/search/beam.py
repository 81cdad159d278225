"""The beam scheduler of Directed Beam Search (SPEC, "The algorithm, precisely", steps 3-6).

All b*s candidate rows of all requests are one batch: the contexts are prefilled once, every
chunk starts from the kept beams' KV caches (one gather that both keeps and repeats), and the
prefix is never re-encoded. Per-row state lives in `Rows`, a few arrays gathered together.
Between chunks requests may join the batch and leave it (continuous batching, used by the
service): a row's tokens start at the column where its request joined.
"""
from __future__ import annotations

import functools
import math
import time
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from ..config import DBSConfig
from ..kernels import StepRules, top_tokens
from ..text import occurrence
from ..text.constraints import Healing, Keyword
from . import guidance, quality
from .commit import commit
from .rows import Rows
from .tables import BatchTables

LANDINGS = 64     # the copies at a sentence end near the budget a request keeps (`Slot.landings`)


@dataclass(eq=False)
class Request:
    context_ids: list[int]
    keywords: list[Keyword]
    seed: int
    boosts: list = field(default_factory=list)          # per keyword: its SparseBoost (the kernel's guidance);
    #                                                     then, with `lam_ahead`, each at that strength
    force: list[tuple] = field(default_factory=list)    # per keyword: the tokens `guarantee` forces
    phrases: list[tuple] = field(default_factory=list)  # (keyword index, first word's tokens, phrase's tokens)
    bans: list[tuple] = field(default_factory=list)     # banned token sequences
    context: str = ""                                   # the context as given (for the result)
    heal: Healing | None = None                         # token healing: the first token re-writes `heal.tail`
    openings: list[tuple] = field(default_factory=list)  # token sequences that open first-chunk candidates
    min_p: float | None = None                          # the request's min_p (`request.min_p_of`); None: the config's
    max_new_tokens: int | None = None                   # the request's budget of new tokens; None: the config's
    logprobs: int | None = None                         # the request's alternatives per token (`logprobs`); None: the config's
    logit_bias: tuple | None = None                     # the request's `logit_bias` pairs; None: the config's
    sampling: dict = field(default_factory=dict)        # the request's own `config.OWN_SAMPLING` settings by name
    #                                                     (temperature, top_p, penalties); one absent: the config's
    merged: dict = field(default_factory=dict, repr=False)  # order="any": first row -> mask -> merged boost

    def budget(self, cfg) -> int:
        """New tokens at most: the request's own budget, else the config's."""
        return cfg.max_new_tokens if self.max_new_tokens is None else self.max_new_tokens

    def alternatives(self, cfg) -> int | None:
        """Alternatives returned per token (`logprobs`): the request's own, else the config's; None:
        no log-probs asked."""
        return cfg.logprobs if self.logprobs is None else self.logprobs

    def sampled(self, name: str, cfg) -> float:
        """The draw's setting `name` (one of `config.OWN_SAMPLING`) for this request: its own, else
        the config's."""
        return self.sampling.get(name, getattr(cfg, name))


@dataclass
class Timings:
    seconds: dict = field(default_factory=lambda: defaultdict(float))
    calls: dict = field(default_factory=lambda: defaultdict(int))
    kv_bytes: int = 0         # peak bytes of the KV cache after a decode step (0: the backend does not say)

    def add(self, stage: str, t0: float) -> float:
        t = time.perf_counter()
        self.seconds[stage] += t - t0
        self.calls[stage] += 1
        return t

    def kv(self, cache) -> None:
        self.kv_bytes = max(self.kv_bytes, getattr(cache, "nbytes", 0))


def timed(stage: str):
    """A method of an object with Timings `t` whose time counts for `stage`."""
    def wrap(f):
        @functools.wraps(f)
        def run(self, *args, **kwargs):
            t0 = time.perf_counter()
            try:
                return f(self, *args, **kwargs)
            finally:
                self.t.add(stage, t0)
        return run
    return wrap


def certain_length(seqs: list[np.ndarray], sentence_end: np.ndarray | None = None, is_end=None) -> int:
    """Tokens of a request that no later chunk can change, `seqs` its beams' tokens: their
    common prefix; with `sentence_end` (stop="sentence"), up to its last sentence end, as a
    result can be trimmed back to one (`is_end(n)`: whether the first n tokens, ending like a
    sentence, end one: not at "Dr.")."""
    n = min(map(len, seqs), default=0)
    if seqs and n:
        same = np.all(np.stack([s[:n] for s in seqs]) == seqs[0][:n], axis=0)
        n = int(np.argmin(same)) if not same.all() else n
    if sentence_end is not None:
        ends = [int(e) + 1 for e in (np.flatnonzero(sentence_end[seqs[0][:n]]) if n else [])]
        n = next((e for e in reversed(ends) if is_end is None or is_end(e)), 0)
    return n


@dataclass
class Draw:
    """One token drawn for every row, with the guidance it was drawn under."""

    ids: np.ndarray           # (R,) drawn token ids (pad where the row drew nothing)
    logp: np.ndarray          # (R,) their log-probabilities
    remaining: np.ndarray     # (R,) bits of the keywords still to place
    candidates: np.ndarray    # (R,) bits of the keywords guidance may place now
    word: np.ndarray          # (R,) boost-table row guiding the row, -1 unguided
    force: np.ndarray         # (R,) forced token, -1 none
    n_done: np.ndarray        # (R,) the row's tokens before this one
    alt_ids: np.ndarray       # (R, 1 + K) with `logprobs` K: the drawn token, then the K likeliest (else (R, 0))
    alt_logp: np.ndarray      # (R, 1 + K) their log-probabilities, the model's own


@dataclass(eq=False)
class Slot:
    """A request while it is in the batch."""

    request: Request
    rng: np.random.Generator
    t0: float                 # when it joined
    cand0: int                # the batch's candidate-token count then
    chunks: int = 0           # chunks decoded
    model_rows: int = 0       # model rows its decode steps computed
    plain_rows: int = 0       # row-steps of the plain schedule: b*s rows at every step of a chunk
    pool: list = field(default_factory=list)   # stop="sentence": its finished candidates set aside (Rows,
    #                                            request 0, tokens from column 0), each text once
    pooled: set = field(default_factory=set)   # ... their token sequences
    committed: int = 0        # stream_lag: its tokens that every row and candidate starts with (`commit`)
    landings: list = field(default_factory=list)  # stop="eos": copies of its candidates at a
    #                                               sentence end after every keyword near the budget
    #                                               (`DBSConfig.fallback_tokens`), as `pool` holds them
    landed: set = field(default_factory=set)   # ... their token sequences

    def set_aside(self, rows: Rows) -> None:
        """Keep the finished candidates `rows` of this request (copies) that are new."""
        _keep_new(rows, self.pool, self.pooled)

    def keep_landing(self, rows: Rows) -> None:
        """Keep copies of the candidates `rows` at a sentence end near the budget that are new."""
        _keep_new(rows, self.landings, self.landed)

    def drop_kept(self, drop) -> None:
        """Leave out the set-aside candidates and the copies near the budget for which
        `drop(part, i)` holds."""
        self.pool = _drop(self.pool, self.pooled, drop)
        self.landings = _drop(self.landings, self.landed, drop)


def _drop(pool: list, keys: set, drop) -> list:
    """`pool` (as `_keep_new` fills it) without the rows for which `drop(part, i)` holds; their
    token sequences leave `keys`."""
    kept = []
    for part in pool:
        gone = np.array([drop(part, i) for i in range(len(part.req))], bool)
        keys.difference_update(part.generated(i).tobytes() for i in np.flatnonzero(gone))
        if not gone.all():
            kept.append(part.take(np.flatnonzero(~gone)))
    return kept


def _keep_new(rows: Rows, pool: list, keys: set) -> None:
    """Append to `pool` the rows (copies, request 0, tokens from column 0) whose token sequences
    are not yet among `keys`."""
    rows.drop_columns(int(rows.col0[0]))
    new = []
    for i in range(len(rows.req)):
        key = rows.generated(i).tobytes()
        if key not in keys:
            keys.add(key)
            new.append(i)
    if new:
        part = rows.take(np.array(new))
        part.req[:] = 0
        pool.append(part)


def certain_span(search: "BeamSearch", q: int) -> tuple[Rows | None, int, int]:
    """Where request q's certain tokens lie (`certain_text`): a row holding them (rows, index; None
    where the request has none) and how many there are."""
    rows, be = search.rows, search.be
    sources = [(rows, i) for i in np.flatnonzero(rows.req == q)]
    sources += [(p, i) for p in search.slots[q].pool for i in range(len(p.req))]   # set aside: returnable
    if not sources:
        return None, 0, 0
    seqs = [r.generated(i) for r, i in sources]
    context = search.slots[q].request.context

    def is_end(n: int) -> bool:
        return occurrence.ends_a_sentence_here(context + be.decode_batch([seqs[0][:n]])[0])

    n = certain_length(seqs, search.sentence_end if search.cfg.finishes else None, is_end)
    n = max(n, search.slots[q].committed)   # committed: every row and candidate starts with it
    return sources[0][0], int(sources[0][1]), n


def certain_text(search: "BeamSearch", q: int) -> str:
    """Text of request q of a running `search` that no later chunk can change: the common prefix
    of its beams' tokens (with stop="sentence", up to its last sentence end: a result can be
    trimmed back to one), decoded without a trailing partial character. What streams send."""
    return span_text(search, q, *certain_span(search, q))


def span_text(search: "BeamSearch", q: int, rows: Rows | None, i: int, n: int) -> str:
    """Request q's text of the first `n` tokens of row `i` of `rows` (`certain_span`'s answer), without
    the context's characters the first re-writes or a trailing partial character."""
    if not n:
        return ""
    return search.be.decode_batch([rows.generated(i)[:n]])[0][search.tables.tail[q]:].rstrip("\ufffd")


def uniforms(slots: list, req: np.ndarray) -> np.ndarray:
    """One uniform per row for the kernel's draw, from each row's request's own generator (rows
    of a request are contiguous), so a request draws the same numbers in any batch."""
    counts = np.bincount(req, minlength=len(slots))
    return np.concatenate([s.rng.random(n) for s, n in zip(slots, counts)])


def greedy_ranks(rows: Rows, col: int, force: np.ndarray) -> np.ndarray:
    """(R,) each row's rank at temperature 0 (`kernels.StepRules.rank`): among the rows of its
    request with the same tokens before column `col` that draw freely, the number before it. Such
    rows would draw from one distribution, so they take its likeliest tokens in turn: a request's b
    beams open with b different tokens and a beam's s candidates with s, and the search has
    different texts to choose from, as sampled candidates give it."""
    rank = np.zeros(len(rows.req), np.int64)
    free = np.flatnonzero(force < 0)
    if len(free) < 2:
        return rank
    key = np.ascontiguousarray(np.column_stack([rows.req[free], rows.tokens[free, :col]]), np.int64)
    _, inverse = np.unique(key.view(np.dtype((np.void, 8 * key.shape[1]))).ravel(), return_inverse=True)  # by bytes
    inverse = inverse.reshape(-1)
    order = np.argsort(inverse, kind="stable")                # each history's rows, in row order
    starts = np.flatnonzero(np.r_[True, np.diff(inverse[order]) != 0])
    within = np.arange(len(order)) - np.repeat(starts, np.diff(np.r_[starts, len(order)]))
    rank[free[order]] = within
    return rank


def set_aside(slots: list[Slot], rows: Rows, done: np.ndarray, want: int) -> np.ndarray:
    """stop="sentence": the finished candidates `done` (every keyword, then a sentence end or EOS)
    join their requests' pools and leave the beams; returns the requests whose pool holds `want`
    different texts."""
    for q in np.unique(rows.req[done]):
        slots[q].set_aside(rows.take(np.flatnonzero(done & (rows.req == q))))
    rows.cum[done] = -np.inf
    return np.array([len(s.pooled) >= want for s in slots], bool)


@dataclass
class Finished:
    """A request that left the batch: its final beams (request index 0, tokens from column 0)."""

    request: Request
    rows: Rows
    seconds: float                      # from joining to leaving
    candidate_tokens: int               # sampled by the whole batch while it was in
    model_rows: int = 0                 # model rows its decode steps computed
    plain_rows: int = 0                 # ... and those the plain schedule computes
    pooled: bool = False                # rows are the finished candidates it gathered (from any chunk)
    committed: int = 0                  # tokens every row starts with, streamed already (`commit`)
    landings: Rows | None = None        # its kept copies at a sentence end near the budget (`Slot.landings`)
    open_from: int | None = None        # rows from here are the beams the budget ended, which join the finished
    #                                     candidates where fewer than `finished` were gathered

    @property
    def candidate_tokens_per_second(self) -> float:
        return self.candidate_tokens / max(self.seconds, 1e-9)

    @staticmethod
    def leaving(kept: Rows, leave: np.ndarray, slots: list, candidate_tokens: int, pad: int,
                short: np.ndarray | None = None) -> list["Finished"]:
        """The requests in `leave` (bool per slot), each with its finished candidates if it
        gathered any, else its kept rows (copies, request 0, tokens from column 0), and its counts.
        A request in `short` (the budget ended it with fewer finished candidates than it asked for)
        keeps both: its kept rows follow the finished ones (`open_from`), as a beam search's open
        beams join its finished hypotheses at the length limit (transformers' `finalize`)."""
        def own(q: int) -> Rows:
            r = kept.take(np.flatnonzero(kept.req == q))           # a copy: safe to shift
            r.drop_columns(int(r.col0[0]))
            r.req[:] = 0
            return r

        now, out = time.perf_counter(), []
        for q in np.flatnonzero(leave):
            s, open_from = slots[q], None
            if not s.pool:
                r = own(q)
            elif short is not None and short[q] and (kept.req == q).any():
                r = Rows.stack(s.pool, pad)
                open_from, r = len(r.req), Rows.stack([r, own(q)], pad)
            else:
                r = Rows.stack(s.pool, pad)
            out.append(Finished(s.request, r, now - s.t0, candidate_tokens - s.cand0, s.model_rows, s.plain_rows,
                                bool(s.pool), s.committed, Rows.stack(s.landings, pad) if s.landings else None,
                                open_from))
        return out


class BeamSearch:
    """DBS over a batch of requests with a backend (model + sampler) and a scorer. Requests join
    (`admit`) and leave (`step` returns them, `drop` cancels them) at chunk boundaries, so a
    running batch can take new work (continuous batching); `run` admits a fixed set and decodes it
    to the end. All requests of one batch share its config. On a backend that computes distinct
    rows only (`distinct`), a chunk's last token runs through the model after the selection, for
    the kept beams only (the chunk's scores come from the steps before it); otherwise every row
    takes k steps, the plain schedule."""

    def __init__(self, backend, scorer, cfg: DBSConfig, requests: list[Request] = (), progress=None,
                 sentence_end: np.ndarray | None = None, word_piece: np.ndarray | None = None):
        self.be, self.scorer, self.cfg, self.progress = backend, scorer.fresh(cfg), cfg, progress
        # (V,) bool tables of the vocabulary; the API passes cached ones
        vocab = backend.decode_one, backend.vocab_size
        self.sentence_end = occurrence.sentence_end_tokens(*vocab) if cfg.needs_sentence_ends and \
            sentence_end is None else sentence_end
        self.word_piece = occurrence.word_piece_tokens(*vocab) if cfg.guarantee and word_piece is None else word_piece
        # whether a keyword at the last token waits for the next one to count ("pet" + "rified");
        # with the word-piece table glue is banned, so it counts at once
        self.open_end = self.word_piece is None
        self.pad, self.eos = backend.pad_id, np.array(sorted(backend.eos_ids) or [-1])
        self.t, self.candidate_tokens, self.chunks = Timings(), 0, 0
        self.slots: list[Slot] = []
        self.rows: Rows | None = None
        self.tables: BatchTables | None = None     # the requests' tables, rebuilt when one joins or leaves
        self.pending = self.cache = None      # next-token logits (R, V) and the KV cache of the rows
        self.kept_last = bool(getattr(backend, "distinct", False))   # the last step for the kept beams only
        if requests:
            self.admit(list(requests))

    @property
    def requests(self) -> list[Request]:
        return [s.request for s in self.slots]

    @property
    def n_rows(self) -> int:
        return 0 if self.rows is None else len(self.rows.req)

    # -- the loop ---------------------------------------------------------------------------
    def run(self) -> list[Finished]:
        """Decode every admitted request to its end; results in admission order."""
        order, done = self.requests, {}
        n_chunks = math.ceil(int(self.tables.budget.max()) / self.cfg.chunk) if self.slots else 0
        while self.slots:
            done.update((id(f.request), f) for f in self.decode_chunk())
            if self.progress:
                self.progress(min(self.chunks, n_chunks), n_chunks)
        if self.progress:
            self.progress(n_chunks, n_chunks)
        return [done[id(r)] for r in order]

    def decode_chunk(self) -> list[Finished]:
        """One chunk for every row of the batch: sample k tokens, score, keep the best b beams
        per request and repeat each s times; requests at their end leave with their beams."""
        cfg = self.cfg
        left = self.tables.budget - cfg.chunk * np.array([s.chunks for s in self.slots])
        k = int(min(cfg.chunk, left.max()))
        last = left <= k                                    # per request: this is its final chunk
        rows = self.rows
        text_before = self._texts(rows)
        rows, chunk = self._sample_chunk(rows, text_before, k, bool(last.all()))
        self._quality(rows, text_before, self._scorer_logprobs(rows, chunk, bool(last.all())), k)
        left = guidance.remaining(self.tables, rows, 0)
        done = cfg.finishes & quality.finished_rows(rows.ended, left) & np.isfinite(rows.cum)
        full = set_aside(self.slots, rows, done, cfg.finished)   # set aside, the other beams go on; full: they end
        rows.ended |= full[rows.req]
        keep = quality.keep_going(rows, quality.select_best(rows.req, rows.cum, cfg.beams), ~(last | full), left)
        keep = commit(rows, keep, self.slots, ~(last | full), cfg.lag_tokens, cfg.commit_within(self.tables.budget))
        self.chunks += 1
        plain = np.bincount(rows.req, minlength=len(self.slots)) * (k - last)
        for s, n in zip(self.slots, plain):
            s.chunks += 1
            s.plain_rows += int(n)
        kept = rows.take(keep)
        leave = last | full
        leave |= np.bincount(kept.req[~kept.ended & np.isfinite(kept.cum)],
                             minlength=len(self.slots)) == 0   # no beam goes on
        stay = keep[~leave[rows.req[keep]]]
        if self.kept_last and len(stay):          # the chunk's last token, for the beams that go on
            need = np.zeros(len(rows.req), bool)
            need[stay] = True
            self._next_logits(rows, rows.tokens[:, -1], need & ~rows.final(self._budget(rows)))
        finished = Finished.leaving(kept, leave, self.slots, self.candidate_tokens, self.pad, last & ~full)
        self._regrow(rows, keep, leave)
        return finished

    @timed("kv_gather")
    def _regrow(self, rows: Rows, keep: np.ndarray, leave: np.ndarray) -> None:
        """The kept beams of the requests that stay, each repeated s times (one gather of rows,
        logits and caches); the requests in `leave` go."""
        s = self.cfg.candidates
        stays = ~leave[rows.req[keep]]
        grow = np.repeat(keep[stays], s)                    # keep and repeat: one gather
        self.rows = rows.take(grow)
        if len(grow):
            self.pending, self.cache = self.be.gather(self.pending, self.cache, grow)
            self.scorer.select(grow)
        dup = self.rows.ended & (np.arange(len(grow)) % s > 0)
        self.rows.cum[dup] = -np.inf                        # an ended beam is one candidate, not s
        self._leave(leave)

    # -- requests joining and leaving ---------------------------------------------------------
    @timed("prefill")
    def admit(self, requests: list[Request]) -> None:
        """`requests` join the batch (between chunks): contexts prefilled, `beams` rows each."""
        t0 = time.perf_counter()
        contexts = [r.context_ids for r in requests]
        pending, cache = self.be.prefill(contexts, max(r.budget(self.cfg) for r in requests))    # (Q, V)
        per = [self.cfg.beams + (self.cfg.opened_rows if r.openings else 0) for r in requests]
        first = np.repeat(np.arange(len(requests)), per)      # step 1: b beams, b*s where openings seed some
        pending, cache = self.be.gather(pending, cache, first)
        self.scorer.admit(contexts, first)
        rows = Rows.new(first + len(self.slots), 0 if self.rows is None else self.rows.tokens.shape[1], self.pad,
                        0 if self.cfg.logprobs is None else 1 + self.cfg.logprobs)
        if self.rows is None:
            self.rows, self.pending, self.cache = rows, pending, cache
        else:
            self.rows = Rows.concat([self.rows, rows])
            self.pending, self.cache = self.be.join(self.pending, self.cache, pending, cache)
        q0 = len(self.slots)
        self.slots += [Slot(r, np.random.default_rng(r.seed), t0, self.candidate_tokens) for r in requests]
        self._index()
        self._open(len(self.rows.req) - len(first), q0, per)

    def _open(self, row0: int, q0: int, per: list[int]) -> None:
        """The first rows of each joining request (requests q0.., `per` rows each from `row0`)
        begin with its openings, forced; at least b rows draw freely."""
        for q, start in zip(range(q0, len(self.slots)), row0 + np.cumsum([0] + per[:-1])):
            seqs = self.tables.openings[q][:self.cfg.opened_rows]
            self.rows.fseq[start:start + len(seqs)], self.rows.fpos[start:start + len(seqs)] = seqs, 0

    def drop(self, requests) -> None:
        """Cancel `requests` (between chunks): their rows leave, no result."""
        gone = np.array([any(s.request is r for r in requests) for s in self.slots], bool)
        if not gone.any():
            return
        stay = np.flatnonzero(~gone[self.rows.req])
        self.rows = self.rows.take(stay)
        self.pending, self.cache = self.be.gather(self.pending, self.cache, stay)
        self.scorer.select(stay)
        self._leave(gone)

    def _leave(self, gone: np.ndarray) -> None:
        """Forget the requests in `gone` (their rows are already out): renumber the rest, drop
        token and cache columns no row needs any more, rebuild the per-request tables."""
        if not gone.any():
            return
        stay = np.flatnonzero(~gone)
        self.slots = [self.slots[q] for q in stay]
        if not self.slots:
            self.rows = self.pending = self.cache = self.tables = None
            self.be.release()                              # a decoder may bind the cache's arrays
            self.scorer = self.scorer.fresh(self.cfg)      # its rows left too (an empty select is no gather)
            return
        self.rows.req = (np.cumsum(~gone) - 1)[self.rows.req]        # the requests that stay, renumbered
        self.rows.drop_columns(int(self.rows.col0.min()))
        self.cache = self.be.trim(self.cache)
        self.scorer.trim()
        self._index()

    def _index(self) -> None:
        """The tables of the requests in the batch, in slot order; rows being forced follow them."""
        before = self.tables
        self.tables = BatchTables.build(self.requests, self.cfg, self.pad, self.eos, self.sentence_end,
                                        self.word_piece)
        if before is not None and self.rows is not None:
            self.tables.remap_forcing(self.rows.fseq, before)

    # -- steps ------------------------------------------------------------------------------
    @timed("text")
    def _texts(self, rows: Rows) -> list[str]:
        return self._generated_texts(rows, range(len(rows.req)))

    def _generated_texts(self, rows: Rows, idx) -> list[str]:
        """The text each row in `idx` added to its context (decoded whole: no broken boundaries;
        a healed context's end, which the first token re-wrote, left out)."""
        cut = self.tables.tail[rows.req[list(idx)]]
        return [t[c:] for t, c in zip(self.be.decode_batch([rows.generated(i) for i in idx]), cut)]

    # -- guidance (dbs_fast.search.guidance): what steers each row at a step --------------------------
    def _sample_chunk(self, rows: Rows, text_before: list[str], k: int, last: bool):
        R = len(rows.req)
        seen = np.zeros(R, np.int64)         # keywords seen in this chunk so far (guidance moves on)
        base = rows.tokens.shape[1]
        done, left = base + k - rows.col0, guidance.remaining(self.tables, rows, 0)   # once the chunk is in
        budget = self._budget(rows)
        ahead = quality.on_time(self.cfg, done, left, budget)
        boost_first = quality.boost_first(self.cfg, done, left, budget)
        rows.add_columns(k, self.pad)                                                          # (R, L+k)
        for j in range(k):
            d = self._draw(rows, seen, base + j, boost_first, ahead)
            live = self._append(rows, d, base + j)
            seen = self._mark_seen(rows, text_before, d, live, seen, base + j)
            if j < k - 1 or not (last or self.kept_last):
                self._next_logits(rows, d.ids, ~rows.final(budget))
        self.t.kv(self.cache)                # within a chunk the cache only grows: its peak, read once
        return rows, rows.tokens[:, base:]

    @timed("sample")
    def _draw(self, rows: Rows, seen: np.ndarray, col: int, boost_first, ahead: np.ndarray) -> Draw:
        """The next token of every row: guidance, forcing, bans and repetition rules, then the kernel."""
        cfg, tb = self.cfg, self.tables
        rem = guidance.remaining(self.tables, rows, seen)
        cand = guidance.candidates(cfg, rem, seen)
        n_done = col - rows.col0                     # the row's tokens so far
        healing = (n_done == 0) & tb.heals[rows.req]        # the model alone writes the first token
        word = np.where(healing, -1, guidance.guide_words(cfg, tb, rows, cand, ahead)).astype(np.int32)
        force = guidance.forced(cfg, tb, rows, rem, n_done)
        hist, hstart, hgen = guidance.history(cfg, tb, rows, col, healing)
        own = {name: v[rows.req] for name, v in tb.sampling.items()}      # each row's request's sampling settings
        rules = StepRules(cfg, word, tb.boosts.csr, tb.boosts.dense_exp(self.pending.shape[1]), boost_first, force,
                          hist, hstart, tb.bans, guidance.ban_groups(cfg, tb, rows, rem, healing, n_done),
                          self.be.words if cfg.no_repeat_word_window else None, tb.min_p[rows.req],
                          greedy_ranks(rows, col, force) if (own["temperature"] == 0).any() else None,
                          hgen, own, tb.biases, tb.bias_of[rows.req])
        ids, lp = self.be.sample(self.pending, uniforms(self.slots, rows.req), rules)
        alternatives = self._alternatives(ids, lp, rules.inv_temperatures(len(ids)))
        return Draw(ids, lp, rem, cand, word, force, n_done, *alternatives)

    def _alternatives(self, ids: np.ndarray, lp: np.ndarray, inv_t: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """With `logprobs` K: each row's drawn token, then the K likeliest tokens of its logits, and
        their log-probs, the model's own at the draw's temperature, as `lp` (the drawn token's: its
        normaliser is the drawn token's logit less `lp`; `inv_t` (R,) 1 / each row's temperature),
        kept apart from a second-LM scorer's."""
        if self.cfg.logprobs is None:
            return np.zeros((len(ids), 0), np.int64), np.zeros((len(ids), 0), np.float32)
        K = self.cfg.logprobs
        logits, rows = self.pending, None
        if hasattr(logits, "table"):                  # `backend.RowLogits`: each row's logits read where they lie
            logits, rows = logits.table, logits.rows
        if hasattr(logits, "cpu"):                    # a torch baseline's logits
            logits = logits.float().cpu()
        return alternatives(np.asarray(logits, np.float32), K, rows, ids, lp, inv_t)

    def _append(self, rows: Rows, d: Draw, col: int) -> np.ndarray:
        """Write the draw into column `col` of the rows that draw a real token (returned: `live`);
        the others get padding (`d.ids` too)."""
        live = ~rows.ended & (d.n_done < self._budget(rows))
        d.ids = np.where(live, d.ids, self.pad)
        rows.tokens[:, col], rows.logp[:, col] = d.ids, d.logp
        rows.alt_ids[:, col], rows.alt_logp[:, col] = d.alt_ids, d.alt_logp
        self.candidate_tokens += int(live.sum())
        rows.n_tok += live
        rows.ended |= live & np.isin(d.ids, self.eos)
        return live

    def _mark_seen(self, rows: Rows, text_before: list[str], d: Draw, live: np.ndarray, seen: np.ndarray,
                   col: int) -> np.ndarray:
        """Keywords the new token completed (guidance moves on, forcing advances, a sentence end
        after the last keyword ends the row); returns the chunk's keywords seen so far."""
        check = (d.word >= 0) | (d.force >= 0)
        new = np.zeros(len(rows.req), np.int64)
        if check.any():
            new = self._seen_now(rows, text_before, np.flatnonzero(check & live), np.where(d.force >= 0, d.remaining,
                                                                                      d.candidates),
                                 guidance.unfinished(self.tables, rows, d.force >= 0, 1, self.word_piece))
        rows.glue = (new & ~seen) != 0
        seen = seen | new
        guidance.advance_forcing(self.tables, rows, d.force, seen, col + 1, self.word_piece)
        budget = self._budget(rows)
        if self.cfg.stop == "sentence":               # all keywords in (before or in this chunk) + sentence end
            rows.ended[self._sentence_ends(rows, d, live, seen, None, budget)] = True
        fallback = self.cfg.fallback_within(budget)     # near the budget: copies of the rows at a sentence end
        if fallback.any():
            for i in self._sentence_ends(rows, d, live, seen, fallback, budget):
                slot = self.slots[rows.req[i]]
                if len(slot.landed) < LANDINGS:
                    slot.keep_landing(rows.take(np.array([i])))
        return seen

    def _sentence_ends(self, rows: Rows, d: Draw, live: np.ndarray, seen: np.ndarray,
                       within: np.ndarray | None, budget: np.ndarray) -> np.ndarray:
        """The live rows whose new token ends a sentence after every keyword (placed before or in
        this chunk), not at an abbreviation or an initial ("Dr.", "J."); with `within` (per row, 0:
        none), only rows within that many tokens of their `budget` (per row)."""
        near = live & self.sentence_end[d.ids]
        if within is not None:
            near &= (within > 0) & (rows.n_tok >= budget - within)
        end = np.flatnonzero(near & (guidance.remaining(self.tables, rows, seen) == 0))
        if not len(end):
            return end
        texts = self._generated_texts(rows, end)
        return end[[occurrence.ends_generated_sentence(self.slots[rows.req[i]].request.context, t)
                    for i, t in zip(end, texts)]]

    @timed("model")
    def _next_logits(self, rows: Rows, ids: np.ndarray, need: np.ndarray) -> None:
        """One decode step of the model over the drawn tokens: the next logits (read for the rows
        in `need`), the cache grown; the model rows it took counted per request. Of its time, the
        runtime's own call counts as "graph" too (the rest is the host's work around it)."""
        g0 = self.be.graph_seconds
        self.pending, self.cache = self.be.step(ids, self.cache, need)
        self.t.seconds["graph"] += self.be.graph_seconds - g0
        done = rows.req if self.be.computed is None else rows.req[self.be.computed]
        for s, n in zip(self.slots, np.bincount(done, minlength=len(self.slots))):
            s.model_rows += int(n)

    @timed("text")
    def _seen_now(self, rows: Rows, text_before, idx, masks, unfinished) -> np.ndarray:
        """Bits of `masks` (per row) whose keyword appeared in the row's chunk so far (`unfinished`
        rows: not at their very end, as the next token continues the word)."""
        seen = np.zeros(len(rows.req), np.int64)
        final = rows.final(self._budget(rows))
        seen[idx] = quality.seen(self.cfg, self._keywords(rows, idx), [text_before[i] for i in idx],
                                 self._chunk_texts(rows, text_before, idx), masks[idx], final[idx], unfinished[idx],
                                 self.open_end)
        return seen

    def _keywords(self, rows: Rows, idx) -> list[list[Keyword]]:
        return [self.slots[rows.req[i]].request.keywords for i in idx]

    def _chunk_texts(self, rows: Rows, text_before, idx) -> list[str]:
        """Text each row in `idx` added after its prefix."""
        return [f[len(text_before[i]):] for f, i in zip(self._generated_texts(rows, idx), idx)]

    @timed("scorer")
    def _scorer_logprobs(self, rows: Rows, chunk: np.ndarray, last: bool) -> np.ndarray:
        """The scorer's log-probs of every row's chunk (R, k), kept as the rows' own."""
        k = chunk.shape[1]
        lp = self.scorer.score(chunk, rows.logp[:, -k:], last)
        rows.logp[:, -k:] = lp
        return lp

    @timed("quality")
    def _quality(self, rows: Rows, text_before: list[str], lp: np.ndarray, k: int) -> None:
        """Q of each candidate's chunk from its keyword credit and perplexity (`lp`: the scorer's
        log-probs), added to its parent's cumulative score `cum`."""
        before = rows.tokens.shape[1] - k - rows.col0       # the rows' tokens before this chunk (at most)
        n_new = np.clip(rows.n_tok - before, 0, k)
        idx = np.flatnonzero(n_new > 0)
        texts = self._chunk_texts(rows, text_before, idx)
        alpha = quality.alphas(self.cfg, self._on_time(rows, rows.tokens.shape[1]))
        left = guidance.remaining(self.tables, rows, 0)
        unfinished = guidance.unfinished(self.tables, rows, ~rows.ended, 0, self.word_piece)
        q, placed = quality.chunk_scores(self.cfg, self._keywords(rows, idx), left[idx],
                                         [text_before[i] for i in idx], texts, [lp[i, : n_new[i]] for i in idx],
                                         alpha[idx], rows.final(self._budget(rows))[idx], unfinished[idx],
                                         self.open_end)
        rows.cum[idx] += q
        rows.found[idx] |= placed

    def _budget(self, rows: Rows) -> np.ndarray:
        """(R,) each row's budget of new tokens: its request's."""
        return self.tables.budget[rows.req]

    def _on_time(self, rows: Rows, col: int) -> np.ndarray:
        """Rows ahead of their deadline once the tokens up to column `col` are generated."""
        return quality.on_time(self.cfg, col - rows.col0, guidance.remaining(self.tables, rows, 0), self._budget(rows))


def alternatives(logits: np.ndarray, K: int, rows, ids: np.ndarray, lp: np.ndarray,
                 inv_t: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each drawn token `ids` (R,), then the K likeliest tokens of its row's logits (`rows` (R,)
    their rows of `logits`; None: row r), and their log-probs at the draw's temperature (`inv_t`
    (R,) 1 / T), normalised as the drawn token's log-prob `lp` is: the drawn token among the K
    gets `lp` itself, to the bit, as OpenAI's `top_logprobs` repeat the token's `logprob`."""
    table_rows = np.arange(len(ids)) if rows is None else np.asarray(rows, np.int64)
    once, row = np.unique(table_rows, return_inverse=True)       # rows that share logits share their top
    top, raw = (a[row.reshape(-1)] for a in top_tokens(logits, K, once))
    logz = logits[table_rows, ids] * inv_t - lp
    top_lp = np.where(top == ids[:, None], lp[:, None], raw * inv_t[:, None] - logz[:, None])
    return np.column_stack([ids, top]).astype(np.int64), np.column_stack([lp, top_lp]).astype(np.float32)
