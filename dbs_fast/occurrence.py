"""Guide-word occurrence: whole words (split on whitespace and punctuation) with equal Porter stems."""
from __future__ import annotations

import re
from functools import lru_cache

from nltk.stem.porter import PorterStemmer

_WORDS = re.compile(r"[^\W_]+")  # runs of letters/digits: punctuation never hides a word
_stemmer = PorterStemmer()


@lru_cache(maxsize=200_000)
def stem(word: str) -> str:
    return _stemmer.stem(word.lower())


def words(text: str) -> list[str]:
    return _WORDS.findall(text.lower())


def count(text: str, keyword: str) -> int:
    """Occurrences of `keyword` in `text` ("Colonies." counts for "colony")."""
    target = stem(keyword)
    return sum(1 for w in words(text) if stem(w) == target)


def _tail(prefix: str) -> str:
    """The unfinished last word of `prefix` (a chunk may complete it)."""
    m = re.search(r"[^\W_]+$", prefix)
    return m.group(0) if m else ""


def count_new(prefix: str, chunk: str, keyword: str) -> int:
    """Occurrences that `chunk` adds after `prefix` (words straddling the boundary included)."""
    tail = _tail(prefix)
    return count(tail + chunk, keyword) - count(tail, keyword)


def first_match(text: str, keyword: str) -> tuple[int, int] | None:
    """(start, end) character span of the first occurrence of `keyword`, or None."""
    target = stem(keyword)
    for m in _WORDS.finditer(text):
        if stem(m.group(0)) == target:
            return m.span()
    return None


_SENTENCE_END = re.compile(r"[.!?][\"')\]”’]*\s*$")


def ends_sentence(text: str) -> bool:
    """Text whose last non-space characters close a sentence (. ! ? maybe then quotes/brackets)."""
    return bool(text.strip()) and _SENTENCE_END.search(text) is not None


def sentence_end_tokens(decode_one, vocab_size: int):
    """Boolean (V,) array: tokens that, decoded alone, end a sentence ("." "!" '."' " end." ...)."""
    import numpy as np

    return np.array([ends_sentence(decode_one(i)) for i in range(vocab_size)], bool)
