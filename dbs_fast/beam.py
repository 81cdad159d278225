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
from dataclasses import dataclass, field, fields

import numpy as np

from . import occurrence
from .config import DBSConfig
from .constraints import BoostTable, Healing, Keyword, SequenceTable


@dataclass(eq=False)
class Request:
    context_ids: list[int]
    keywords: list[Keyword]
    seed: int
    boosts: list = field(default_factory=list)          # per keyword: its SparseBoost (the kernel's guidance)
    force: list[tuple] = field(default_factory=list)    # per keyword: the tokens `guarantee` forces
    phrases: list[tuple] = field(default_factory=list)  # (keyword index, first word's tokens, phrase's tokens)
    bans: list[tuple] = field(default_factory=list)     # banned token sequences
    context: str = ""                                   # the context as given (for the result)
    heal: Healing | None = None                         # token healing: the first token re-writes `heal.tail`
    merged: dict = field(default_factory=dict, repr=False)  # order="any": mask -> merged boost, cached


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


@dataclass
class Rows:
    """Per-candidate state; every field has the row count as its leading dimension."""

    req: np.ndarray           # (R,) request index
    found: np.ndarray         # (R,) int64 bitmask of the request's keywords placed (credited at chunk ends)
    cum: np.ndarray           # (R,) float64 cumulative quality score
    ended: np.ndarray         # (R,) bool, emitted EOS
    tokens: np.ndarray        # (R, L) int64 generated tokens from column col0 on (EOS padded after the end)
    logp: np.ndarray          # (R, L) float32 scorer log-probabilities of those tokens
    n_tok: np.ndarray         # (R,) tokens that count (up to and including EOS)
    fseq: np.ndarray          # (R,) sequence being forced (index into the forced-sequence table) or -1
    fpos: np.ndarray          # (R,) next position in it
    glue: np.ndarray          # (R,) bool: a keyword ended at the last token (it must stay a word)
    col0: np.ndarray          # (R,) column of the row's first token: its request joined the batch then

    def take(self, rows: np.ndarray) -> "Rows":
        return Rows(*(getattr(self, f.name)[rows] for f in fields(self)))

    @staticmethod
    def new(req: np.ndarray, width: int, pad: int) -> "Rows":
        """Fresh rows for requests `req` joining a batch whose token columns are `width` wide."""
        n = len(req)
        return Rows(req, np.zeros(n, np.int64), np.zeros(n), np.zeros(n, bool), np.full((n, width), pad, np.int64),
                    np.zeros((n, width), np.float32), np.zeros(n, np.int64), np.full(n, -1, np.int64),
                    np.zeros(n, np.int64), np.zeros(n, bool), np.full(n, width, np.int64))

    @staticmethod
    def concat(parts: list["Rows"]) -> "Rows":
        return Rows(*(np.concatenate([getattr(p, f.name) for p in parts]) for f in fields(Rows)))

    def generated(self, i: int) -> np.ndarray:
        """Row i's generated tokens (up to and including EOS)."""
        return self.tokens[i, self.col0[i]: self.col0[i] + self.n_tok[i]]


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


@dataclass(eq=False)
class Slot:
    """A request while it is in the batch."""

    request: Request
    rng: np.random.Generator
    t0: float                 # when it joined
    cand0: int                # the batch's candidate-token count then
    chunks: int = 0           # chunks decoded


@dataclass
class Finished:
    """A request that left the batch: its final beams (request index 0, tokens from column 0)."""

    request: Request
    rows: Rows
    seconds: float                      # from joining to leaving
    candidate_tokens: int               # sampled by the whole batch while it was in

    @property
    def candidate_tokens_per_second(self) -> float:
        return self.candidate_tokens / max(self.seconds, 1e-9)


class BeamSearch:
    """DBS over a batch of requests with a backend (model + sampler) and a scorer.

    Requests join (`admit`) and leave (`step` returns them, `drop` cancels them) at chunk
    boundaries, so a running batch can take new work (continuous batching); `run` admits a
    fixed set and decodes it to the end. All requests of one batch share its config."""

    def __init__(self, backend, scorer, cfg: DBSConfig, requests: list[Request] = (), progress=None,
                 sentence_end: np.ndarray | None = None, word_piece: np.ndarray | None = None):
        self.be, self.scorer, self.cfg = backend, scorer.fresh(cfg), cfg
        if cfg.needs_sentence_ends and sentence_end is None:   # (V,) bool; the API passes a cached one
            sentence_end = occurrence.sentence_end_tokens(backend.decode_one, backend.vocab_size)
        self.sentence_end = sentence_end
        if cfg.guarantee and word_piece is None:   # (V,) bool; the API passes a cached one
            word_piece = occurrence.word_piece_tokens(backend.decode_one, backend.vocab_size)
        self.word_piece = word_piece
        self.pad = backend.pad_id
        self.eos = np.array(sorted(backend.eos_ids) or [-1])
        self.progress = progress
        self.t = Timings()
        self.candidate_tokens = 0
        self.chunks = 0
        self.slots: list[Slot] = []
        self.rows: Rows | None = None
        self.forced: SequenceTable | None = None   # forced token sequences of the batch's requests
        self.pending = self.cache = None      # next-token logits (R, V) and the KV cache of the rows
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
        order = self.requests
        n_chunks = math.ceil(self.cfg.max_new_tokens / self.cfg.chunk)
        done = {}
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
        left = cfg.max_new_tokens - cfg.chunk * np.array([s.chunks for s in self.slots])
        k = int(min(cfg.chunk, left.max()))
        last = left <= k                                    # per request: this is its final chunk
        rows = self.rows
        prefix = self._texts(rows)
        rows, chunk = self._sample_chunk(rows, prefix, k, bool(last.all()))
        rows = self._score(rows, prefix, chunk, bool(last.all()))
        if cfg.stop == "sentence":
            rows = self._finish_requests(rows)
        keep = self._select_best(rows)
        self.chunks += 1
        for s in self.slots:
            s.chunks += 1
        kept = rows.take(keep)
        leave = last.copy()
        leave |= np.bincount(kept.req[~kept.ended], minlength=len(self.slots)) == 0   # every beam ended
        finished = self._finished(kept, leave)
        self._regrow(rows, keep, leave)
        return finished

    @timed("kv_gather")
    def _regrow(self, rows: Rows, keep: np.ndarray, leave: np.ndarray) -> None:
        """The kept beams of the requests that stay, each repeated s times (one gather of rows,
        logits and caches); the requests in `leave` go."""
        s = self.cfg.candidates
        grow = np.repeat(keep[~leave[rows.req[keep]]], s)   # keep and repeat: one gather
        self.rows = rows.take(grow)
        if len(grow):
            self.pending, self.cache = self.be.gather(self.pending, self.cache, grow)
            self.scorer.select(grow)
        dup = self.rows.ended & (np.arange(len(grow)) % s > 0)
        self.rows.cum[dup] = -np.inf                        # an ended beam is one candidate, not s
        self._leave(leave)

    def certain(self, q: int) -> str:
        """Text of request q that no later chunk can change: the common prefix of its beams'
        tokens (with stop="sentence", up to its last sentence end: a result can be trimmed back
        to one), decoded without a trailing partial character."""
        rows = self.rows
        seqs = [rows.generated(i) for i in np.flatnonzero(rows.req == q)]
        n = min(map(len, seqs), default=0)
        if seqs and n:
            same = np.all(np.stack([s[:n] for s in seqs]) == seqs[0][:n], axis=0)
            n = int(np.argmin(same)) if not same.all() else n
        if self.cfg.stop == "sentence":
            ends = np.flatnonzero(self.sentence_end[seqs[0][:n]]) if n else []
            n = int(ends[-1]) + 1 if len(ends) else 0
        return self.be.decode_batch([seqs[0][:n]])[0][self.tail[q]:].rstrip("\ufffd") if n else ""

    # -- requests joining and leaving ---------------------------------------------------------
    @timed("prefill")
    def admit(self, requests: list[Request]) -> None:
        """`requests` join the batch (between chunks): contexts prefilled, `beams` rows each."""
        t0 = time.perf_counter()
        contexts = [r.context_ids for r in requests]
        pending, cache = self.be.prefill(contexts)                   # (Q, V)
        first = np.repeat(np.arange(len(requests)), self.cfg.beams)  # step 1: b beams per request
        pending, cache = self.be.gather(pending, cache, first)
        self.scorer.admit(contexts, first)
        rows = Rows.new(first + len(self.slots), 0 if self.rows is None else self.rows.tokens.shape[1], self.pad)
        if self.rows is None:
            self.rows, self.pending, self.cache = rows, pending, cache
        else:
            self.rows = Rows.concat([self.rows, rows])
            self.pending, self.cache = self.be.join(self.pending, self.cache, pending, cache)
        self.slots += [Slot(r, np.random.default_rng(r.seed), t0, self.candidate_tokens) for r in requests]
        self._index()

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

    def _finished(self, kept: Rows, leave: np.ndarray) -> list[Finished]:
        now, out = time.perf_counter(), []
        for q in np.flatnonzero(leave):
            r = kept.take(np.flatnonzero(kept.req == q))           # a copy: safe to shift
            c = int(r.col0[0])
            r.tokens, r.logp, r.req[:], r.col0[:] = r.tokens[:, c:], r.logp[:, c:], 0, 0
            s = self.slots[q]
            out.append(Finished(s.request, r, now - s.t0, self.candidate_tokens - s.cand0))
        return out

    def _leave(self, gone: np.ndarray) -> None:
        """Forget the requests in `gone` (their rows are already out): renumber the rest, drop
        token and cache columns no row needs any more, rebuild the per-request tables."""
        if not gone.any():
            return
        stay = np.flatnonzero(~gone)
        self.slots = [self.slots[q] for q in stay]
        if not self.slots:
            self.rows = self.pending = self.cache = None
            self.be.release()                              # a decoder may bind the cache's arrays
            self.scorer = self.scorer.fresh(self.cfg)      # its rows left too (an empty select is no gather)
            return
        renum = np.full(len(gone), -1, np.int64)
        renum[stay] = np.arange(len(stay))
        rows = self.rows
        rows.req = renum[rows.req]
        c = int(rows.col0.min())
        if c:
            rows.tokens, rows.logp, rows.col0 = rows.tokens[:, c:], rows.logp[:, c:], rows.col0 - c
        self.cache = self.be.trim(self.cache)
        self.scorer.trim()
        self._index()

    def _index(self) -> None:
        """Per-request arrays and tables of the requests in the batch, in slot order."""
        reqs = self.requests
        ctx_len = np.array([len(r.context_ids) for r in reqs])
        self.ctx = np.full((len(reqs), ctx_len.max()), self.pad, np.int64)   # left-padded contexts
        for q, r in enumerate(reqs):
            self.ctx[q, self.ctx.shape[1] - len(r.context_ids):] = r.context_ids
        self.ctx_start = (self.ctx.shape[1] - ctx_len).astype(np.int32)
        self.tail = np.array([len(r.heal.tail) if r.heal else 0 for r in reqs])   # healed text per request
        self.n_kw = np.array([len(r.keywords) for r in reqs])
        self.full = (np.left_shift(1, self.n_kw) - 1).astype(np.int64)   # every keyword's bit
        self.word_base = np.concatenate([[0], np.cumsum(self.n_kw)[:-1]]).astype(np.int64)
        self.table = BoostTable([b for r in reqs for b in r.boosts],
                                {int(base): r.merged for base, r in zip(self.word_base, reqs)})
        self._constraint_tables(reqs)

    # -- steps ------------------------------------------------------------------------------
    @timed("text")
    def _texts(self, rows: Rows) -> list[str]:
        return self._generated_texts(rows, range(len(rows.req)))

    def _generated_texts(self, rows: Rows, idx) -> list[str]:
        """The text each row in `idx` added to its context (decoded whole: no broken boundaries;
        a healed context's end, which the first token re-wrote, left out)."""
        cut = self.tail[rows.req[list(idx)]]
        return [t[c:] for t, c in zip(self.be.decode_batch([rows.generated(i) for i in idx]), cut)]

    # -- constraints: which keywords guide a row, which tokens are forced or banned -----------
    def _constraint_tables(self, requests: list[Request]) -> None:
        K = max(1, self.n_kw.max())
        forced = SequenceTable()
        self.force_idx = np.full((len(requests), K), -1, np.int64)   # keyword -> its forced sequence
        self.need = np.zeros((len(requests), K), np.int64)           # ... and that sequence's length
        self.phrases = []                                             # per request: (bit, head, seq index)
        for q, r in enumerate(requests):
            for i, seq in enumerate(r.force):
                self.force_idx[q, i], self.need[q, i] = forced.add(seq), len(seq)
            self.phrases.append([(1 << i, head, forced.add(whole)) for i, head, whole in r.phrases])
        self.seq_ptr, self.seq_tok = forced.arrays()
        if self.rows is not None and self.forced is not None:   # a request joined or
            on = self.rows.fseq >= 0            # left: rows being forced point into the new table
            n = len(forced.seqs)
            self.rows.fseq[on] = [forced.add(self.forced.seqs[i]) for i in self.rows.fseq[on]]
            assert len(forced.seqs) == n, "a row forces a sequence of no request in the batch"
        self.forced = forced
        # ban groups ban_group[q, 4 * heal + 2 * glue + eos]: request q's bans, plus EOS while a keyword is
        # missing (under guarantee: to the budget's end; with a sentence deadline: every sentence end
        # too, to the deadline without guarantee) or before `min_sentence` tokens (EOS and every
        # sentence end), plus tokens that would glue onto a keyword just completed ("hockey" +
        # "rink", "pet" + "rified"), so that it stays the word that was counted, plus (token healing,
        # the first token) every token that does not re-write the context's last one
        self.bans = None
        if (any(r.bans or r.heal for r in requests) or self.word_piece is not None or self.cfg.min_sentence
                or self.cfg.sentence_deadline):
            self.bans, self.ban_group = self._ban_table(requests)
        self.multi_bans = any(len(b) > 1 for r in requests for b in r.bans)

    def _ban_table(self, requests: list[Request]):
        """((group_ptr, seq_ptr, seq_tok) of the ban groups, group_of (Q, 8): the group of request q
        for 4 * heal + 2 * glue + eos), built with NumPy: it is rebuilt each time a request joins
        or leaves, and the glue and heal groups hold one sequence per token (tens of thousands),
        so Python lists here cost ~15 ms per request in the batch. A group the same as one built
        already (requests with the same bans and healing: a service's small requests) is kept
        once, so the table grows with the batch's distinct constraints, not its requests."""
        eos = np.array([e for e in self.eos if e >= 0], np.int32)
        if self.cfg.sentence_deadline or self.cfg.min_sentence:
            eos = np.union1d(eos, np.flatnonzero(self.sentence_end)).astype(np.int32)
        glue = np.zeros(0, np.int32) if self.word_piece is None else np.flatnonzero(self.word_piece).astype(np.int32)
        n_seqs, lens, toks, seen = [], [], [], {}
        group_of = np.zeros((len(requests), 8), np.int64)
        for q, r in enumerate(requests):
            own_len = np.array([len(b) for b in r.bans], np.int64)
            own_tok = np.array([t for b in r.bans for t in b], np.int32)
            heal = np.zeros(0, np.int32) if r.heal is None else r.heal.ban
            own, healed = tuple(map(tuple, r.bans)), heal.tobytes()
            for h, g, e in np.ndindex(2, 2, 2):               # 4h + 2g + e
                key = (own, healed if h else b"", g, e)
                if key not in seen:
                    seen[key] = len(n_seqs)
                    extra = np.concatenate([heal[:len(heal) * h], glue[:len(glue) * g], eos[:len(eos) * e]])
                    n_seqs.append(len(own_len) + len(extra))
                    lens += [own_len, np.ones(len(extra), np.int64)]
                    toks += [own_tok, extra]
                group_of[q, 4 * h + 2 * g + e] = seen[key]
        return (np.concatenate([[0], np.cumsum(n_seqs)]).astype(np.int64),
                np.concatenate([[0], np.cumsum(np.concatenate(lens))]).astype(np.int64),
                np.concatenate(toks).astype(np.int32)), group_of

    def _remaining(self, rows: Rows, seen: np.ndarray) -> np.ndarray:
        return self.full[rows.req] & ~(rows.found | seen)

    def _candidates(self, rem: np.ndarray, seen: np.ndarray) -> np.ndarray:
        """Keywords (bitmask) a row looks for now, of those remaining: `next`, the next one in
        order (none once one was seen in this chunk, as in the paper); `any`, all of them."""
        if self.cfg.order == "any":
            return rem
        return np.where(seen == 0, lowest_bit(rem), 0)

    def _guide_words(self, cand: np.ndarray, rows: Rows) -> np.ndarray:
        """Boost-table row of each row's guide keywords (merged for several), -1 when unguided."""
        if not self.cfg.guided:
            return np.full(len(cand), -1, np.int32)
        return self.table.rows_for(self.word_base[rows.req], cand)

    def _forced(self, rows: Rows, rem: np.ndarray, n_done: np.ndarray) -> np.ndarray:
        """Token each row must emit now, or -1: the rest of a sequence being forced; under
        `guarantee`, the first token of the next keyword to place once the tokens left are just
        what the remaining keywords need (K2T's deadline, made exact)."""
        force = np.full(len(rows.req), -1, np.int64)
        on = (rows.fseq >= 0) & ~rows.ended
        force[on] = self.seq_tok[self.seq_ptr[rows.fseq[on]] + rows.fpos[on]]
        if self.cfg.guarantee:
            need = np.zeros(len(rem), np.int64)
            for i in range(self.need.shape[1]):
                need += (rem >> i & 1) * self.need[rows.req, i]
            left = self.cfg.max_new_tokens - n_done
            due = left if not self.cfg.sentence_deadline else np.minimum(left, self.cfg.sentence_deadline - n_done)
            start = np.flatnonzero(~on & ~rows.ended & (rem != 0) & (left > 0) & (due <= need))
            if len(start):
                bit = popcount(lowest_bit(rem[start]) - 1)      # index of the lowest remaining keyword
                rows.fseq[start], rows.fpos[start] = self.force_idx[rows.req[start], bit], 0
                force[start] = self.seq_tok[self.seq_ptr[rows.fseq[start]]]
        return force

    def _advance_forcing(self, rows: Rows, force: np.ndarray, seen: np.ndarray, col: int) -> None:
        """After a step: move along forced sequences; a row whose tokens now end with the first
        word of a phrase it still needs has the phrase's rest forced from the next step on."""
        on = force >= 0
        rows.fpos[on] += 1
        done = on & (rows.fpos >= self.seq_ptr[rows.fseq + 1] - self.seq_ptr[rows.fseq])
        rows.fseq[done] = -1
        if not any(self.phrases):
            return
        rem = self._remaining(rows, seen)
        for i in np.flatnonzero((rows.fseq < 0) & ~rows.ended):
            toks = rows.tokens[i, rows.col0[i]:col]
            for bit, head, seq in self.phrases[rows.req[i]]:
                if rem[i] & bit and len(head) <= len(toks) and tuple(toks[len(toks) - len(head):]) == head:
                    if rows.glue[i] and self._pieces_at(np.array([seq]), np.array([len(head)]))[0]:
                        continue     # the head just completed another keyword ("blow" of "blower"): it stays
                    rows.fseq[i], rows.fpos[i] = seq, len(head)
                    break

    def _pieces_at(self, seq: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """Whether token `pos` of each forced sequence `seq` continues the word before it (a word
        piece); False past a sequence's end or without the word-piece table."""
        out = np.zeros(len(seq), bool)
        if self.word_piece is None:
            return out
        p = self.seq_ptr[seq] + pos
        go = p < self.seq_ptr[seq + 1]
        out[go] = self.word_piece[self.seq_tok[p[go]]]
        return out

    def _ban_groups(self, rows: Rows, rem: np.ndarray, healing: np.ndarray, n_done: np.ndarray):
        if self.bans is None:
            return None
        cfg = self.cfg                                                  # no end (of a sentence) yet:
        missing = (rem != 0) & (cfg.guarantee | (n_done < cfg.sentence_deadline))   # a keyword still to place
        end = missing | (n_done < cfg.min_sentence)
        return self.ban_group[rows.req, 4 * healing + 2 * rows.glue + (end & ~healing)]

    def _uniforms(self, rows: Rows) -> np.ndarray:
        counts = np.bincount(rows.req, minlength=len(self.slots))
        return np.concatenate([s.rng.random(n) for s, n in zip(self.slots, counts)])

    def _history(self, rows: Rows, col: int, healing: np.ndarray):
        """Each row's tokens so far (context + generated, left-padded) for the kernel's
        repetition rules and multi-token bans; empty for a row re-writing its context's end (the
        context's own tokens: no repetition of the model's)."""
        if not (self.cfg.shapes_logits or self.multi_bans):
            return None, None
        hist = np.concatenate([self.ctx[rows.req], rows.tokens[:, :col]], axis=1)
        if rows.col0.any():    # a row that joined at column c: its context moves right past c pads
            W, c, j = self.ctx.shape[1], rows.col0[:, None], np.arange(hist.shape[1])[None]
            hist = np.take_along_axis(hist, np.where(j < W + c, (j - c) % (W + c), j), axis=1)
        return hist, np.where(healing, hist.shape[1], self.ctx_start[rows.req] + rows.col0).astype(np.int32)

    def _sample_chunk(self, rows: Rows, prefix: list[str], k: int, last: bool):
        R = len(rows.req)
        seen = np.zeros(R, np.int64)         # keywords seen in this chunk so far (guidance moves on)
        base = rows.tokens.shape[1]
        boost_first = self._boost_first(rows, base + k)
        rows.tokens = np.concatenate([rows.tokens, np.full((R, k), self.pad, np.int64)], axis=1)  # (R, L+k)
        rows.logp = np.concatenate([rows.logp, np.zeros((R, k), np.float32)], axis=1)
        for j in range(k):
            d = self._draw(rows, seen, base + j, boost_first)
            live = self._append(rows, d, base + j)
            seen = self._mark_seen(rows, prefix, d, live, seen, base + j)
            if not (last and j == k - 1):
                self._next_logits(d.ids)
        return rows, rows.tokens[:, base:]

    @timed("kernel")
    def _draw(self, rows: Rows, seen: np.ndarray, col: int, boost_first) -> Draw:
        """The next token of every row: guidance, forcing, bans and repetition rules, then the kernel."""
        rem = self._remaining(rows, seen)
        cand = self._candidates(rem, seen)
        n_done = col - rows.col0                     # the row's tokens so far
        healing = (n_done == 0) & (self.tail[rows.req] > 0)   # the model alone re-writes the context's end
        word = np.where(healing, -1, self._guide_words(cand, rows)).astype(np.int32)
        force = self._forced(rows, rem, n_done)
        hist, hstart = self._history(rows, col, healing)
        ids, lp = self.be.sample(self.pending, self._uniforms(rows), word, self.table.csr, self.cfg, hist, hstart,
                                 boost_first, bans=self.bans, row_ban=self._ban_groups(rows, rem, healing, n_done),
                                 force=force)
        return Draw(ids, lp, rem, cand, word, force, n_done)

    def _append(self, rows: Rows, d: Draw, col: int) -> np.ndarray:
        """Write the draw into column `col` of the rows that draw a real token (returned: `live`);
        the others get padding (`d.ids` too)."""
        live = ~rows.ended & (d.n_done < self.cfg.max_new_tokens)
        d.ids = np.where(live, d.ids, self.pad)
        rows.tokens[:, col], rows.logp[:, col] = d.ids, d.logp
        self.candidate_tokens += int(live.sum())
        rows.n_tok += live
        rows.ended |= live & np.isin(d.ids, self.eos)
        return live

    def _mark_seen(self, rows: Rows, prefix: list[str], d: Draw, live: np.ndarray, seen: np.ndarray,
                   col: int) -> np.ndarray:
        """Keywords the new token completed (guidance moves on, forcing advances, a sentence end
        after the last keyword ends the row); returns the chunk's keywords seen so far."""
        check = (d.word >= 0) | (d.force >= 0)
        new = np.zeros(len(rows.req), np.int64)
        if check.any():
            new = self._seen_now(rows, prefix, np.flatnonzero(check & live), np.where(d.force >= 0, d.remaining,
                                                                                      d.candidates),
                                 self._unfinished(rows, d.force >= 0, 1))
        rows.glue = (new & ~seen) != 0
        seen = seen | new
        self._advance_forcing(rows, d.force, seen, col + 1)
        if self.cfg.stop == "sentence":   # all keywords in (before or in this chunk) + sentence end
            rows.ended |= live & (self._remaining(rows, seen) == 0) & self.sentence_end[d.ids]
        return seen

    @timed("model")
    def _next_logits(self, ids: np.ndarray) -> None:
        """One decode step of the model over the drawn tokens: the next logits, the cache grown."""
        self.pending, self.cache = self.be.step(ids, self.cache)
        self.t.kv(self.cache)

    def _unfinished(self, rows: Rows, forcing: np.ndarray, ahead: int) -> np.ndarray:
        """Rows whose forced sequence goes on with a word piece (`ahead` = 1: after the token being
        forced now; 0: next, once forcing has moved on): the word at their end is not finished yet
        (" sharpen" of a forced " sharpen"+"er" is not "sharpen")."""
        more = np.zeros(len(rows.req), bool)
        i = np.flatnonzero(forcing & (rows.fseq >= 0))
        more[i] = self._pieces_at(rows.fseq[i], rows.fpos[i] + ahead)
        return more

    @timed("text")
    def _seen_now(self, rows: Rows, prefix, idx, masks, unfinished=None) -> np.ndarray:
        """Bits of `masks` (per row) whose keyword appeared in the row's chunk so far (`unfinished`
        rows: not at their very end, as the next token continues the word)."""
        seen = np.zeros(len(rows.req), np.int64)
        final = self._final(rows)
        for i, text in zip(idx, self._chunk_texts(rows, prefix, idx)):
            kws = self.slots[rows.req[i]].request.keywords
            cut = unfinished is not None and unfinished[i]
            for b, k in bits(int(masks[i])):
                if self._count_new(prefix[i], text, kws[k], final[i], cut) > 0:
                    seen[i] |= b
        return seen

    @property
    def open_end(self) -> bool:
        """Whether a keyword that ends at the last token waits for the next one to count: it may
        still become part of a longer word ("pet" + "rified"). With the word-piece table (under
        `guarantee` or `boost_word_starts`, the default) the next token cannot glue onto a keyword
        just completed (a ban), so it counts at once and its candidate is credited in this chunk."""
        return self.word_piece is None

    def _final(self, rows: Rows) -> np.ndarray:
        """Rows whose text cannot go on: ended, or at max_new_tokens."""
        return rows.ended | (rows.n_tok >= self.cfg.max_new_tokens)

    def _chunk_texts(self, rows: Rows, prefix, idx) -> list[str]:
        """Text each row in `idx` added after its prefix."""
        return [f[len(prefix[i]):] for f, i in zip(self._generated_texts(rows, idx), idx)]

    def _score(self, rows: Rows, prefix: list[str], chunk: np.ndarray, last: bool) -> Rows:
        """Quality Q of every candidate's chunk, added to its parent's cumulative score."""
        lp = self._scorer_logprobs(rows, chunk, last)
        return self._quality(rows, prefix, lp, chunk.shape[1])

    @timed("scorer")
    def _scorer_logprobs(self, rows: Rows, chunk: np.ndarray, last: bool) -> np.ndarray:
        """The scorer's log-probs of every row's chunk (R, k), kept as the rows' own."""
        k = chunk.shape[1]
        lp = self.scorer.score(chunk, rows.logp[:, -k:], last)
        rows.logp[:, -k:] = lp
        return lp

    @timed("text")
    def _quality(self, rows: Rows, prefix: list[str], lp: np.ndarray, k: int) -> Rows:
        """Q of each candidate's chunk from its keyword credit and perplexity, added to `cum`."""
        before = rows.tokens.shape[1] - k - rows.col0       # the rows' tokens before this chunk (at most)
        n_new = np.clip(rows.n_tok - before, 0, k)
        idx = np.flatnonzero(n_new > 0)
        texts = self._chunk_texts(rows, prefix, idx)
        cfg = self.cfg
        alpha = self._alphas(rows)
        rem = self._remaining(rows, 0)
        final = self._final(rows)
        cut = self._unfinished(rows, ~rows.ended, 0)
        for i, text in zip(idx, texts):
            pp = math.exp(-float(lp[i, : n_new[i]].mean()))
            credit, new = self._credit(self.slots[rows.req[i]].request.keywords, int(rem[i]), prefix[i], text,
                                       final[i], cut[i])
            rows.cum[i] += (credit if new else math.exp(-cfg.c_star)) * math.exp(-alpha[i] * pp)
            rows.found[i] |= new
        return rows

    def _count_new(self, prefix: str, text: str, kw: Keyword, final: bool, unfinished: bool) -> int:
        """Occurrences of `kw` that `text` adds after `prefix`, by the config's rule; an `unfinished`
        row's last word is still being written (a forced word piece follows)."""
        return occurrence.count_new(prefix, text, kw, self.open_end or unfinished, final and not unfinished,
                                    self.cfg.match)

    def _credit(self, kws: list[Keyword], rem: int, prefix: str, text: str, final: bool = False,
                unfinished: bool = False) -> tuple[float, int]:
        """Q's keyword term for a chunk, sum of exp(-c) over the keywords it places (c: their
        occurrences in the chunk), and their bits. `next` places the next keyword in order (the
        paper; under `guarantee` also the ones after it, in order, which forcing can put in the
        same chunk); `any`, whichever of the remaining ones appear."""
        credit, new = 0.0, 0
        for b, k in bits(rem):
            c = self._count_new(prefix, text, kws[k], final, unfinished)
            if c > 0:
                credit += math.exp(-c)
                new |= b
            if self.cfg.order == "next" and (c == 0 or not self.cfg.guarantee):
                break
        return credit, new

    def _on_time(self, rows: Rows, col: int) -> np.ndarray:
        """Rows ahead of their deadline: once the tokens up to column `col` are generated, at
        least `reserve_per_keyword` tokens are left per keyword still to place."""
        end = min(self.cfg.sentence_deadline or self.cfg.max_new_tokens, self.cfg.max_new_tokens)
        left = end - np.minimum(col - rows.col0, end)
        return left >= popcount(self._remaining(rows, 0)) * self.cfg.reserve_per_keyword

    def _alphas(self, rows: Rows) -> np.ndarray:
        """Weight of perplexity in each row's Q: `alpha_fluent` while the row is ahead of its
        deadline (this chunk included), else the paper's alpha."""
        cfg = self.cfg
        if cfg.alpha_fluent is None:
            return np.full(len(rows.req), cfg.alpha)
        return np.where(self._on_time(rows, rows.tokens.shape[1]), cfg.alpha_fluent, cfg.alpha)

    def _boost_first(self, rows: Rows, col: int):
        """Per-row boost order: the configured one, and boost-then-filter for rows behind their
        deadline when `late_boost_first` (their word may lie outside the nucleus)."""
        first = self.cfg.boost_order == "boost_then_filter"
        if not self.cfg.late_boost_first or first:
            return first
        return ~self._on_time(rows, col)

    def _finish_requests(self, rows: Rows) -> Rows:
        """stop="sentence": a request with a finished beam (every keyword, then a sentence end or
        EOS) is done; its unfinished beams are dropped, so only finished ones can be chosen."""
        finished = rows.ended & (self._remaining(rows, 0) == 0)
        done = np.zeros(len(self.slots), bool)
        done[rows.req[finished]] = True
        drop = done[rows.req] & ~finished
        rows.cum[drop] = -np.inf
        rows.ended |= done[rows.req]
        return rows

    def _select_best(self, rows: Rows) -> np.ndarray:
        """Best `beams` rows of every request by cumulative score (stable on ties). Identical
        candidates may both be kept: a beam kept twice gets twice the candidates next chunk, which
        measured better than dropping the copy (docs/design/decisions.md); the result's beams are
        made distinct instead (`result.build_result`)."""
        order = np.lexsort((np.arange(len(rows.req)), -rows.cum, rows.req))
        req_sorted = rows.req[order]
        starts = np.searchsorted(req_sorted, req_sorted, side="left")
        rank = np.arange(len(order)) - starts
        return np.sort(order[rank < self.cfg.beams])
