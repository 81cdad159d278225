"""What a word is, for every rule that counts words (occurrence, constraints, metrics, the CLI's
highlighting): a run of letters or digits. Punctuation and underscores never hide a word; but a
token that starts with a letter, a digit or an underscore continues the word before it
("music" + "_making" is one string of text, not a keyword and a new word)."""
from __future__ import annotations

import re

WORD = re.compile(r"[^\W_]+")
_JOINS = re.compile(r"\w")                 # letters, digits and the underscore


def words(text: str) -> list[str]:
    """The words of `text`, lower-cased."""
    return WORD.findall(text.lower())


def starts_word(piece: str) -> bool:
    """Whether `piece`, written right after a word, continues it: it begins with a letter, a digit
    or an underscore."""
    return _JOINS.match(piece) is not None
