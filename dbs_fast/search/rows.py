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

    def take(self, idx: np.ndarray) -> "Rows":
        return Rows(*(getattr(self, f.name)[idx] for f in fields(self)))

    @staticmethod
    def new(req: np.ndarray, width: int, pad: int, **given) -> "Rows":
        """Fresh rows for requests `req` joining a batch whose token columns are `width` wide
        (`given`: fields set otherwise, by name)."""
        n = len(req)
        fresh = dict(req=np.asarray(req), found=np.zeros(n, np.int64), cum=np.zeros(n), ended=np.zeros(n, bool),
                     tokens=np.full((n, width), pad, np.int64), logp=np.zeros((n, width), np.float32),
                     n_tok=np.zeros(n, np.int64), fseq=np.full(n, -1, np.int64), fpos=np.zeros(n, np.int64),
                     glue=np.zeros(n, bool), col0=np.full(n, width, np.int64))
        return Rows(**{**fresh, **given})

    @staticmethod
    def concat(parts: list["Rows"]) -> "Rows":
        return Rows(*(np.concatenate([getattr(p, f.name) for p in parts]) for f in fields(Rows)))

    @staticmethod
    def stack(parts: list["Rows"], pad: int) -> "Rows":
        """Rows whose tokens all start at column 0, of any width, as one (padded on the right)."""
        width = max(p.tokens.shape[1] for p in parts)

        def widen(a, fill):
            return np.pad(a, ((0, 0), (0, width - a.shape[1])), constant_values=fill)

        return Rows.concat([Rows(**{**{f.name: getattr(p, f.name) for f in fields(Rows)},
                                    "tokens": widen(p.tokens, pad), "logp": widen(p.logp, 0)}) for p in parts])

    def drop_columns(self, c: int) -> None:
        """Forget the token columns before `c` (no row's tokens start before it)."""
        self.tokens, self.logp, self.col0 = self.tokens[:, c:], self.logp[:, c:], self.col0 - c

    def final(self, budget: int) -> np.ndarray:
        """Rows whose text cannot go on: ended, or at the `budget` of new tokens (the others draw
        another token, whose next logits are read)."""
        return self.ended | (self.n_tok >= budget)

    def generated(self, i: int) -> np.ndarray:
        """Row i's generated tokens (up to and including EOS)."""
        return self.tokens[i, self.col0[i]: self.col0[i] + self.n_tok[i]]
