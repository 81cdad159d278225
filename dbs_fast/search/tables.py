"""The per-batch tables of the search: what the requests in a running batch need per step
(their left-padded contexts, keyword bits, boosts, forced sequences, ban groups), built once
each time a request joins or leaves (`BatchTables.build`), read-only between.

Shapes: Q requests in the batch, K the most keywords of one request, V the vocabulary."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..config import OWN_SAMPLING, PENALTIES, DBSConfig, bias_table
from ..text.constraints import BoostTable, SequenceTable


@dataclass(frozen=True)
class BatchTables:
    ctx: np.ndarray              # (Q, W) int64 contexts, left-padded to the longest
    ctx_start: np.ndarray        # (Q,) int32 column of each context's first token in `ctx`
    tail: np.ndarray             # (Q,) characters of the context's end the first token re-writes (healing)
    heals: np.ndarray            # (Q,) bool: the first token is constrained (healing, or an empty context's start)
    n_kw: np.ndarray             # (Q,) keywords per request
    full: np.ndarray             # (Q,) int64 every keyword's bit
    word_base: np.ndarray        # (Q,) int64 the request's first row in the boost table
    ahead_at: np.ndarray         # (Q,) int64 its rows at `lam_ahead` after the first (0: it has none)
    boosts: BoostTable           # every request's keyword boosts, one table
    forced: SequenceTable        # the token sequences forcing can emit (keywords, phrases' rests)
    force_idx: np.ndarray        # (Q, K) int64 keyword -> its forced sequence in `forced`, -1 none
    need: np.ndarray             # (Q, K) int64 ... and that sequence's length
    phrases: list                # per request: [(keyword bit, first word's tokens, whole phrase's sequence)]
    openings: list               # per request: its openings' sequences in `forced`
    seq_ptr: np.ndarray          # `forced` as CSR: sequence i is seq_tok[seq_ptr[i]:seq_ptr[i + 1]]
    seq_tok: np.ndarray
    bans: tuple | None           # (group_ptr, seq_ptr, seq_tok) of the ban groups, None: no bans at all
    ban_group: np.ndarray | None  # (Q, 8) group of request q for 4 * healing + 2 * glue + end-banned
    multi_bans: bool             # a ban of several tokens (the kernel then reads each row's history)
    min_p: np.ndarray            # (Q,) float64 each request's min_p
    budget: np.ndarray           # (Q,) int64 each request's budget of new tokens
    sampling: dict               # `OWN_SAMPLING` name -> (Q,) float64 each request's (temperature 0: greedy)
    shaped: bool                 # some request's logits are shaped (penalties, n-gram bans, word loops)
    biases: tuple                # the requests' distinct logit-bias sets (`config.bias_table`)
    bias_of: np.ndarray          # (Q,) int64 each request's set in `biases`, -1: none

    @staticmethod
    def build(requests: list, cfg: DBSConfig, pad: int, eos: np.ndarray, sentence_end: np.ndarray | None,
              word_piece: np.ndarray | None) -> "BatchTables":
        ctx_len = np.array([len(r.context_ids) for r in requests])
        ctx = np.full((len(requests), ctx_len.max()), pad, np.int64)
        for q, r in enumerate(requests):
            ctx[q, ctx.shape[1] - len(r.context_ids):] = r.context_ids
        n_kw = np.array([len(r.keywords) for r in requests])
        n_rows = np.array([len(r.boosts) for r in requests])
        word_base = np.concatenate([[0], np.cumsum(n_rows)[:-1]]).astype(np.int64)
        ahead_at = np.where(n_rows > n_kw, n_kw, 0).astype(np.int64)
        K = max(1, n_kw.max())
        forced = SequenceTable()
        force_idx = np.full((len(requests), K), -1, np.int64)
        need = np.zeros((len(requests), K), np.int64)
        phrases = []
        for q, r in enumerate(requests):
            for i, seq in enumerate(r.force):
                force_idx[q, i], need[q, i] = forced.add(seq), len(seq)
            phrases.append([(1 << i, head, forced.add(whole)) for i, head, whole in r.phrases])
        openings = [[forced.add(seq) for seq in r.openings] for r in requests]
        seq_ptr, seq_tok = forced.arrays()
        # ban groups: request q's bans, plus EOS while a keyword is missing (under guarantee: to the
        # budget's end; with a sentence deadline: every sentence end too, to the deadline without
        # guarantee) or before `min_sentence` tokens (EOS and every sentence end), plus tokens that
        # would glue onto a keyword just completed ("hockey" + "rink", "pet" + "rified"), so that it
        # stays the word that was counted, plus (token healing, the first token) every token that
        # does not re-write the context's last one
        own_bias = [cfg.logit_bias if r.logit_bias is None else r.logit_bias for r in requests]
        sets = list(dict.fromkeys(b for b in own_bias if b))       # the distinct logit-bias sets, each once
        sampling = {n: np.array([r.sampled(n, cfg) for r in requests], np.float64) for n in OWN_SAMPLING}
        bans = ban_group = None
        if any(r.bans or r.heal for r in requests) or word_piece is not None or cfg.min_sentence \
                or cfg.sentence_deadline:
            bans, ban_group = ban_table(requests, cfg, eos, sentence_end, word_piece)
        return BatchTables(
            ctx=ctx, ctx_start=(ctx.shape[1] - ctx_len).astype(np.int32),
            tail=np.array([len(r.heal.tail) if r.heal else 0 for r in requests]),
            heals=np.array([r.heal is not None for r in requests], bool),
            n_kw=n_kw, full=(np.left_shift(1, n_kw) - 1).astype(np.int64), word_base=word_base, ahead_at=ahead_at,
            boosts=BoostTable([b for r in requests for b in r.boosts],
                              {int(base + at): r.merged.setdefault(int(at), {}) for base, r, a in
                               zip(word_base, requests, ahead_at) for at in {0, a}}),
            forced=forced, force_idx=force_idx, need=need, phrases=phrases, openings=openings, seq_ptr=seq_ptr, seq_tok=seq_tok,
            bans=bans, ban_group=ban_group, multi_bans=any(len(b) > 1 for r in requests for b in r.bans),
            min_p=np.array([cfg.min_p if r.min_p is None else r.min_p for r in requests], np.float64),
            budget=np.array([r.budget(cfg) for r in requests], np.int64),
            sampling=sampling, shaped=bool(cfg.shapes_with(*(sampling[n] for n in PENALTIES)).any()),
            biases=bias_table(sets), bias_of=np.array([sets.index(b) if b else -1 for b in own_bias], np.int64))

    def remap_forcing(self, fseq: np.ndarray, before: "BatchTables") -> None:
        """Rows being forced point into `before`'s sequences: point them into these (in place)."""
        on = fseq >= 0
        n = len(self.forced.seqs)
        fseq[on] = [self.forced.add(before.forced.seqs[i]) for i in fseq[on]]
        assert len(self.forced.seqs) == n, "a row forces a sequence of no request in the batch"

    def pieces_at(self, seq: np.ndarray, pos: np.ndarray, word_piece: np.ndarray | None) -> np.ndarray:
        """Whether token `pos` of each forced sequence `seq` continues the word before it (a word
        piece); False past a sequence's end or without the word-piece table."""
        out = np.zeros(len(seq), bool)
        if word_piece is None:
            return out
        p = self.seq_ptr[seq] + pos
        go = p < self.seq_ptr[seq + 1]
        out[go] = word_piece[self.seq_tok[p[go]]]
        return out


def ban_table(requests: list, cfg: DBSConfig, eos: np.ndarray, sentence_end: np.ndarray | None,
              word_piece: np.ndarray | None):
    """((group_ptr, seq_ptr, seq_tok) of the ban groups, group_of (Q, 8): the group of request q
    for 4 * heal + 2 * glue + eos), built with NumPy: it is rebuilt each time a request joins
    or leaves, and the glue and heal groups hold one sequence per token (tens of thousands),
    so Python lists here cost ~15 ms per request in the batch. A group the same as one built
    already (requests with the same bans and healing: a service's small requests) is kept
    once, so the table grows with the batch's distinct constraints, not its requests."""
    eos = np.array([e for e in eos if e >= 0], np.int32)
    if cfg.sentence_deadline or cfg.min_sentence:
        eos = np.union1d(eos, np.flatnonzero(sentence_end)).astype(np.int32)
    glue = np.zeros(0, np.int32) if word_piece is None else np.flatnonzero(word_piece).astype(np.int32)
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
