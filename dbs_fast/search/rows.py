"""The search's per-candidate state: every field an array with the row count as its leading
dimension, gathered together when beams are kept and repeated (`take`)."""
from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np


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
    alt_ids: np.ndarray       # (R, L, 1 + K) with `logprobs` K, at each column the drawn token, then the K
    #                           likeliest there (else (R, L, 0))
    alt_logp: np.ndarray      # (R, L, 1 + K) float32 their log-probabilities, the model's own (`logp` holds a
    #                           second-LM scorer's where there is one)

    def take(self, idx: np.ndarray) -> "Rows":
        return Rows(*(getattr(self, f.name)[idx] for f in fields(self)))

    @staticmethod
    def new(req: np.ndarray, width: int, pad: int, alternatives: int = 0, **given) -> "Rows":
        """Fresh rows for requests `req` joining a batch whose token columns are `width` wide, with
        `alternatives` tokens kept per column (`alt_ids`; `given`: fields set otherwise, by name)."""
        n = len(req)
        fresh = dict(req=np.asarray(req), found=np.zeros(n, np.int64), cum=np.zeros(n), ended=np.zeros(n, bool),
                     tokens=np.full((n, width), pad, np.int64), logp=np.zeros((n, width), np.float32),
                     n_tok=np.zeros(n, np.int64), fseq=np.full(n, -1, np.int64), fpos=np.zeros(n, np.int64),
                     glue=np.zeros(n, bool), col0=np.full(n, width, np.int64),
                     alt_ids=np.zeros((n, width, alternatives), np.int64),
                     alt_logp=np.zeros((n, width, alternatives), np.float32))
        return Rows(**{**fresh, **given})

    @staticmethod
    def concat(parts: list["Rows"]) -> "Rows":
        return Rows(*(np.concatenate([getattr(p, f.name) for p in parts]) for f in fields(Rows)))

    @staticmethod
    def stack(parts: list["Rows"], pad: int) -> "Rows":
        """Rows whose tokens all start at column 0, of any width, as one (padded on the right)."""
        width = max(p.tokens.shape[1] for p in parts)

        def widen(a, fill):
            return np.pad(a, ((0, 0), (0, width - a.shape[1])) + ((0, 0),) * (a.ndim - 2), constant_values=fill)

        columns = column_fields(pad)
        return Rows.concat([Rows(**{**{f.name: getattr(p, f.name) for f in fields(Rows)},
                                    **{name: widen(getattr(p, name), fill) for name, fill in columns.items()}})
                            for p in parts])

    def add_columns(self, k: int, pad: int) -> None:
        """k more token columns on the right (padding, log-probs 0)."""
        for name, fill in column_fields(pad).items():
            a = getattr(self, name)
            setattr(self, name, np.concatenate([a, np.full((len(a), k) + a.shape[2:], fill, a.dtype)], axis=1))

    def drop_columns(self, c: int) -> None:
        """Forget the token columns before `c` (no row's tokens start before it)."""
        for name in column_fields(0):
            setattr(self, name, getattr(self, name)[:, c:])
        self.col0 = self.col0 - c

    def final(self, budget: int) -> np.ndarray:
        """Rows whose text cannot go on: ended, or at the `budget` of new tokens (the others draw
        another token, whose next logits are read)."""
        return self.ended | (self.n_tok >= budget)

    def generated(self, i: int) -> np.ndarray:
        """Row i's generated tokens (up to and including EOS)."""
        return self.tokens[i, self.col0[i]: self.col0[i] + self.n_tok[i]]


def column_fields(pad: int) -> dict:
    """The fields laid out by token column (R, L, ...), with what a new column holds."""
    return {"tokens": pad, "logp": 0, "alt_ids": 0, "alt_logp": 0}
