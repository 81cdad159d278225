"""The hidden prompt: text the model reads before the user's context, naming the keywords.

The output still continues the user's context (the result's text is the context and what follows
it); the prompt is never part of it. Styles (`DBSConfig.prompt_style`):

- `none`: the context alone (the concepts reach the text only through guidance);
- `instruction`: one line naming the words, before the context;
- `chat`: the model's chat template (rendered with Jinja, `dbs_fast.text.chat`) with that instruction
  as the user's turn; the context opens the assistant's answer;
- `few-shot`: worked examples from CommonGen's training split (`data/commongen_train_pool.tsv`,
  never dev or test; `shots` of them), each its words and a sentence, then the request's words
  and the context.

Every style's text depends only on the keywords and the context, so requests with the same
prompt share its tokens (a prefix cache can keep them).
"""
from __future__ import annotations

from functools import lru_cache
from importlib.resources import files

from ..config import PROMPT_STYLES
from ..errors import DBSError
from .constraints import Keyword


def _words(keywords: list[str]) -> str:
    return keywords[0] if len(keywords) == 1 else ", ".join(keywords[:-1]) + " and " + keywords[-1]


def instruction(keywords: list[str]) -> str:
    return f"Write a short, natural text that uses the words {_words(keywords)}."


@lru_cache(maxsize=1)
def train_pool() -> list[tuple[list[str], str]]:
    """(concepts, sentence) pairs of CommonGen train, in the packaged (seeded) order."""
    text = files("dbs_fast").joinpath("data/commongen_train_pool.tsv").read_text(encoding="utf-8")
    return [(c.split(), s) for c, s in (line.split("\t") for line in text.splitlines() if line)]


def few_shot(keywords: list[str], context: str, shots: int = 3) -> str:
    """`shots` examples, each "Words: ..." then its sentence after the context where the context
    can lead into a sentence (empty, or ending in a space or a line break), then the request's words."""
    lead = context if not context or context[-1].isspace() else ""
    examples = "".join(f"Words: {', '.join(c)}\n{lead}{s}\n\n" for c, s in train_pool()[:shots])
    return f"{examples}Words: {', '.join(keywords)}\n"


def prompt_text(style: str, keywords: list[Keyword], context: str, template=None, shots: int = 3) -> str:
    """The text before `context` for `style` (the first alternative of each keyword names it)."""
    words = [k.phrases[0] for k in keywords]
    if style == "none":
        return ""
    if style == "instruction":
        return instruction(words) + "\n"
    if style == "few-shot":
        return few_shot(words, context, shots)
    if style == "chat":
        if template is None:
            raise DBSError("prompt style 'chat' needs a model with a chat template (this export has none)",
                           "prompt_style", style)
        return template.render([{"role": "user", "content": instruction(words)}])
    raise DBSError.about("prompt_style", f"must be one of {PROMPT_STYLES}", style)
