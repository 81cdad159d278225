"""Degeneration metrics on generated text (word level), as in Welleck et al. 2019.

- rep-n of one text: 1 - unique n-grams / n-grams (0 = no n-gram repeats; "a b a b" has
  rep-2 = 1 - 2/3);
- distinct-n of a set of texts: unique n-grams / n-grams, pooled over the set (1 = no n-gram
  is ever reused, across texts too);
- a word loop in one text: some word three times within five consecutive words ("a summer
  summer summer winter"), which rep-n of short texts barely shows;
- a false sentence end: a text that ends with a period after an abbreviation ("Dr.") or an
  initial ("J."), by a list of its own (not the splitter the engine stops by, so that it checks
  the engine rather than repeating it); a number before the period ("in 2012.") ends sentences
  too often to count as false without reading the text (`number_end` finds those).
Words are lower-cased runs of letters/digits; punctuation is not a word.

CommonGen's coverage: the fraction of concepts that the text uses in some form, matched by
lemma ("stands" covers "stand", "ran" covers "run"), with lemminflect's lemmas for every part
of speech (a word may be covered through any reading of it).
"""
from __future__ import annotations

import re

from ..text.words import lemmas, word_loop, words  # noqa: F401 (word_loop: the metric)

# abbreviations a sentence does not end at, lower-cased, without their last period
ABBREVIATIONS = frozenset("dr mr mrs ms mx st jr sr prof mt ft vs etc e.g i.e u.s u.k a.m p.m inc ltd co corp "
                          "gen gov sen rep col capt lt sgt rev fig approx dept est jan feb mar apr aug sept oct nov dec"
                          .split())


def ngrams(ws: list[str], n: int) -> list[tuple[str, ...]]:
    return [tuple(ws[i:i + n]) for i in range(len(ws) - n + 1)]


def rep_n(text: str, n: int) -> float:
    """1 - unique/total n-grams of one text; 0.0 for a text with no n-gram."""
    g = ngrams(words(text), n)
    return 1.0 - len(set(g)) / len(g) if g else 0.0


def _before_last_period(text: str) -> str | None:
    m = re.search(r"(\S+)\.[\"')\]]*\s*$", text)
    return None if m is None else m.group(1).lstrip("\"'([")


def false_end(text: str) -> bool:
    """Whether `text` ends with a period that does not end a sentence: after an abbreviation of
    `ABBREVIATIONS` or a single capital (an initial)."""
    last = _before_last_period(text)
    return last is not None and (last.lower() in ABBREVIATIONS or
                                 re.fullmatch(r"[A-HJ-Z]|(?:[A-Za-z]\.)+[A-Za-z]", last) is not None)


def number_end(text: str) -> bool:
    """Whether `text` ends with a period right after a number ("in 2012.", or a decimal point)."""
    last = _before_last_period(text)
    return last is not None and re.fullmatch(r"[$£€]?\d[\d,]*", last) is not None


def distinct_n(texts, n: int) -> float:
    """unique/total n-grams pooled over `texts`; 0.0 when there is none."""
    g = [x for t in texts for x in ngrams(words(t), n)]
    return len(set(g)) / len(g) if g else 0.0


def coverage(text: str, concepts) -> float:
    """Fraction of `concepts` (words) whose lemmas meet the lemmas of a word of `text`."""
    if not concepts:
        return 1.0
    seen = set().union(*(lemmas(w) for w in words(text))) if words(text) else set()
    return sum(1 for c in concepts if lemmas(c) & seen) / len(concepts)
