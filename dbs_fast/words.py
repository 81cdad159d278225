"""What a word is, for every rule that counts words (occurrence, constraints, metrics, the CLI's
highlighting): a run of letters or digits. Punctuation and underscores never hide a word."""
from __future__ import annotations

import re

WORD = re.compile(r"[^\W_]+")


def words(text: str) -> list[str]:
    """The words of `text`, lower-cased."""
    return WORD.findall(text.lower())


def starts_word(piece: str) -> bool:
    """Whether `piece` begins with a word character (a token that continues the word before it)."""
    return WORD.match(piece) is not None
