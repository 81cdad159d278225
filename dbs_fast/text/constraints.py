"""Constraints: what a keyword may be, what may not appear, and the tables the kernel reads.

Syntax (CLI, API and eval alike): keywords are comma-separated; a keyword is one or more
alternatives separated by `|` (any one satisfies it, as transformers' DisjunctiveConstraint);
an alternative is a word or a phrase of words separated by spaces ("ice cream|gelato").
Banned words use the same syntax; every alternative of a banned keyword is banned.

Guidance (the boost table): a word is guided by its embedding vector, a phrase by the mean of
its words' unit vectors (words the embeddings lack are left out), a keyword with alternatives
by the per-token max over its alternatives' boosts, and `order="any"` by the per-token max over
the keywords still to place (merged rows, built on first use and cached).

Forcing (the token sequences the scheduler may force): a keyword's tokens when its deadline
comes under `guarantee`, and the rest of a phrase once its first word's tokens are out. With
`complete_words` (the default) a keyword is also written from its own first token: that token
(after a space, as given and in lower case) gets the keyword's full boost, as a one-token keyword has, and once it
is out the rest of the keyword's tokens are forced ("rodeo" = " rode" + "o": the embedding
similarity of " rode" to "rodeo" alone would give it a boost of about 1 at lambda 8).

Bans (the sequences the kernel never completes): every case and leading-space variant of a
banned word, tokenised; a one-token variant is never drawn, a longer one's last token is never
drawn after the rest.

Token healing (`Healing`): the context's last token is taken back and the first generated token
must re-write its text, so a context that ends mid-word or with a space is continued as the model
would have tokenised the whole text (" teach" -> " teacher"), not glued onto ("TheBella").
"""
from __future__ import annotations

import re
from bisect import bisect_left
from dataclasses import dataclass

import numpy as np

from ..errors import DBSError
from ..kernels import csr_boosts, dense_boosts
from .embeddings import SimilarityTable, SparseBoost
from .occurrence import pattern
from .words import WORD, Keyword  # noqa: F401  (Keyword: its parser is here)

_ALLOWED = re.compile(rf"^{WORD.pattern}(?:[ '\-]{WORD.pattern})*$")   # words joined by single spaces, ' or -


def parse_keyword(text: str) -> Keyword:
    if not isinstance(text, str):
        raise DBSError(f"a keyword must be a string, got {text!r}")
    alts = [" ".join(a.split()) for a in text.split("|")]
    if any(not a for a in alts):
        raise DBSError(f"empty alternative in keyword {text!r}: write `run|ran`, not `run|` or `|ran`")
    for a in alts:
        if not _ALLOWED.match(a):
            raise DBSError(f"keyword {a!r} must be words of letters/digits (a phrase: words separated by spaces; "
                           f"alternatives: separated by |), without other punctuation")
    return Keyword("|".join(alts), tuple(tuple(w.lower() for w in WORD.findall(a)) for a in alts))


def parse_keywords(keywords, what: str = "keyword") -> list[Keyword]:
    """`keywords`: a comma-separated string or a list of strings. A DBSError names the request
    field: `keywords`, or `ban` for banned words."""
    field = "keywords" if what == "keyword" else "ban"
    given = keywords
    if keywords is None or (isinstance(keywords, (str, list, tuple)) and not keywords):
        return []                            # none: the model's own text, no guidance
    try:
        if isinstance(keywords, str):
            keywords = keywords.split(",")
        if not isinstance(keywords, (list, tuple)):
            raise DBSError(f"{what}s must be a comma-separated string or a list of strings, got {keywords!r}")
        parts = [k.strip() if isinstance(k, str) else k for k in keywords]
        if any(p == "" for p in parts) and what == "keyword":
            raise DBSError(f"empty keyword in {keywords!r}")
        return [parse_keyword(p) for p in parts if p != ""]
    except DBSError as e:
        raise DBSError(e.args[0], field, given) from None


def check_bans(keywords: list[Keyword], bans: list[Keyword], given=None) -> None:
    """DBSError (field `ban`, value `given`) when a keyword is also banned."""
    banned = {a: b.text for b in bans for a in pattern(b)}
    for k in keywords:
        for text, a in zip(k.phrases, pattern(k)):
            if a in banned:
                raise DBSError(f"keyword {text.lower()!r} is also banned ({banned[a]!r}): drop one of them",
                               "ban", given)


def surface_variants(phrase: str) -> list[str]:
    """Case and leading-space variants of a phrase, as text may contain it."""
    forms = dict.fromkeys([phrase, phrase.lower(), phrase[:1].upper() + phrase[1:], phrase.title(), phrase.upper()])
    return [v for f in forms for v in (" " + f, f)]


def _dedup(seqs) -> list[tuple[int, ...]]:
    return list(dict.fromkeys(tuple(int(t) for t in s) for s in seqs if len(s)))


# -- guidance -------------------------------------------------------------------------------
def keyword_boost(table: SimilarityTable, kw: Keyword, lam: float, cutoff: float, subword_fallback=None,
                  lenient: bool = False, allowed: np.ndarray | None = None, own=(), power: float = 2.0) -> SparseBoost:
    """Boost of one keyword: per-token max over its alternatives; a phrase uses the mean of its
    words' unit vectors. `lenient` (guarantee): a keyword no vector covers gets its sub-word
    tokens' vectors, or no boost at all, instead of an error. `allowed`: (V,) bool, the tokens
    that may be boosted (others are dropped). `own`: token ids that begin the keyword itself
    (`first_tokens`): they get the full boost, lambda, as a one-token keyword's own token has.
    `power`: the similarity's exponent (`DBSConfig.similarity_power`)."""
    rows = []
    if len(own):
        rows.append(SparseBoost(kw.text, np.array(sorted(own), np.int32), np.full(len(own), lam, np.float32)))
    for alt in kw.alternatives:
        vecs = [v for v in (table.emb.vector(w) for w in alt) if v is not None]
        if not vecs and (subword_fallback is not None or lenient):
            try:
                vecs = [table.guide_vector(" ".join(alt), subword_fallback or _no_fallback)]
            except DBSError:
                vecs = []
        if not vecs:
            if lenient:
                continue
            missing = [w for w in alt if table.emb.vector(w) is None]
            raise DBSError(f"keyword {' '.join(missing)!r} is not in the embeddings ({table.emb.source}); "
                           f"use --subword-fallback with --guarantee (it placed 14 words of 14 that GloVe lacks, "
                           f"and read best: docs/results/quality/unknown-words.md), or another form (`word|other`)")
        m = np.mean([v / np.linalg.norm(v) for v in vecs], axis=0)
        b = table.sparse_vector(kw.text, m / np.linalg.norm(m), lam, cutoff, power)
        if allowed is not None:
            keep = allowed[b.ids]
            b = SparseBoost(b.word, b.ids[keep], b.values[keep])
        rows.append(b)
    if allowed is not None and len(own):
        keep = allowed[rows[0].ids]
        rows[0] = SparseBoost(kw.text, rows[0].ids[keep], rows[0].values[keep])
    return merge_boosts(kw.text, rows)


def _no_fallback(word):
    return []


def merge_boosts(name: str, boosts: list[SparseBoost]) -> SparseBoost:
    """Per-token max of several sparse boosts."""
    if not boosts or not any(len(b.ids) for b in boosts):
        return SparseBoost(name, np.zeros(0, np.int32), np.zeros(0, np.float32))
    if len(boosts) == 1:
        return SparseBoost(name, boosts[0].ids, boosts[0].values)
    dense = np.full(max(int(b.ids.max()) for b in boosts if len(b.ids)) + 1, -np.inf, np.float32)
    for b in boosts:                                   # ids are unique within a boost: a scatter-max
        dense[b.ids] = np.maximum(dense[b.ids], b.values)
    ids = np.flatnonzero(dense > -np.inf)
    return SparseBoost(name, ids.astype(np.int32), dense[ids])


class BoostTable:
    """CSR rows the kernel indexes: one per keyword (request by request), plus merged rows for
    sets of a request's keywords (`order="any"`), appended on first use and cached. `merged`:
    per first row of a request, a dict (mask -> merged boost) that outlives the table, so a
    batch that is rebuilt when requests join or leave does not merge the same rows again."""

    def __init__(self, boosts: list[SparseBoost], merged: dict[int, dict] | None = None):
        self.rows = list(boosts)
        self._merged: dict[tuple[int, int], int] = {}
        self._kept = merged or {}
        self._csr = self._dense_exp = None

    def row(self, base: int, mask: int) -> int:
        """Row of the keywords in bitmask `mask` of the request whose first keyword is row `base`."""
        if mask <= 0:
            return -1
        if mask & (mask - 1) == 0:
            return base + mask.bit_length() - 1
        key = (base, mask)
        if key not in self._merged:
            kept = self._kept.get(base, {})
            if mask not in kept:
                bits = [i for i in range(mask.bit_length()) if mask >> i & 1]
                kept[mask] = merge_boosts("|".join(self.rows[base + i].word for i in bits),
                                          [self.rows[base + i] for i in bits])
            self.rows.append(kept[mask])
            self._merged[key] = len(self.rows) - 1
            self._csr = None
        return self._merged[key]

    def rows_for(self, bases: np.ndarray, masks: np.ndarray) -> np.ndarray:
        """`row` for every (base, mask); one keyword or none (all of `order="next"`) without a loop."""
        masks = np.asarray(masks, np.int64)
        single = (masks & (masks - 1)) == 0
        index = np.bitwise_count(np.maximum(masks - 1, 0)) if hasattr(np, "bitwise_count") else \
            np.array([int(m - 1).bit_count() if m > 0 else 0 for m in masks])
        out = np.where(masks == 0, -1, bases + index).astype(np.int32)
        for i in np.flatnonzero(~single):
            out[i] = self.row(int(bases[i]), int(masks[i]))
        return out

    @property
    def csr(self):
        if self._csr is None:
            self._csr, self._dense_exp = csr_boosts(self.rows), None
        return self._csr

    def dense_exp(self, V: int) -> np.ndarray:
        """The whole table as the kernel reads it densely (`kernels.dense_boosts`): built once per
        version of the table (0.3 ms a step otherwise)."""
        csr = self.csr
        if self._dense_exp is None or self._dense_exp.shape[1] != V:
            self._dense_exp = dense_boosts(*csr, V)
        return self._dense_exp


# -- forcing and bans -----------------------------------------------------------------------
class SequenceTable:
    """Token sequences packed flat (ptr, tokens), referenced by index."""

    def __init__(self):
        self.seqs: list[tuple[int, ...]] = []
        self._index: dict = {}

    def add(self, seq) -> int:
        seq = tuple(int(t) for t in seq)
        if seq not in self._index:
            self._index[seq] = len(self.seqs)
            self.seqs.append(seq)
        return self._index[seq]

    def arrays(self):
        ptr = np.zeros(len(self.seqs) + 1, np.int64)
        for i, s in enumerate(self.seqs):
            ptr[i + 1] = ptr[i] + len(s)
        toks = np.array([t for s in self.seqs for t in s], np.int32)
        return ptr, toks


def keyword_tokens(encode, kw: Keyword) -> list[tuple[int, ...]]:
    """Token sequences that write each alternative (leading space, as given), shortest first."""
    return sorted(_dedup(encode(" " + a) for a in kw.phrases), key=len)


def _word_start_variants(text: str) -> list[str]:
    """`text` as given and in lower case, after a space (a word start: its first token is no word
    piece). Not the capitalised or upper-case forms: a full boost on " Col" or " EN" (of "Colony",
    "ENEMY") would put capitals mid-sentence."""
    return list(dict.fromkeys([" " + text, " " + text.lower()]))


def first_tokens(encode, kw: Keyword) -> set[int]:
    """The first token of each alternative after a space (as given, lower case): the keyword's own
    start; and of each inflection `inflected` added, the token that writes it whole, where one does
    (a longer one's first token would start other words as well, with no phrase to finish it)."""
    own = {int(t[0]) for a in kw.phrases for v in _word_start_variants(a) if len(t := encode(v))}
    given = {p.lower() for p in kw.phrases}
    added = [" ".join(a) for a in kw.alternatives if " ".join(a) not in given]
    return own | {int(t[0]) for a in added for v in _word_start_variants(a) if len(t := encode(v)) == 1}


def inflected(kw: Keyword, has_vector) -> Keyword:
    """`kw` with each one-word alternative's inflections (lemminflect's, for every part of speech:
    "sends", "sent", "sending" for "send") among its alternatives, those whose lemmas meet the
    word's (the lemma rule counts them already) and that `has_vector` (a word -> bool: the guide
    embeddings hold it). Its text, which results name it by, is the same."""
    from lemminflect import getAllInflections

    from .words import lemmas

    alts = list(kw.alternatives)
    for (word, *rest) in kw.alternatives:
        if rest:
            continue
        own = lemmas(word)
        for forms in getAllInflections(word).values():
            for f in (f.lower() for f in forms):
                if (f,) not in alts and lemmas(f) & own and has_vector(f):
                    alts.append((f,))
    return Keyword(kw.text, tuple(alts))


def phrase_starts(encode, kw: Keyword, words: bool = False) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """For each multi-word alternative and surface variant: (tokens of its first word, tokens of
    the whole phrase) when the first word's tokens are a prefix of the phrase's. `words`
    (complete_words) adds, for every alternative written in more than one token: (its first
    token, all its tokens), after a space, as given and in lower case."""
    out = []
    for a in kw.phrases:
        if " " not in a:
            continue
        first = a.split(" ")[0]
        for v in surface_variants(a):
            lead = " " if v.startswith(" ") else ""
            fw = v[len(lead): len(lead) + len(first)]
            head, whole = tuple(encode(lead + fw)), tuple(encode(v))
            if head and len(whole) > len(head) and whole[: len(head)] == head:
                out.append((head, whole))
    if words:
        for a in kw.phrases:
            for v in _word_start_variants(a):
                whole = tuple(encode(v))
                if len(whole) > 1:
                    out.append((whole[:1], whole))
    return list(dict.fromkeys(out))


def ban_sequences(encode, bans: list[Keyword]) -> list[tuple[int, ...]]:
    """Every tokenised case / leading-space variant of every banned alternative."""
    return _dedup(encode(v) for b in bans for a in b.phrases for v in surface_variants(a))


def banned_tokens(history, ban_seqs) -> set[int]:
    """The ban rule, stated once (the kernel's `_ban` is its fast form, the PyTorch baseline calls
    this): the tokens a row may not draw next. A one-token sequence's token always; a longer one's
    last token when the row's history ends with the rest."""
    h = [] if history is None else list(history)
    out = set()
    for seq in ban_seqs or ():
        seq = list(seq)
        if len(seq) - 1 <= len(h) and (len(seq) == 1 or h[len(h) - len(seq) + 1:] == seq[:-1]):
            out.add(int(seq[-1]))
    return out


@dataclass(frozen=True)
class Healing:
    """A healed context: its tokens without the last one, that token's text (`tail`), and the
    tokens the first generated one may not be (every token whose text does not start with `tail`)."""
    context_ids: list[int]
    tail: str
    ban: np.ndarray          # (n,) int32, sorted


class TokenTexts:
    """Every token's text, sorted: the tokens whose text starts with a given string, by bisection."""

    def __init__(self, decode_one, vocab_size: int, special=()):
        texts = [decode_one(i) for i in range(vocab_size)]
        special = set(special)
        order = sorted((i for i in range(vocab_size) if i not in special), key=texts.__getitem__)
        self.texts = [texts[i] for i in order]
        self.ids = np.array(order, np.int32)
        self.vocab_size = vocab_size

    def starting_with(self, prefix: str) -> np.ndarray:
        lo = bisect_left(self.texts, prefix)
        hi = bisect_left(self.texts, prefix + "\U0010ffff", lo)
        return np.sort(self.ids[lo:hi])

    def heal(self, ids: list[int], tail: str, banned=()) -> Healing | None:
        """The context `ids` healed at its last token (whose text is `tail`), or None where that
        cannot be done (one token only, a partial character, every completion in `banned`)."""
        if len(ids) < 2 or not tail or "\ufffd" in tail:
            return None
        allowed = self.starting_with(tail)
        if ids[-1] not in allowed:        # a token the tokenizer writes differently alone: leave it
            return None
        if len(banned) and np.isin(allowed, banned).all():
            return None
        keep = np.ones(self.vocab_size, bool)
        keep[allowed] = False
        return Healing(list(ids[:-1]), tail, np.flatnonzero(keep).astype(np.int32))
