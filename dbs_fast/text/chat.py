"""A model's chat template (`chat_template.jinja`, or `chat_template` in `tokenizer_config.json`,
as transformers saves them) rendered with Jinja in a sandbox, without transformers."""
from __future__ import annotations

import json
from datetime import datetime
from functools import cached_property
from pathlib import Path

from ..errors import DBSError

ROLES = ("system", "developer", "user", "assistant")
AS_ROLE = {"developer": "system"}      # OpenAI's developer messages are the system's instructions
SENTINEL = "\x00"      # a message text no template writes itself


class ChatTemplate:
    def __init__(self, source: str, special: dict):
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals.update(raise_exception=raise_exception,
                           strftime_now=lambda fmt: datetime.now().strftime(fmt))
        self.template, self.special = env.from_string(source), special

    @classmethod
    def of(cls, model_dir: Path) -> "ChatTemplate | None":
        """The template an export carries, or None."""
        d = Path(model_dir)
        config = {}
        if (d / "tokenizer_config.json").is_file():
            config = json.loads((d / "tokenizer_config.json").read_text())
        source = (d / "chat_template.jinja").read_text() if (d / "chat_template.jinja").is_file() \
            else config.get("chat_template")
        if isinstance(source, list):                 # named templates: the default one
            source = next((t["template"] for t in source if t.get("name") == "default"), None)
        if not source:
            return None
        special = {k: _token_text(config.get(k)) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
        return cls(source, special)

    def render(self, messages: list[dict]) -> str:
        """The prompt of `messages` ({"role", "content"}), ending where the assistant's turn starts."""
        from jinja2 import TemplateError

        plain = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in ROLES:
                raise DBSError(f"messages[{i}] must have a role in {ROLES}", "messages", m)
            plain.append({**m, "role": AS_ROLE.get(m["role"], m["role"]), "content": text_content(m.get("content"), i)})
        try:
            return self.template.render(messages=plain, add_generation_prompt=True, **self.special)
        except TemplateError as e:
            raise DBSError(f"the model's chat template refused these messages: {e}", "messages", None) from None

    @cached_property
    def _frame(self) -> tuple[str, str]:
        """The template's own text before and after a one-message conversation's message."""
        head, _, tail = self.render([{"role": "user", "content": SENTINEL}]).partition(SENTINEL)
        return head, tail

    def said(self, context: str) -> str:
        """What the messages of a rendered `context` say: the context less the template's own text
        before the first message and after the last (SmolLM2's default system prompt, "You are a
        helpful AI assistant named SmolLM, trained by Hugging Face", and the turn markers), as a
        one-message conversation frames them; a context framed otherwise as it is."""
        head, tail = self._frame
        if head and context.startswith(head):
            context = context[len(head):]
        return context[:-len(tail)] if tail and context.endswith(tail) else context


def text_content(content, i: int) -> str:
    """A message's content as text: a string, or OpenAI's content parts, whose text parts
    ({"type": "text", "text": ...}) are joined; any other part (an image, audio) is refused, named."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not content:
        raise DBSError(f"messages[{i}].content must be a string or a list of content parts", "messages", content)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            raise DBSError(f"messages[{i}].content[{j}] is a part of type {kind or type(part).__name__!r}: only text parts "
                           f'({{"type": "text", "text": ...}}) are read', "messages", part)
        texts.append(part["text"])
    return "\n".join(texts)


def _token_text(token) -> str:
    if isinstance(token, dict):                      # an AddedToken as transformers saves it
        return token.get("content", "")
    return token or ""
