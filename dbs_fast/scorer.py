"""Perplexity scorers: `self` (the generator's own unguided log-probs, free) or a separate ONNX LM.

The ONNX scorer keeps its own KV cache per row, is gathered with the generator's rows, and
runs only the k new tokens of every chunk (one multi-token forward per chunk).
"""
from __future__ import annotations

import numpy as np

from .errors import DBSError
from .session import OnnxModel


class SelfScorer:
    name = "self"

    def fresh(self):
        return self

    def admit(self, contexts, rows):
        pass

    def select(self, rows):
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
    """A second causal LM (e.g. Distil-GPT-2 for GPT-2 large) that shares the tokenizer."""

    name = "onnx"

    def __init__(self, model: OnnxModel, generator_tokenizer):
        if model.tokenizer.get_vocab() != generator_tokenizer.get_vocab():
            raise DBSError(f"scorer {model.dir} has a different vocabulary from the generator's: the "
                           f"scorer must share the generator's tokenizer (re-tokenising is not supported)")
        self.model = model
        self.pad = model.eos_ids[0] if model.eos_ids else 0
        self.cache = None
        self.pending = None           # (R, V) logits predicting each row's next token

    def fresh(self) -> "OnnxScorer":
        """A scorer on the same model with no rows (one per batch: the rows are its state)."""
        return OnnxScorer(self.model, self.model.tokenizer)

    def admit(self, contexts, rows):
        """New contexts join: prefilled, gathered to `rows` and appended to the running rows."""
        from .backend import left_pad
        from .session import KVCache

        ids, mask = left_pad(contexts, self.pad)
        logits, cache = self.model.forward(ids, self.model.empty_cache(len(contexts)), mask)
        cache, pending = cache.select(rows), np.take(logits[:, -1], rows, axis=0)
        if self.cache is None or self.cache.batch == 0:
            self.cache, self.pending = cache, pending
        else:
            self.cache, self.pending = KVCache.merge(self.cache, cache), np.concatenate([self.pending, pending])

    def trim(self):
        self.cache = self.cache.trim()

    def select(self, rows):
        self.cache = self.cache.select(rows, in_place=True)
        self.pending = np.take(self.pending, rows, axis=0)

    def score(self, chunk, gen_logp, last):
        R, k = chunk.shape
        lp = np.empty((R, k), np.float32)
        lp[:, 0] = token_logprobs(self.pending, chunk[:, 0])
        logits, self.cache = self.model.forward(chunk, self.cache)           # (R, k, V)
        if k > 1:
            lp[:, 1:] = token_logprobs(logits[:, :-1], chunk[:, 1:])
        self.pending = logits[:, -1]
        return lp
