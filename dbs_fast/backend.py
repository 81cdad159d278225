"""Backends: a model with a KV cache plus a sampler, behind one contract (`Backend`).

Three implement it: `OnnxBackend` (one cache row per candidate: model.onnx), `PrefixBackend`
(each request's context once, each beam's prefix once, each candidate's chunk on its own:
decode.onnx) and the PyTorch baseline (`dbs_fast.torch_backend.TorchBackend`), which runs fixed
batches only.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from . import kernels
from .kernels import StepRules
from .kv.decoder import lone_row_rounds_apart
from .kv.groups import distinct_rows
from .kv.prefix_cache import PrefixCache
from .model import KVCache, OnnxModel
from .text.occurrence import WordTable


def left_pad(seqs: list[list[int]], pad: int) -> tuple[np.ndarray, np.ndarray]:
    T = max(len(s) for s in seqs)
    ids = np.full((len(seqs), T), pad, np.int64)                          # (B, T)
    mask = np.zeros((len(seqs), T), np.int64)
    for i, s in enumerate(seqs):
        ids[i, T - len(s):] = s
        mask[i, T - len(s):] = 1
    return ids, mask


class Backend(Protocol):
    """What the scheduler (`dbs_fast.search.beam`) and the scorer ask of a model. A cache is whatever the
    backend returns: the scheduler only passes it back. A step here is one token per row."""

    name: str
    tokenizer: Any                 # a `tokenizers.Tokenizer`
    vocab_size: int
    eos_ids: tuple
    pad_id: int
    max_positions: int | None

    def prefill(self, contexts: list[list[int]], reserve: int = 0) -> tuple[Any, Any]:
        """Left-padded contexts -> the last position's logits (B, V) and the cache; `reserve`: the
        new tokens the cache should make room for (a hint: a cache grows as it must)."""

    @property
    def graph_seconds(self) -> float:
        """Seconds spent so far inside the model's runtime call (ONNX Runtime's run, PyTorch's
        forward); the rest of a step's model stage is the host's work around it."""

    def step(self, tokens: np.ndarray, cache, need: np.ndarray | None = None) -> tuple[Any, Any]:
        """One new token per row (R,) -> logits (R, V) and the cache. `need` (R,) bool: the rows
        whose logits will be read (default all); a backend may leave the others' rows out, and
        then says in `computed` which rows it ran (one per model row)."""

    def feed(self, tokens: np.ndarray, cache) -> tuple[Any, Any]:
        """Known tokens (R, k) -> the logits after each (R, k, V) and the cache."""

    def select(self, cache, idx: np.ndarray):
        """The cache's rows `idx` (keep and repeat in one gather)."""

    def take(self, x, idx: np.ndarray):
        """Rows `idx` of a logits array."""

    def concat(self, a, b):
        """Logits of running rows then of joining ones (DBSError where a batch cannot grow)."""

    def merge(self, a, b):
        """Caches of running rows then of joining ones, between chunks."""

    def trim(self, cache):
        """The cache without the leading columns that are padding in every row."""

    def gather(self, logits, cache, idx: np.ndarray) -> tuple[Any, Any]:
        """The model's state at rows `idx`: the next-token logits and the cache, in one call."""

    def join(self, logits, cache, new_logits, new_cache) -> tuple[Any, Any]:
        """The state of running rows, then of joining ones (between chunks)."""

    def release(self) -> None:
        """The batch is empty: let go of what binds its cache."""

    def sample(self, logits, uniforms, rules: StepRules) -> tuple[np.ndarray, np.ndarray]:
        """One token per row under the step's rules (`kernels.StepRules`), drawn from the given
        uniforms: ids (R,) and their unguided log-probs."""

    def encode(self, text: str) -> list[int]: ...

    def decode_batch(self, seqs) -> list[str]: ...

    def decode_one(self, i: int) -> str: ...


@dataclass(frozen=True)
class RowLogits:
    """Next-token logits of R rows as rows of a table: row r's are table[rows[r]]. A decode step
    gives its rows so (with distinct rows, one table row per distinct history), read in place by
    the sampler (`kernels.sample(..., rows=)`), rather than copied out to one row each (70 rows of
    a 49,152-token vocabulary are 13.8 MB a step); keeping and repeating rows indexes, and copies nothing. The
    table is the decoder's buffer, valid until its next step: a batch's logits that outlive its
    chunk (another batch on the same decoder may step in between) are `owned`."""

    table: np.ndarray
    rows: np.ndarray

    @property
    def shape(self) -> tuple:
        return (len(self.rows), self.table.shape[1])

    def __len__(self) -> int:
        return len(self.rows)

    def __array__(self, dtype=None, copy=None):
        out = self.table[self.rows]
        return out if dtype is None else out.astype(dtype, copy=False)

    def take(self, idx: np.ndarray) -> "RowLogits":
        return RowLogits(self.table, self.rows[idx])

    def owned(self) -> "RowLogits":
        """The same rows over a copy of only the table rows they read (a chunk's kept beams: a few)."""
        used, rows = np.unique(self.rows, return_inverse=True)
        return RowLogits(self.table[used], rows.reshape(-1))


class OnnxBackend:
    """The ONNX model with one cache row per candidate (model.onnx), the Numba kernel as sampler."""

    name = "onnx"
    computed = None                  # every row of a step is a model row

    def __init__(self, model: OnnxModel):
        self.model = model
        self.tokenizer = model.tokenizer
        self.vocab_size = model.vocab_size
        self.eos_ids = model.eos_ids
        self.pad_id = model.eos_ids[0] if model.eos_ids else 0

    def prefill(self, contexts: list[list[int]], reserve: int = 0) -> tuple[np.ndarray, KVCache]:
        ids, mask = left_pad(contexts, self.pad_id)
        logits, cache = self.model.forward(ids, self.model.empty_cache(len(contexts)), mask)
        return logits[:, -1], cache                                       # (B, V)

    @property
    def graph_seconds(self) -> float:
        return self.model.graph_seconds

    def step(self, tokens: np.ndarray, cache: KVCache, need: np.ndarray | None = None) -> tuple[np.ndarray, KVCache]:
        logits, cache = self.model.forward(tokens[:, None], cache)
        return logits[:, -1], cache

    def feed(self, tokens: np.ndarray, cache: KVCache) -> tuple[np.ndarray, KVCache]:
        """Known tokens (R, k) through the model: the logits after each (R, k, V) (one forward)."""
        return self.model.forward(tokens, cache)

    def select(self, cache: KVCache, idx: np.ndarray) -> KVCache:
        return cache.select(idx, in_place=True)

    @staticmethod
    def take(x, idx: np.ndarray):
        """Rows `idx` of logits (an array, or `RowLogits`: indexed, not copied)."""
        return x.take(idx) if isinstance(x, RowLogits) else np.take(x, idx, axis=0)

    # requests joining a running batch (continuous batching) and leaving it
    @staticmethod
    def concat(a, b) -> np.ndarray:
        return np.concatenate([np.asarray(a), np.asarray(b)])

    @staticmethod
    def merge(a: KVCache, b: KVCache) -> KVCache:
        return KVCache.merge(a, b)

    @staticmethod
    def trim(cache: KVCache) -> KVCache:
        return cache.trim()

    def release(self) -> None:
        """Nothing binds a row cache between runs."""

    def gather(self, logits, cache, idx: np.ndarray):
        return self.take(logits, idx), self.select(cache, idx)

    def join(self, logits, cache, new_logits, new_cache):
        return self.concat(logits, new_logits), self.merge(cache, new_cache)

    def sample(self, logits, uniforms, rules: StepRules):
        if isinstance(logits, RowLogits):                 # each row's logits read where they lie
            return kernels.sample(logits.table, uniforms, rules, rows=logits.rows)
        return kernels.sample(logits, uniforms, rules)

    @property
    def words(self) -> WordTable:
        """The vocabulary's words, for the word-loop rule (the model's, `OnnxModel.words`)."""
        return self.model.words

    def encode(self, text: str) -> list[int]:
        return self.model.encode(text)

    def decode_batch(self, seqs) -> list[str]:
        return self.model.tokenizer.decode_batch([list(map(int, s)) for s in seqs], skip_special_tokens=True)

    def decode_one(self, i: int) -> str:
        return self.model.decode_one(i)

    @property
    def max_positions(self):
        return self.model.max_positions


class PrefixBackend(OnnxBackend):
    """The ONNX model on the prefix cache (`dbs_fast.kv.prefix_cache`): each request's context once,
    each beam's prefix once, each candidate's chunk on its own. The scheduler's rows are the `live` rows of a PrefixCache laid
    out as beams of `s` rows; `select` (keep + repeat, drop, admission) regroups them. Prefill
    runs through the same graph (`PrefixDecoder.prefill`), so model.onnx is never opened. Sampling,
    tokens and logits rows are the row backend's.

    With `distinct` (and a decode graph that computes distinct rows), a step runs one model row per
    distinct history among the rows that `need` logits (`dbs_fast.kv.groups`): the copies of a
    candidate, and the candidates of a beam that drew the same tokens, are computed once; ended rows
    not at all. `computed` then names the scheduler row standing for each model row."""

    name = "onnx-prefix"

    def __init__(self, model: OnnxModel, decoder, s: int, k: int, reserve: int = 0, distinct: bool = True):
        super().__init__(model)
        self.decoder, self.s, self.k, self.reserve = decoder, s, k, reserve
        self.distinct = distinct and decoder.distinct
        self.computed: np.ndarray | None = None
        # a lone row runs twice where the CPU's one-row matmul kernels round otherwise than the
        # many-row ones (`kv.decoder.lone_row_rounds_apart`): else its batch would change its text
        self.lone_row_twice = decoder.distinct and decoder.on_cpu and lone_row_rounds_apart()

    @property
    def graph_seconds(self) -> float:
        return self.decoder.graph_seconds

    def prefill(self, contexts: list[list[int]], reserve: int = 0):
        ids, mask = left_pad(contexts, self.pad_id)
        m = self.model
        logits, cache = self.decoder.prefill(ids, mask, m.kv_heads, m.head_dim, self.s, self.k,
                                             max(self.reserve, reserve))
        return logits, Layout(cache, np.arange(len(contexts)) * self.s)

    def step(self, tokens: np.ndarray, lay: "Layout", need: np.ndarray | None = None):
        cache = lay.cache
        ids = np.full(cache.chunk_mask.shape[0], self.pad_id, np.int64)
        ids[lay.live] = tokens
        if not self.distinct:
            if len(ids) == 1 and self.lone_row_twice:     # the same bits as among many rows
                one = np.zeros(1, np.int64)
                return RowLogits(self.decoder.step(ids[[0, 0]], cache, rows=(one, np.zeros(2, np.int64))),
                                 lay.live), lay
            return RowLogits(self.decoder.step(ids, cache), lay.live), lay
        needed = np.zeros(len(ids), bool)
        needed[lay.live if need is None else lay.live[need]] = True
        group, slot_row, row_slot = distinct_rows(cache.groups(), ids, needed)
        row_of = np.full(len(ids), -1, np.int64)
        row_of[lay.live] = np.arange(len(lay.live))
        self.computed = row_of[row_slot]
        if not len(row_slot):                   # nothing to read: the slot stays as it was, unread
            cache.advance()
            cache.group = group
            return np.zeros((len(tokens), self.vocab_size), np.float32), lay
        if len(row_slot) == 1 and self.lone_row_twice:     # the same bits as among many rows
            row_slot = np.repeat(row_slot, 2)
        logits = self.decoder.step(ids[row_slot], cache, rows=(slot_row, row_slot), group=group)
        return RowLogits(logits, slot_row[lay.live]), lay

    def gather(self, logits, cache, idx: np.ndarray):
        """`OnnxBackend.gather`, the logits kept in memory of their own (between chunks, when this
        runs, the batches that share the decoder take turns)."""
        kept = self.take(logits, idx)
        return (kept.owned() if isinstance(kept, RowLogits) else kept), self.select(cache, idx)

    def feed(self, tokens: np.ndarray, lay: "Layout"):
        """Known tokens (R, k) of this chunk, one decode step each: the logits after each (R, k, V)."""
        return np.stack([np.asarray(self.step(tokens[:, t], lay)[0]) for t in range(tokens.shape[1])], axis=1), lay

    def release(self) -> None:
        """The batch is empty: the decoder lets go of the last cache's arrays."""
        self.decoder.release()

    @staticmethod
    def select(lay: "Layout", idx: np.ndarray) -> "Layout":
        return Layout(lay.cache, lay.cache.regroup(lay.live[idx]))

    @staticmethod
    def merge(a: "Layout", b: "Layout") -> "Layout":
        return Layout(PrefixCache.merge(a.cache, b.cache), np.concatenate([a.live, b.live + a.cache.chunk_mask.shape[0]]))

    @staticmethod
    def trim(lay: "Layout") -> "Layout":
        lay.cache.trim()
        return lay


# how a step's rows are chosen: "distinct" computes each distinct candidate history once (and a
# chunk's last token for the kept beams only) where the decode graph can; "plain" every row
SCHEDULES = ("distinct", "plain")


def onnx_backend(model: OnnxModel, decoder, cfg, schedule: str = "distinct") -> OnnxBackend:
    """The ONNX backend a search at `cfg` runs on: the prefix cache where the export has a decode
    graph (`decoder`, a `PrefixDecoder`), else one cache row per candidate. `schedule`: "distinct"
    computes each distinct candidate history once where the graph can; "plain" every row."""
    if decoder is None:
        return OnnxBackend(model)
    # a chunk never holds more than the budget's tokens (chunk > max_new_tokens allocates no more)
    return PrefixBackend(model, decoder, cfg.candidates, min(cfg.chunk, cfg.max_new_tokens), cfg.max_new_tokens,
                         distinct=schedule == "distinct")


@dataclass
class Layout:
    """A PrefixCache and, per scheduler row, the cache row that holds it."""

    cache: PrefixCache
    live: np.ndarray

    @property
    def mask(self) -> np.ndarray:
        """(beams, C + T): what each beam attends to before its chunk, its context's columns then
        its prefix's (0 = left padding)."""
        c = self.cache
        return np.concatenate([c.context_mask[c.beam_context], c.mask], axis=1)

    @property
    def length(self) -> int:
        return self.cache.context_mask.shape[1] + self.cache.mask.shape[1]

    @property
    def nbytes(self) -> int:
        return self.cache.nbytes
