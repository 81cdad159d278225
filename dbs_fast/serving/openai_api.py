"""OpenAI-compatible endpoints over the service: /v1/models, /v1/completions, /v1/chat/completions.

The standard fields map onto the engine's: `prompt` (or `messages`, through the model's chat
template) is the context (token ids: the text they decode to; a list of prompts: a job each, their
choices in one answer or one stream, prompt i's indexed from i * n),
`max_tokens` is `max_new_tokens`, `temperature`, `top_p` and `seed` are the engine's, `stop` cuts the text at the
first stop sequence, a completion's `echo` puts the prompt before its text, `n` returns that many
distinct beams (with the engine's `stop_at: sentence` or `eos`, n finished answers: `finished` is
raised to n). The constraints and every DBS option are extra body fields (the SDK's `extra_body`), named
as in /v1/generate: `keywords`, `ban`, `order`, `guarantee`, `beams`, `lambda`, ...; `task`
("commongen") starts from a task preset; the engine's own stop rule is `stop_at` ("sentence", "eos"
or "max"; the chat door's is "eos"). A standard field the engine cannot honour is a 400 naming it.

Streaming sends only text that no later chunk can change (the common prefix of the request's
surviving beams, `search.beam.certain_text`), so a delta is never revised; each prompt's last chunk
carries the rest of its winning beam, and after every prompt's, `data: [DONE]`.
"""
from __future__ import annotations

import copy
import functools
import json
import time
import uuid
from pathlib import Path
from typing import Any, Optional, Union

from ..config import JSON_NAMES, MAX_LOGPROBS, preset
from ..errors import DBSError
from ..home import EMBEDDED_DIRS
from ..search.result import GenerationResult
from ..text.chat import ChatTemplate
from .bodies import body_config, given_options, option_fields

# the options sent as extra body fields (named by `config.door_name(.., "openai")`): all but those
# OpenAI's standard fields set
EXTRA = tuple(name for name in JSON_NAMES if name not in ("max_new_tokens", "temperature", "top_p", "logprobs"))
# standard fields the engine cannot honour, with the values that ask for nothing
UNSUPPORTED = {"echo": (None, False), "best_of": (None, 1),      # echo: chat's (a completion's is honoured)
               "suffix": (None, ""), "tools": (None, []), "tool_choice": (None, "none"),
               "functions": (None, []), "function_call": (None, "none"), "response_format": (None, {"type": "text"}),
               "store": (None, False), "parallel_tool_calls": (None, True, False), "service_tier": (None, "auto", "default")}
_TOOLS = ("tool and function calling are not supported: Directed Beam Search writes free text around the "
          "keywords")
# why each is refused, in the words a user can act on
WHY_UNSUPPORTED = {
    "echo": "`echo` is a completion's: a chat answer holds the assistant's message only",
    "best_of": "`best_of` is not supported: the search keeps `beams` (an extra field) and returns the best; "
               "`n` returns more than one",
    "suffix": "`suffix` (insertion) is not supported: the text continues the prompt",
    "tools": _TOOLS, "tool_choice": _TOOLS, "functions": _TOOLS, "function_call": _TOOLS,
    "response_format": "only `{\"type\": \"text\"}` is supported: the answer is free text, not JSON",
    "store": "completions are not stored here: `store` must be false",
    "parallel_tool_calls": _TOOLS,
    "service_tier": "one service tier is served: `service_tier` \"auto\" or \"default\"",
}


def _common_fields(max_n: int) -> dict:
    from pydantic import Field

    return {
        "model": (str, Field(..., description="the served model (GET /v1/models)")),
        "max_tokens": (Optional[int], Field(None, description="new tokens at most (max_new_tokens), >= 1")),
        "max_completion_tokens": (Optional[int], Field(None, description="the same as max_tokens")),
        "temperature": (Optional[float], Field(None, description=">= 0; 0 is deterministic: the likeliest tokens, "
                                                                   "rows of one history taking them in turn; under "
                                                                   "0.01 draws at 0.01")),
        "top_p": (Optional[float], Field(None, description="nucleus mass, in (0, 1]")),
        "n": (int, Field(1, ge=1, le=max_n, description="choices returned, at most the beams searched: their distinct "
                                                   "texts, repeated in turn where they hold fewer")),
        "stream": (bool, False),
        "stream_options": (Optional[dict], None),
        "seed": (Optional[int], Field(None, description="0..2**63-1; the same seed gives the "
                                                                           "same text")),
        "stop": (Optional[Union[str, list[str]]], Field(None, description="up to 4 stop sequences")),
        "logprobs": (Optional[Union[bool, int]], Field(None, description="chat: true to return each token's "
                                                                        "log-probability; completions: the "
                                                                        "alternatives returned beside each (0..20)")),
        "top_logprobs": (Optional[int], Field(None, description="chat, with logprobs: the alternatives returned "
                                                                 "beside each token (0..20)")),
        "user": (Optional[str], None),
        "metadata": (Optional[dict[str, str]], Field(None, description="read and not kept (nothing is stored)")),
        "keywords": (Optional[Union[str, list[str]]], Field(None, description='the words the text must contain: '
                                                                             '"enemy,speed" or a list')),
        "ban": (Optional[Union[str, list[str]]], Field(None, description="words that must not appear")),
        "task": (Optional[str], Field(None, description="a task preset: commongen")),
        "paper": (bool, Field(False, description="start from the paper's settings")),
        "timeout": (Optional[float], Field(None, gt=0, description="seconds; at most the server's timeout option")),
        **{k: (Optional[Any], None) for k in UNSUPPORTED},
        **option_fields("openai", EXTRA),
    }


@functools.cache
def completion_model(max_n: int = 64):
    from pydantic import Field, create_model

    return create_model("CompletionRequest", __config__=body_config(populate_by_name=True),
                        prompt=(Union[str, list[str], list[int], list[list[int]]],
                                Field(..., description="the text to continue, or its token ids (read as the text "
                                                       "they decode to), or a list of either: prompt i's "
                                                       "choices indexed from i * n")),
                        **{**_common_fields(max_n),
                           "echo": (Optional[bool], Field(None, description="true: each choice's text starts with "
                                                                            "its prompt (streamed: the first "
                                                                            "chunk)"))})


@functools.cache
def chat_model(max_n: int = 64):
    from pydantic import Field, create_model

    return create_model("ChatCompletionRequest", __config__=body_config(populate_by_name=True),
                        messages=(list[dict], Field(..., description="[{role, content}], through the model's "
                                                                     "chat template")),
                        **_common_fields(max_n))


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error object: every answer of /v1/* that is not a success has this shape."""
    kind = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
            429: "rate_limit_error"}.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class Refused(DBSError):
    """Bad input the OpenAI endpoints answer with a status of its own (400 unless `status`: a field
    the engine cannot honour; 404: a model not served), in OpenAI's error shape."""

    def __init__(self, field: str, msg: str, status: int = 400):
        super().__init__(msg, field, None)
        self.status = status

    def body(self) -> dict:
        return error_body(self.status, str(self), self.field)


def served_name(model: str) -> str:
    return model if model in EMBEDDED_DIRS else Path(model).expanduser().name


def models_list(model: str) -> dict:
    return {"object": "list", "data": [{"id": served_name(model), "object": "model", "created": 0,
                                        "owned_by": "dbs-fast"}]}


def prompt_texts(prompt, tokenizer) -> list[str]:
    """A completion's `prompt` as texts: a string, a list of strings, token ids (a list of ints)
    or a list of token-id lists, the ids read as the text they decode to with `tokenizer` (the
    model's), special tokens kept; Refused for an id outside its vocabulary."""
    if isinstance(prompt, str):
        return [prompt]
    if prompt and all(isinstance(p, int) for p in prompt):
        prompt = [prompt]
    if tokenizer is None and any(not isinstance(p, str) for p in prompt):
        raise Refused("prompt", "`prompt` takes text here, not token ids")
    size = tokenizer.get_vocab_size(with_added_tokens=True) if tokenizer is not None else 0
    texts = []
    for p in prompt:
        if isinstance(p, str):
            texts.append(p)
            continue
        if not p or any(not 0 <= i < size for i in p):
            raise Refused("prompt", f"`prompt`: token ids must be in 0..{size - 1}, at least one a prompt")
        texts.append(tokenizer.decode(p, skip_special_tokens=False))
    return texts


def job_arguments(body, model: str, beams_default: int, template: ChatTemplate | None, chat: bool,
                  max_prompts: int = 1, tokenizer=None) -> dict:
    """What `Service.make_job` takes, from a completion or chat body, but `contexts` (a list: one
    job each, a completion's `prompt` list of up to `max_prompts`; 1 in a batch file) for its
    `context`; `tokenizer`: the model's, which reads a prompt given as token ids; Refused for what
    cannot be honoured."""
    if body.model not in (served_name(model), model):
        raise Refused("model", f"model {body.model!r} is not served here; GET /v1/models lists "
                               f"{served_name(model)!r}", 404)
    for name, harmless in UNSUPPORTED.items():
        if name == "echo" and not chat:
            continue
        v = getattr(body, name)
        if not any(v == h and type(v) is type(h) for h in harmless):
            raise Refused(name, f"`{name}`: {WHY_UNSUPPORTED[name]}")
    alternatives = logprobs_asked(body, chat)
    if not chat and body.echo and alternatives is not None:
        raise Refused("echo", "`echo` with `logprobs` would need the prompt's log-probabilities, which the decode "
                              "graph does not return (it reads the last position's logits): ask for one of them")
    try:
        base, _ = preset(body.task, body.paper, chat)     # an unknown task, or two presets: a 400
    except DBSError as e:
        raise Refused(e.field, str(e)) from None
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stops) > 4 or any(not s for s in stops):
        raise Refused("stop", "`stop` takes up to 4 non-empty sequences")
    if chat:
        if template is None:
            raise Refused("messages", "this model has no chat template: use /v1/completions")
        if not body.messages:
            raise Refused("messages", "`messages` must hold at least one message")
        contexts = [template.render(body.messages)]
    else:
        contexts = prompt_texts(body.prompt, tokenizer)
        if not contexts or len(contexts) > max_prompts:
            raise Refused("prompt", f"`prompt` takes a string or a list of 1 to {max_prompts} prompts" if max_prompts > 1
                          else "`prompt` takes one string in a batch file (or a list of one): a line for each prompt")
    given = given_options(body, "openai", EXTRA)
    given.update(temperature=body.temperature, top_p=body.top_p, logprobs=alternatives,
                 max_new_tokens=body.max_tokens if body.max_tokens is not None else body.max_completion_tokens)
    beams = base.beams if given.get("beams") is None else given["beams"]
    if beams >= 1 and body.n > beams:                # (beams < 1 is refused with the config, naming beams)
        raise Refused("n", f"`n` ({body.n}) is more than the beams searched ({beams})")
    if body.n > (given.get("finished") or base.finished):
        given["finished"] = body.n                   # n finished answers to return, not beams cut mid-sentence
    return {"contexts": contexts, "keywords": body.keywords, "ban": body.ban,
            "seed": 0 if body.seed is None else body.seed, "given": given, "base": base, "timeout": body.timeout,
            "stream": body.stream, "door": "openai", "context_field": "messages" if chat else "prompt",
            "stops": stops}


def logprobs_asked(body, chat: bool) -> int | None:
    """The alternatives a body asks for beside each token's log-probability (None: no
    log-probabilities): chat's `logprobs` (true or false) and `top_logprobs`, a completion's
    `logprobs` (an integer; OpenAI's takes up to 5, vLLM's up to 20); streamed with the text."""
    lp, top = body.logprobs, body.top_logprobs
    if chat:
        if lp is not None and not isinstance(lp, bool):
            raise Refused("logprobs", "`logprobs` takes true or false here (`top_logprobs` the alternatives)")
        if top is not None and not 0 <= top <= MAX_LOGPROBS:
            raise Refused("top_logprobs", f"`top_logprobs` takes an integer in 0..{MAX_LOGPROBS}")
        if top and not lp:
            raise Refused("top_logprobs", "`top_logprobs` needs `logprobs: true`")
        asked = (top or 0) if lp else None
    else:
        if top:
            raise Refused("top_logprobs", "`top_logprobs` is chat's: a completion's `logprobs` is the number of "
                                          "alternatives")
        if lp is not None and (isinstance(lp, bool) or not 0 <= lp <= MAX_LOGPROBS):
            raise Refused("logprobs", f"`logprobs` takes an integer in 0..{MAX_LOGPROBS} here: the alternatives "
                                      f"returned beside each token")
        asked = lp
    return asked


def cut_at_stop(text: str, stops: list[str]) -> tuple[str, bool]:
    """`text` up to the first stop sequence, and whether one was found."""
    cuts = [i for i in (text.find(s) for s in stops) if i >= 0]
    return (text[:min(cuts)], True) if cuts else (text, False)


def safe_prefix(text: str, stops: list[str]) -> str:
    """The part of a growing `text` that is final under `stops`: cut at a stop sequence, and
    without a tail that could still become the start of one."""
    text, found = cut_at_stop(text, stops)
    if found or not stops:
        return text
    hold = max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
    return text[:len(text) - hold]


class Reply:
    """The OpenAI-shaped answer of one request: the final JSON, or the stream's chunks."""

    def __init__(self, chat: bool, model: str, stops: list[str], n: int, echo: bool = False):
        self.chat, self.model, self.stops, self.n, self.echo = chat, model, stops, n, echo
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.sent, self.tokens_sent = "", 0       # a stream's text and log-prob entries sent so far
        self.first = 0                            # the index of this prompt's first choice (i * n)

    def prompt(self, i: int) -> "Reply":
        """The stream of a list's prompt `i`: the same answer (id, created), its own text sent so far,
        its choices indexed from i * n."""
        other = copy.copy(self)
        other.sent, other.tokens_sent, other.first = "", 0, i * self.n
        return other

    @classmethod
    def answering(cls, body, chat: bool, stops: list[str]) -> "Reply":
        """The reply to a validated body (`job_arguments` has refused what cannot be honoured)."""
        return cls(chat, body.model, stops, body.n, echo=not chat and bool(body.echo))

    def _finish(self, stopped: str, cut: bool) -> str:
        return "stop" if cut or stopped in ("sentence", "eos", "trimmed") else "length"

    @staticmethod
    def usage(result: GenerationResult) -> dict:
        prompt, new = result.prompt_tokens, result.new_tokens
        return {"prompt_tokens": prompt, "completion_tokens": new, "total_tokens": prompt + new}

    @staticmethod
    def dbs(result: GenerationResult) -> dict:
        return {"keywords": result.keywords, "found": {k: v is not None for k, v in result.found.items()},
                "success_rate": result.success_rate, "stopped": result.stopped, "seconds": result.seconds,
                "candidate_tokens": result.candidate_tokens}

    def final(self, results: list[GenerationResult]) -> dict:
        """The answer to one request: prompt i's choices are indexed from i * n (OpenAI's order for a
        list of prompts), the usage summed, `dbs` one object (a list of them for several prompts)."""
        choices = []
        for i, result in enumerate(results):
            choices += [{**c, "index": i * self.n + c["index"]} for c in self._choices(result)]
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": choices, **self._totals(results)}

    def _totals(self, results: list[GenerationResult]) -> dict:
        """`usage` summed over the prompts' results, and `dbs`: one object, or a list for several."""
        usage = [self.usage(r) for r in results]
        dbs = [self.dbs(r) for r in results]
        return {"usage": {k: sum(u[k] for u in usage) for k in usage[0]}, "dbs": dbs if len(dbs) > 1 else dbs[0]}

    def _choices(self, result: GenerationResult) -> list[dict]:
        """n choices of one result: the winner, then the other beams' distinct texts, the finished
        first; where the beams hold fewer (they converged, as beams kept twice do), those texts
        again in turn, as OpenAI's n samples may repeat: a client reads n choices."""
        beams = [result.beams[0]] + sorted(result.beams[1:], key=lambda b: not b["finished"])
        texts = [result.generated] + [b["text"] for b in beams[1:]]
        tokens = [result.logprobs] + [b.get("logprobs") for b in beams[1:]]
        seen, choices = set(), []
        for i, t in enumerate(texts):
            text, cut = cut_at_stop(t, self.stops)
            if text in seen:
                continue
            seen.add(text)
            stopped = result.stopped if i == 0 else "sentence" if beams[i]["finished"] else "max"
            finish = self._finish(stopped, cut)
            choices.append({"index": len(choices), "finish_reason": finish, "logprobs": self._logprobs(tokens[i], text),
                            **({"message": {"role": "assistant", "content": text}} if self.chat else
                               {"text": result.context + text if self.echo else text})})
            if len(choices) == self.n:
                break
        distinct = len(choices)
        choices += [{**choices[i % distinct], "index": i} for i in range(distinct, self.n)]
        return choices

    def _logprobs(self, tokens: list | None, text: str, first: int = 0) -> dict | None:
        """A choice's `logprobs` in OpenAI's shape (chat's `content`, or a completion's `tokens`,
        `token_logprobs`, `top_logprobs` with the token itself among them, `text_offset`), for the
        tokens that begin inside `text` (a stop sequence may have cut it) from the `first` on; None
        where none were asked."""
        if tokens is None:
            return None
        kept, at = [], 0
        for e in tokens:
            if at >= len(text):
                break
            kept.append((at, e))
            at += len(e["token"])
        kept = kept[first:]
        if self.chat:
            def entry(e):
                return {"token": e["token"], "logprob": e["logprob"], "bytes": list(e["token"].encode())}

            return {"content": [{**entry(e), "top_logprobs": [entry(a) for a in e["top"]]} for _, e in kept],
                    "refusal": None}
        return {"tokens": [e["token"] for _, e in kept], "token_logprobs": [e["logprob"] for _, e in kept],
                "top_logprobs": [{**{a["token"]: a["logprob"] for a in e["top"]}, e["token"]: e["logprob"]}
                                 for _, e in kept],
                "text_offset": [at for at, _ in kept]}

    def _streamed_logprobs(self, tokens: list | None) -> dict | None:
        """The `logprobs` of a stream's chunk: the tokens that begin inside the text sent so far and
        were not sent before (so the chunks' entries, joined, are the unstreamed answer's)."""
        if tokens is None:
            return None
        out = self._logprobs(tokens, self.sent, self.tokens_sent)
        self.tokens_sent += len(out["content" if self.chat else "tokens"])
        return out

    def _chunk(self, delta: str | None, finish: str | None = None, role: bool = False,
               logprobs: dict | None = None, index: int = 0) -> str:
        if self.chat:
            d = {"role": "assistant"} if role else {}
            if delta:
                d["content"] = delta
            choice = {"index": self.first + index, "delta": d, "finish_reason": finish, "logprobs": logprobs}
        else:
            choice = {"index": self.first + index, "text": delta or "", "finish_reason": finish, "logprobs": logprobs}
        obj = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
               "created": self.created, "model": self.model, "choices": [choice]}
        return f"data: {json.dumps(obj)}\n\n"

    def start(self, prompt: str = "") -> str | None:
        """A stream's first chunk: chat's role, or a completion's prompt where it is echoed."""
        if self.chat:
            return self._chunk(None, role=True)
        return self._chunk(prompt) if self.echo and prompt else None

    def certain(self, text: str, tokens: list | None = None) -> str | None:
        """A chunk with the new certain text, if any: appended to what was sent, never revised;
        with `tokens` (the certain tokens' `logprobs` entries, where asked) those it begins."""
        text = safe_prefix(text, self.stops)
        if len(text) <= len(self.sent) or not text.startswith(self.sent):
            return None
        delta, self.sent = text[len(self.sent):], text
        return self._chunk(delta, logprobs=self._streamed_logprobs(tokens))

    def end(self, result: GenerationResult) -> list[str]:
        """The rest of the winning beam with its finish reason (and its tokens' log-probs where
        asked); with `n`, each other choice whole in a chunk of its own (the beams are chosen at
        the end)."""
        text, cut = cut_at_stop(result.generated, self.stops)
        rest = text[len(self.sent):] if text.startswith(self.sent) else ""
        self.sent += rest
        out = [self._chunk(rest, self._finish(result.stopped, cut), logprobs=self._streamed_logprobs(result.logprobs))]
        for c in self._choices(result)[1:] if self.n > 1 else []:
            whole = c["message"]["content"] if self.chat else c["text"]
            out.append(self._chunk(whole, c["finish_reason"], role=self.chat, logprobs=c["logprobs"], index=c["index"]))
        return out

    def close(self, results: list[GenerationResult], include_usage: bool) -> list[str]:
        """A stream's end, once every prompt's result is sent: the usage if asked (summed over the
        prompts, as `final` has it), then [DONE]."""
        out = []
        if include_usage:
            obj = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                   "created": self.created, "model": self.model, "choices": [], **self._totals(results)}
            out.append(f"data: {json.dumps(obj)}\n\n")
        return out + ["data: [DONE]\n\n"]

    @staticmethod
    def error(status: int, detail) -> list[str]:
        return [f"data: {json.dumps(error_body(status, str(detail)))}\n\n", "data: [DONE]\n\n"]
