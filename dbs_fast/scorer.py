"""Perplexity scorers: `self` (the generator's own unguided log-probs, free) or a separate ONNX LM.

The ONNX scorer keeps its own KV cache in the generator's layout (the prefix cache's prefixes where its
export has the decode graph, else one row per candidate), is gathered with the generator's rows,
and runs only the k new tokens of every chunk.
"""
from __future__ import annotations

from typing import Protocol

import numpy as np

from .backend import onnx_backend
from .errors import DBSError
from .model import OnnxModel


class Scorer(Protocol):
    """What the scheduler asks of a perplexity scorer. Its rows follow the generator's: admitted
    with their contexts, gathered by `select` at every chunk boundary, trimmed with them."""

    name: str

    def fresh(self, cfg) -> "Scorer":
        """A scorer on the same model with no rows (one per batch: the rows are its state)."""

    def admit(self, contexts: list[list[int]], idx: np.ndarray) -> None:
        """New contexts join, gathered to `idx` and appended to the running rows."""

    def select(self, idx: np.ndarray) -> None: ...

    def trim(self) -> None: ...

    def score(self, chunk: np.ndarray, gen_logp: np.ndarray, last) -> np.ndarray:
        """Log-probs (R, k) of each row's chunk tokens (R, k); `gen_logp`: the generator's own."""


class SelfScorer:
    """The generator's own unguided log-probs (free: the kernel returns them)."""

    name = "self"

    def fresh(self, cfg):
        return self

    def admit(self, contexts, idx):
        pass

    def select(self, idx):
        pass

    def trim(self):
        pass

    def score(self, chunk, gen_logp, last):
        return gen_logp


def token_logprobs(logits: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """log softmax(logits)[ids] over the last axis; logits (..., V), ids (...)."""
    m = logits.max(-1, keepdims=True)
    lse = np.log(np.exp(logits - m).sum(-1, dtype=np.float64)) + m[..., 0]
    return (np.take_along_axis(logits, ids[..., None], -1)[..., 0] - lse).astype(np.float32)


class OnnxScorer:
    """A second causal LM (e.g. Distil-GPT-2 for GPT-2 large) that shares the tokenizer.

    Its cache is laid out as the generator's: with a decode graph (`decoder`) each
    beam's prefix is stored once and a chunk is scored by k decode steps; without one, one cache
    row per candidate and one k-token forward per chunk."""

    name = "onnx"

    def __init__(self, model: OnnxModel, generator_tokenizer, decoder=None):
        if model.tokenizer.get_vocab() != generator_tokenizer.get_vocab():
            raise DBSError(f"scorer {model.dir} has a different vocabulary from the generator's: the "
                           f"scorer must share the generator's tokenizer (re-tokenising is not supported)")
        self.model, self.decoder = model, decoder
        self.be = None
        self.cache = None
        self.pending = None           # (R, V) logits predicting each row's next token

    def fresh(self, cfg) -> "OnnxScorer":
        """A scorer on the same model with no rows (one per batch: the rows are its state)."""
        new = OnnxScorer(self.model, self.model.tokenizer, self.decoder)
        new.be = onnx_backend(self.model, self.decoder, cfg)
        return new

    def admit(self, contexts, idx):
        """New contexts join: prefilled, gathered to `idx` and appended to the running rows."""
        logits, cache = self.be.prefill(contexts)
        cache, pending = self.be.select(cache, idx), self.be.take(logits, idx)
        if self.cache is None:
            self.cache, self.pending = cache, pending
        else:
            self.cache, self.pending = self.be.merge(self.cache, cache), self.be.concat(self.pending, pending)

    def trim(self):
        self.cache = self.be.trim(self.cache)

    def select(self, idx):
        self.cache = self.be.select(self.cache, idx)
        self.pending = self.be.take(self.pending, idx)

    def score(self, chunk, gen_logp, last):
        logits, self.cache = self.be.feed(chunk, self.cache)                 # (R, k, V)
        lp = np.empty(chunk.shape, np.float32)
        lp[:, 0] = token_logprobs(self.pending, chunk[:, 0])
        lp[:, 1:] = token_logprobs(logits[:, :-1], chunk[:, 1:])
        self.pending = logits[:, -1].copy()
        return lp
