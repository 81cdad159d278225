"""What steers each candidate row at a step (SPEC, step 4), as functions of the rows' arrays and
the batch's tables (`tables.BatchTables`): which keywords it still needs and is guided to, which
token it must emit (forcing), which token groups are banned, and the history the kernel's
repetition rules read.

Row arrays are (R,); `rows` is the search's `Rows`, whose forcing state (`fseq`, `fpos`)
`forced` and `advance_forcing` move on in place."""
from __future__ import annotations

import numpy as np

from ..config import DBSConfig
from .quality import lowest_bit, popcount
from .rows import Rows
from .tables import BatchTables


def remaining(tb: BatchTables, rows: Rows, seen) -> np.ndarray:
    """Bits of the keywords each row has still to place (`seen`: placed in this chunk so far)."""
    return tb.full[rows.req] & ~(rows.found | seen)


def candidates(cfg: DBSConfig, rem: np.ndarray, seen: np.ndarray) -> np.ndarray:
    """Keywords (bitmask) a row looks for now, of those remaining: `next`, the next one in
    order (none once one was seen in this chunk, as in the paper); `any`, all of them."""
    if cfg.order == "any":
        return rem
    return np.where(seen == 0, lowest_bit(rem), 0)


def guide_words(cfg: DBSConfig, tb: BatchTables, rows: Rows, cand: np.ndarray, ahead: np.ndarray) -> np.ndarray:
    """Boost-table row of each row's guide keywords (merged for several), -1 when unguided; a row
    `ahead` of its deadline reads its request's rows at `lam_ahead` where it has them."""
    if not cfg.guided:
        return np.full(len(cand), -1, np.int32)
    return tb.boosts.rows_for(tb.word_base[rows.req] + ahead * tb.ahead_at[rows.req], cand)


def forced(cfg: DBSConfig, tb: BatchTables, rows: Rows, rem: np.ndarray, n_done: np.ndarray) -> np.ndarray:
    """Token each row must emit now, or -1: the rest of a sequence being forced; under
    `guarantee`, the first token of the next keyword to place once the tokens left are just
    what the remaining keywords need (K2T's deadline, made exact); those rows start forcing."""
    force = np.full(len(rows.req), -1, np.int64)
    on = (rows.fseq >= 0) & ~rows.ended
    force[on] = tb.seq_tok[tb.seq_ptr[rows.fseq[on]] + rows.fpos[on]]
    if cfg.guarantee:
        need = np.zeros(len(rem), np.int64)
        for i in range(tb.need.shape[1]):
            need += (rem >> i & 1) * tb.need[rows.req, i]
        left = tb.budget[rows.req] - n_done
        due = cfg.deadline_within(tb.budget[rows.req]) - n_done
        start = np.flatnonzero(~on & ~rows.ended & (rem != 0) & (left > 0) & (due <= need))
        if len(start):
            bit = popcount(lowest_bit(rem[start]) - 1)      # index of the lowest remaining keyword
            rows.fseq[start], rows.fpos[start] = tb.force_idx[rows.req[start], bit], 0
            force[start] = tb.seq_tok[tb.seq_ptr[rows.fseq[start]]]
    return force


def advance_forcing(tb: BatchTables, rows: Rows, force: np.ndarray, seen: np.ndarray, col: int,
                    word_piece: np.ndarray | None) -> None:
    """After a step: move along forced sequences; a row whose tokens now end with the first
    word of a phrase it still needs has the phrase's rest forced from the next step on."""
    on = force >= 0
    rows.fpos[on] += 1
    done = on & (rows.fpos >= tb.seq_ptr[rows.fseq + 1] - tb.seq_ptr[rows.fseq])
    rows.fseq[done] = -1
    if not any(tb.phrases):
        return
    rem = remaining(tb, rows, seen)
    for i in np.flatnonzero((rows.fseq < 0) & ~rows.ended):
        toks = rows.tokens[i, rows.col0[i]:col]
        for bit, head, seq in tb.phrases[rows.req[i]]:
            if rem[i] & bit and len(head) <= len(toks) and tuple(toks[len(toks) - len(head):]) == head:
                if rows.glue[i] and tb.pieces_at(np.array([seq]), np.array([len(head)]), word_piece)[0]:
                    continue     # the head just completed another keyword ("blow" of "blower"): it stays
                rows.fseq[i], rows.fpos[i] = seq, len(head)
                break


def unfinished(tb: BatchTables, rows: Rows, forcing: np.ndarray, ahead: int,
               word_piece: np.ndarray | None) -> np.ndarray:
    """Rows whose forced sequence goes on with a word piece (`ahead` = 1: after the token being
    forced now; 0: next, once forcing has moved on): the word at their end is not finished yet
    (" sharpen" of a forced " sharpen"+"er" is not "sharpen")."""
    more = np.zeros(len(rows.req), bool)
    i = np.flatnonzero(forcing & (rows.fseq >= 0))
    more[i] = tb.pieces_at(rows.fseq[i], rows.fpos[i] + ahead, word_piece)
    return more


def ban_groups(cfg: DBSConfig, tb: BatchTables, rows: Rows, rem: np.ndarray, healing: np.ndarray,
               n_done: np.ndarray) -> np.ndarray | None:
    """Each row's ban group (`tb.ban_group`): its request's bans, with healing's on its first
    token, glue's right after a keyword, and EOS and sentence ends while it may not end yet."""
    if tb.bans is None:
        return None
    missing = (rem != 0) & (cfg.guarantee | (n_done < cfg.sentence_deadline))   # a keyword still to place
    end = missing | (n_done < cfg.min_sentence)                                 # no end (of a sentence) yet
    return tb.ban_group[rows.req, 4 * healing + 2 * rows.glue + (end & ~healing)]


def history(cfg: DBSConfig, tb: BatchTables, rows: Rows, col: int, healing: np.ndarray):
    """Each row's tokens so far (context + generated, left-padded) for the kernel's repetition
    rules and multi-token bans, where each row's own tokens start and where its generated ones
    do; none for a row re-writing its context's end (the context's own tokens: no repetition of
    the model's)."""
    if not (tb.shaped or tb.multi_bans):
        return None, None, None
    hist = np.concatenate([tb.ctx[rows.req], rows.tokens[:, :col]], axis=1)
    W = tb.ctx.shape[1]
    if rows.col0.any():    # a row that joined at column c: its context moves right past c pads
        c, j = rows.col0[:, None], np.arange(hist.shape[1])[None]
        hist = np.take_along_axis(hist, np.where(j < W + c, (j - c) % (W + c), j), axis=1)
    end = hist.shape[1]
    return (hist, np.where(healing, end, tb.ctx_start[rows.req] + rows.col0).astype(np.int32),
            np.where(healing, end, W + rows.col0).astype(np.int32))
