"""What a word and a keyword are, for every rule that counts words (occurrence, constraints,
metrics): a word is a run of letters or digits. Punctuation and underscores never hide a word;
but a token that starts with a letter, a digit or an underscore continues the word before it
("music" + "_making" is one string of text, not a keyword and a new word). A keyword is one or
more alternatives, each a phrase of words (`constraints.parse_keyword` makes them)."""
from __future__ import annotations

import re
from dataclasses import dataclass

WORD = re.compile(r"[^\W_]+")
_JOINS = re.compile(r"\w")                 # letters, digits and the underscore


def words(text: str) -> list[str]:
    """The words of `text`, lower-cased."""
    return WORD.findall(text.lower())


def starts_word(piece: str) -> bool:
    """Whether `piece`, written right after a word, continues it: it begins with a letter, a digit
    or an underscore."""
    return _JOINS.match(piece) is not None


def lemmas(word: str) -> set[str]:
    """The word and every lemma lemminflect gives it (any part of speech)."""
    from lemminflect import getAllLemmas

    w = word.lower()
    return {w} | {lem.lower() for forms in getAllLemmas(w).values() for lem in forms}


@dataclass(frozen=True)
class Keyword:
    text: str                                      # normalised: "ice cream|gelato"
    alternatives: tuple[tuple[str, ...], ...]      # (("ice", "cream"), ("gelato",))

    @property
    def phrases(self) -> list[str]:
        """Each alternative as written (words joined by spaces)."""
        return self.text.split("|")


def word_loop(text: str, times: int = 3, window: int = 5) -> bool:
    """Whether some word occurs `times` times within `window` consecutive words of `text`."""
    ws = words(text)
    spans = (ws[i:i + window] for i in range(max(len(ws) - window + 1, 1)))
    return any(span.count(w) >= times for span in spans for w in set(span))
