"""Subject phrases that open a one-sentence task's candidates (NeuroLogic's zero-shot CommonGen
seeds beams so: "The man", "A kid"): "The {concept}" and "A {concept}" for each one-word
concept, then people in general (after a chat, only the words the user's message leaves out, as
an assistant's answer opens with its subject, not with "A man"). The search's first chunk draws
one candidate from each, besides its free ones, and the quality score keeps the best b, as in any
chunk."""
from __future__ import annotations

# people in general: the subjects of everyday scenes when no concept is one
PEOPLE = ("A man", "A woman", "The man", "The woman", "A boy", "A girl", "A person", "People")


def subject_phrases(keywords: list[str], limit: int, people: bool = True) -> list[str]:
    """At most `limit` distinct opening phrases for `keywords`, the concepts' own first, then
    (`people`) people in general."""
    own = []
    for k in keywords:
        w = k.strip()
        if w.isalpha() and w.islower():
            own += [f"The {w}", f"{'An' if w[0] in 'aeiou' else 'A'} {w}"]
    return list(dict.fromkeys(own + list(PEOPLE if people else ())))[:max(0, limit)]


def opening_text(context: str, phrase: str) -> str:
    """The context with `phrase` after it: a space between them unless the context ends in one."""
    return context + phrase if not context or context[-1].isspace() else f"{context} {phrase}"
