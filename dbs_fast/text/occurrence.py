"""Guide-word occurrence: whole words (split on whitespace and punctuation) that match by a rule:
- "stem" (the paper, the default): equal Porter stems ("colonies" for "colony", but also
  "performance" for "perform");
- "lemma" (CommonGen's coverage rule, `dbs_fast.evaluation.metrics.coverage`; `words.lemmas`):
  the word's lemmas in any part of speech meet the keyword word's (lemminflect: "ran" for "run",
  not "performance" for "perform").

A keyword in the constraint syntax (`dbs_fast.text.constraints`) may be a phrase, whose words must
follow one another, or alternatives separated by `|`, any of which counts.
"""
from __future__ import annotations

import re
from functools import lru_cache
from typing import NamedTuple

from nltk.stem.porter import PorterStemmer

from .words import WORD, Keyword, lemmas, starts_word

_stemmer = PorterStemmer()


@lru_cache(maxsize=200_000)
def stem(word: str) -> str:
    return _stemmer.stem(word.lower())


@lru_cache(maxsize=200_000)
def forms(word: str, rule: str = "stem") -> frozenset:
    """What `word` matches by under `rule`: its stem, or the word and all its lemmas."""
    if rule == "lemma":
        return frozenset(lemmas(word))
    return frozenset((stem(word),))


@lru_cache(maxsize=20_000)
def _alternatives(keyword: Keyword, rule: str) -> tuple[tuple[frozenset, ...], ...]:
    return tuple(tuple(forms(w, rule) for w in a) for a in keyword.alternatives)


@lru_cache(maxsize=20_000)
def pattern(keyword: Keyword) -> tuple[tuple[str, ...], ...]:
    """Stems of each alternative's words: "ice cream|gelato" -> (("ice", "cream"), ("gelato",))."""
    return tuple(tuple(stem(w) for w in a) for a in keyword.alternatives)


def _spans(text: str, keyword: Keyword, open_end: bool = False, rule: str = "stem"):
    """(start, end) character spans of every occurrence: a position where words matching some
    alternative's words (by `rule`) follow one another. `open_end`: the text may go on, so a match whose
    last word runs to its very end is not one yet (the next token may make "pet" "petrified")."""
    ms = list(WORD.finditer(text))
    fs = [forms(m.group(0), rule) for m in ms]
    alts = _alternatives(keyword, rule)
    for i in range(len(fs)):
        for a in alts:
            if a and i + len(a) <= len(fs) and all(f & w for f, w in zip(fs[i: i + len(a)], a)):
                end = ms[i + len(a) - 1].end()
                if not (open_end and end == len(text)):
                    yield ms[i].start(), end
                break


def spans(text: str, keyword: Keyword, rule: str = "stem") -> list[tuple[int, int]]:
    """(start, end) character spans of every occurrence of `keyword` in a finished `text`."""
    return list(_spans(text, keyword, False, rule))


def count(text: str, keyword: Keyword, open_end: bool = False, rule: str = "stem") -> int:
    """Occurrences of `keyword` in `text` ("Colonies." counts for "colony"; "ice creams" for
    "ice cream"; "ran" for "run|ran"). `open_end`: the text is not finished (see `_spans`)."""
    return sum(1 for _ in _spans(text, keyword, open_end, rule))


def _tail(text_before: str, n_words: int = 1) -> str:
    """The end of `text_before` from the start of its last `n_words` words (a chunk may complete the
    last one, or a phrase that starts there)."""
    p = text_before[-200 * n_words:]         # long enough for n words
    ms = list(WORD.finditer(p))
    if not ms:
        return ""
    if len(ms) < n_words:
        return p
    cut = ms[-n_words]
    if n_words == 1 and cut.end() < len(p):
        return ""                       # the last word is finished: nothing to carry
    return p[cut.start():]


def count_new(text_before: str, chunk: str, keyword: Keyword, open_end: bool = False, final: bool = False,
              rule: str = "stem") -> int:
    """Occurrences that `chunk` adds after `text_before` (words and phrases straddling the boundary
    included). `open_end`: matches at the very end are not counted until the text goes on without
    extending their last word (as the text before was counted), unless the text is `final`."""
    tail = _tail(text_before, max(len(a) for a in pattern(keyword)))
    return count(tail + chunk, keyword, open_end and not final, rule) - count(tail, keyword, open_end, rule)


def first_match(text: str, keyword: Keyword, rule: str = "stem") -> tuple[int, int] | None:
    """(start, end) character span of the first occurrence of `keyword`, or None."""
    return next(_spans(text, keyword, rule=rule), None)


_SENTENCE_END = re.compile(r"[.!?][\"')\]”’]*\s*$")


def ends_sentence(text: str) -> bool:
    """Text whose last non-space characters close a sentence (. ! ? maybe then quotes/brackets)."""
    return bool(text.strip()) and _SENTENCE_END.search(text) is not None


# what follows a text to ask the splitter whether the text's last sentence end is one: a
# capitalised word, as a new sentence would start
_PROBE = " The"
_TAIL = 80          # characters of the text the decision looks at (a sentence splitter's rules are local)


_DIGIT_PERIOD = re.compile(r"\d\.\s*$")
_LETTER_PERIOD = re.compile(r"(?<![\w.])[^\W\d_]\.\s*$")      # a lone letter, then the period: "e.", "Z."


def ends_a_sentence_here(text: str) -> bool:
    """Whether `text`, whose last token ends like a sentence (`ends_sentence`), ends one: pySBD (a
    port of the Pragmatic Segmenter's rules) splits `text` + " The" after it. "Dr.", "Mr.", "e.g.",
    "St." and middle initials do not end a sentence; "U.S." and "p.m." do before a capital. A
    period right after a digit does not either: it may be a decimal point ("$1." of "$1.5"), and
    the text cannot see the next token; a sentence that does end after a number ("in 2012.")
    then ends at its next end. Nor does one after a lone letter, whatever its case: an initial
    ("Frank Z.") or the start of an abbreviation ("It is, e." of "e.g."), which the splitter
    takes for an end when the letter is lower-case. Nor does one inside a parenthesis still open
    ("Miller (a.", "(b. 1950", "(for good."): a sentence in parentheses ends after its ")", at
    the next end."""
    tail = text[-_TAIL:]
    return _DIGIT_PERIOD.search(text) is None and _LETTER_PERIOD.search(text) is None and \
        tail.rfind("(") <= tail.rfind(")") and _splits(tail.lstrip())


def ends_generated_sentence(context: str, generated: str) -> bool:
    """Whether `generated`, the text added to `context`, ends a sentence there: it must hold a
    character of its own (a healed context's end that the first token re-wrote, "Why is the sky
    blue?" then "?", adds none, and the context's own end is not the answer's), then end one
    (`ends_a_sentence_here`)."""
    return bool(generated.strip()) and ends_a_sentence_here(context + generated)


@lru_cache(maxsize=4096)
def _splits(tail: str) -> bool:
    parts = _segmenter().segment(tail + _PROBE)
    return len(parts) > 1 and parts[-1].strip() == _PROBE.strip()


@lru_cache(maxsize=None)
def _segmenter():
    import pysbd

    return pysbd.Segmenter(language="en", clean=False)


def word_piece_tokens(decode_one, vocab_size: int):
    """Boolean (V,) array: tokens whose text starts with a letter or digit (they continue the word
    before them: "rink" after "hockey" makes "hockeyrink")."""
    import numpy as np

    return np.array([starts_word(decode_one(i)) for i in range(vocab_size)], bool)


WORD_OTHER, WORD_START, WORD_PIECE = 0, 1, 2     # `word_table`


class WordTable(NamedTuple):
    """The vocabulary's words, for the kernel's word-loop rule. `word_class` (V,) int8:
    WORD_START for a token that begins a word with a letter after a space (" summer"), WORD_PIECE
    for one that starts with a letter and so continues the word before it ("mer"; after
    punctuation it begins one: "-one"), WORD_OTHER for the rest. `key` (V,) int32: the word a
    token spells on its own (its letters, lower-cased: " One", "one" and " one" share one), -1
    where it has other characters. Key k's tokens: `key_tok[key_ptr[k]:key_ptr[k + 1]]`."""
    word_class: object
    key: object
    key_ptr: object
    key_tok: object


def word_table(decode_one, vocab_size: int) -> WordTable:
    import numpy as np

    cls = np.zeros(vocab_size, np.int8)
    key = np.full(vocab_size, -1, np.int32)
    keys: dict[str, int] = {}
    for i in range(vocab_size):
        piece = decode_one(i)
        if starts_word(piece):
            cls[i] = WORD_PIECE
        elif piece[:1].isspace() and piece.lstrip()[:1].isalpha():
            cls[i] = WORD_START
        word = piece.strip().lower()
        if cls[i] != WORD_OTHER and word.isalpha():
            key[i] = keys.setdefault(word, len(keys))
    order = np.argsort(key, kind="stable")
    order = order[key[order] >= 0]
    ptr = np.zeros(len(keys) + 1, np.int64)
    np.cumsum(np.bincount(key[order], minlength=len(keys)), out=ptr[1:])
    return WordTable(cls, key, ptr, order.astype(np.int32))


def sentence_end_tokens(decode_one, vocab_size: int):
    """Boolean (V,) array: tokens that, decoded alone, end a sentence ("." "!" '."' " end." ...)."""
    import numpy as np

    return np.array([ends_sentence(decode_one(i)) for i in range(vocab_size)], bool)
