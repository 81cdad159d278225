"""An exported model directory opened as an ONNX Runtime session with a KV cache of one row per
candidate (model.onnx: the PyTorch-style layout; the engine's default is the prefix cache of
`dbs_fast.kv.decoder`, where an export has one).

`OnnxModel.forward` runs prefill (T > 1) and decode (T = 1) steps alike; `KVCache.select`
is the one cache operation the scheduler needs: repeat (one beam -> s candidates) and gather
(keep the selected candidates) are both a row gather, done as one copy per tensor.
"""
from __future__ import annotations

import functools
import os
import time
import warnings
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np

from .cpu import cpu_model, cpu_signature
from .errors import DBSError
from .manifest import read_manifest
from .runtime import make_session
from .text.occurrence import WordTable, word_table


@dataclass
class KVCache:
    """Past keys/values of every layer, (B, kv_heads, T, head_dim) each, plus the mask (B, T)."""

    tensors: list[np.ndarray]   # [k0, v0, k1, v1, ...]
    mask: np.ndarray            # (B, T) int64, 0 for left padding

    @property
    def batch(self) -> int:
        return self.mask.shape[0]

    @property
    def length(self) -> int:
        return self.mask.shape[1]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def select(self, idx: np.ndarray, in_place: bool = False) -> "KVCache":
        """Rows `idx` of the cache (repeat and gather in one copy per tensor). `in_place` lets it
        overwrite this cache's arrays (see `take_rows_in_place`): do not use this cache after."""
        idx = np.asarray(idx, dtype=np.int64)
        if not in_place:
            return KVCache([np.take(t, idx, axis=0) for t in self.tensors], self.mask[idx])
        return KVCache([take_rows_in_place(t, idx) for t in self.tensors], self.mask[idx])

    @staticmethod
    def merge(a: "KVCache", b: "KVCache") -> "KVCache":
        """The rows of `a` then those of `b`, the shorter left-padded (mask 0) to the longer."""
        T = max(a.length, b.length)

        def pad(c: KVCache, t: np.ndarray) -> np.ndarray:
            return np.pad(t, ((0, 0), (0, 0), (T - c.length, 0), (0, 0))) if c.length < T else t

        tensors = [np.concatenate([pad(a, x), pad(b, y)]) for x, y in zip(a.tensors, b.tensors)]
        mask = np.concatenate([np.pad(c.mask, ((0, 0), (T - c.length, 0))) for c in (a, b)])
        return KVCache(tensors, mask)

    def trim(self) -> "KVCache":
        """Without the leading columns that are padding in every row (left by rows that left)."""
        z = int(np.argmax(self.mask.any(axis=0))) if self.mask.any() else self.length
        if z == 0:
            return self
        return KVCache([np.ascontiguousarray(t[:, :, z:]) for t in self.tensors], self.mask[:, z:].copy())

    def repeat(self, n: int) -> "KVCache":
        return self.select(np.repeat(np.arange(self.batch), n))


def take_rows_in_place(src: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """`src[rows]` written into `src` itself when the row count is unchanged, else a plain gather.

    Every chunk after the first keeps b rows and repeats each s times, so the new cache has as
    many rows as the old one: it is written into the arrays ONNX Runtime just returned, through
    a copy of only the distinct source rows (b of b*s). No multi-GB allocation per chunk (whose
    page faults cost more than the copy), and the peak holds one cache plus a tenth, not two.
    """
    if len(idx) == src.shape[0] and src.flags.writeable and src.flags.c_contiguous:
        uniq, inv = np.unique(idx, return_inverse=True)
        tmp = src[uniq]                                                 # the distinct rows only
        for j in range(len(idx)):
            src[j] = tmp[inv[j]]
        return src
    return np.take(src, idx, axis=0)


@functools.lru_cache(maxsize=8)
def load_tokenizer(path: str):
    """An export's tokenizer.json, loaded once per process (the CLI's size check before the model
    loads and the model itself read the same one; nothing here changes a tokenizer's settings)."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(path)


class OnnxModel:
    """A causal LM with KV cache: tokenizer + ORT session + the manifest that describes them."""

    def __init__(self, model_dir: str | os.PathLike, provider: str = "cpu", threads: int | None = None,
                 lazy: bool = False):
        """`lazy`: open the ONNX Runtime session of model.onnx on first use (the prefix cache decodes and
        prefills with decode.onnx alone, so its weights are loaded once)."""
        self.dir = Path(model_dir)
        self.manifest = m = read_manifest(self.dir)
        self.num_layers = m["num_layers"]
        self.kv_heads = m["num_kv_heads"]
        self.head_dim = m["head_dim"]
        self.vocab_size = m["vocab_size"]
        self.eos_ids = tuple(m.get("eos_token_ids", []))
        self.max_positions = m.get("max_positions")
        self._open_args, self._session = (provider, threads), None
        self.graph_seconds = 0.0   # inside ORT's run, over all calls (the rest is the host's work)
        if not lazy:
            self._open()
        self.tokenizer = load_tokenizer(str(self.dir / "tokenizer.json"))

    @property
    def session(self):
        if self._session is None:
            self._open()
        return self._session

    def _open(self) -> None:
        m = self.manifest
        if not m.get("onnx"):
            raise DBSError(f"{self.dir} has no row layout (model.onnx): an export on a GGUF file's blocks "
                           f"leaves it out. Use the prefix cache (kv_layout 'prefix' or 'auto'), or export "
                           f"again with `dbs-fast export --row-layout`")
        self._session = make_session(self.dir / m["onnx"], *self._open_args)
        self.provider = self._session.get_providers()[0]
        names = [i.name for i in self._session.get_inputs()]
        self.past_names = [n for n in names if n.startswith("past_key_values.")]
        self.present_names = [o.name for o in self._session.get_outputs() if o.name.startswith("present.")]
        self.has_position_ids = "position_ids" in names
        self._outputs = ["logits"] + self.present_names
        self._check_against_manifest()
        chosen_on = m.get("quantize_auto", {}).get("host")
        if chosen_on and self.provider == "CPUExecutionProvider" and chosen_on != cpu_signature():
            warnings.warn(f"{self.dir}: `--quantize auto` chose {m['quantize_auto']['chose']} by timing on "
                          f"{chosen_on['cpu']} ({', '.join(chosen_on['isa']) or 'no AVX2'}), not on this CPU "
                          f"({cpu_model()}): `dbs-fast export --quantize auto` again here to choose for it",
                          RuntimeWarning, stacklevel=3)

    def _check_against_manifest(self):
        if len(self.past_names) != 2 * self.num_layers:
            raise DBSError(f"{self.dir}: the manifest says {self.num_layers} layers but model.onnx has "
                           f"{len(self.past_names) // 2}: manifest and model do not match")
        shape = self.session.get_inputs()[[i.name for i in self.session.get_inputs()].index(self.past_names[0])].shape
        if isinstance(shape[1], int) and (shape[1] != self.kv_heads or shape[3] != self.head_dim):
            raise DBSError(f"{self.dir}: the manifest says {self.kv_heads} kv heads x {self.head_dim} but "
                           f"model.onnx has {shape[1]} x {shape[3]}: manifest and model do not match")
        vocab = self.session.get_outputs()[0].shape[-1]
        if isinstance(vocab, int) and vocab != self.vocab_size:
            raise DBSError(f"{self.dir}: the manifest says vocab {self.vocab_size}, model.onnx has {vocab}")

    def empty_cache(self, batch: int) -> KVCache:
        z = np.zeros((batch, self.kv_heads, 0, self.head_dim), np.float32)  # (B, kvh, 0, hd)
        return KVCache([z] * (2 * self.num_layers), np.zeros((batch, 0), np.int64))

    def forward(self, input_ids: np.ndarray, cache: KVCache, mask: np.ndarray | None = None):
        """Run T new tokens per row; returns logits (B, T, V) float32 and the grown cache."""
        session = self.session                                         # opened here if lazy
        B, T = input_ids.shape
        new_mask = np.ones((B, T), np.int64) if mask is None else mask.astype(np.int64)
        full = np.concatenate([cache.mask, new_mask], axis=1)          # (B, past + T)
        feed = {"input_ids": input_ids.astype(np.int64), "attention_mask": full}
        if self.has_position_ids:
            pos = np.cumsum(full, axis=1)[:, -T:] - 1                  # left padding aware
            feed["position_ids"] = np.maximum(pos, 0)
        feed.update(zip(self.past_names, cache.tensors))
        t0 = time.perf_counter()
        out = session.run(self._outputs, feed)
        self.graph_seconds += time.perf_counter() - t0
        return out[0], KVCache(out[1:], full)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text).ids

    def decode(self, ids) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def decode_one(self, i: int) -> str:
        """One token's text, special tokens written out."""
        return self.tokenizer.decode([i], skip_special_tokens=False)

    @cached_property
    def words(self) -> WordTable:
        """The vocabulary's words, for the word-loop rule (`occurrence.word_table`): decoded once per
        model, for the backend of every batch."""
        return word_table(self.decode_one, self.vocab_size)
