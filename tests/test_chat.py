"""Chat templates rendered with sandboxed Jinja, without transformers."""
from __future__ import annotations

import json

import pytest

from dbs_fast.errors import DBSError
from dbs_fast.text.chat import ChatTemplate

pytest.importorskip("jinja2")

# SmolLM2-Instruct's template as its export carries it (chat_template.jinja)
SMOLLM2 = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
           "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
           "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
           "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def test_a_known_template_renders_as_transformers_renders_it(tmp_path):
    (tmp_path / "chat_template.jinja").write_text(SMOLLM2)
    t = ChatTemplate.of(tmp_path)
    assert t.render([{"role": "user", "content": "Hi"}]) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    with_system = t.render([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert with_system == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    # OpenAI's developer messages are the system's instructions, as the template knows them
    assert t.render([{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}]) == with_system


def test_what_the_messages_say_is_the_context_less_the_templates_own_text(tmp_path):
    """`said`: a rendered chat less the template's default system prompt and turn markers around
    the messages; a context the template did not frame comes back as it is."""
    (tmp_path / "chat_template.jinja").write_text(SMOLLM2)
    t = ChatTemplate.of(tmp_path)
    assert t.said(t.render([{"role": "user", "content": "Describe a face."}])) == "Describe a face."
    with_system = t.render([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert "Hugging" not in t.said(with_system) and "Be brief." in t.said(with_system)
    assert t.said("Once upon a time") == "Once upon a time"


def test_the_template_in_tokenizer_config_and_special_tokens(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{{ eos_token }}{% endfor %}",
        "bos_token": "<s>", "eos_token": {"content": "</s>"}}))
    assert ChatTemplate.of(tmp_path).render([{"role": "user", "content": "a"}]) == "<s>a</s>"
    assert ChatTemplate.of(tmp_path / "nothing-here") is None


def test_bad_messages_and_a_refusing_template_are_bad_input(tmp_path):
    (tmp_path / "chat_template.jinja").write_text(
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}ok")
    t = ChatTemplate.of(tmp_path)
    with pytest.raises(DBSError, match="role"):
        t.render([{"role": "robot", "content": "x"}])
    with pytest.raises(DBSError, match="user first") as e:
        t.render([{"role": "assistant", "content": "x"}])
    assert e.value.field == "messages"
    (tmp_path / "chat_template.jinja").write_text("{{ ''.__class__.__mro__ }}")      # the sandbox holds
    with pytest.raises(DBSError, match="refused"):
        ChatTemplate.of(tmp_path).render([{"role": "user", "content": "x"}])
