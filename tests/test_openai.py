"""The OpenAI-compatible endpoints through the real `openai` SDK, over loopback, with an API key."""
from __future__ import annotations

import json
import threading
import time

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from conftest import GPT2_VOCAB  # noqa: E402
from test_service import Server, _wait  # noqa: E402

from dbs_fast.api import DirectedBeamSearch  # noqa: E402
from dbs_fast.serving.service import ServiceOptions, create_app  # noqa: E402

KEY = "test-key"
SMALL = {"beams": 3, "candidates": 3, "chunk": 3}


@pytest.fixture(scope="module")
def model_dir(chat_model_dir):
    return chat_model_dir


@pytest.fixture(scope="module")
def server(model_dir):
    dbs = DirectedBeamSearch(model_dir)
    s = Server(create_app(ServiceOptions(model=str(model_dir), max_rows=24, max_queue=8, api_key=KEY),
                          dbs=dbs)).wait_ready()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def _name(client) -> str:
    return client.models.list().data[0].id


def test_models_lists_the_served_model(client, model_dir):
    assert [m.id for m in client.models.list().data] == [model_dir.name]


def test_completion_with_keywords_as_extra_body(client):
    r = client.completions.create(model=_name(client), prompt="It is", max_tokens=16, seed=1,
                                  extra_body={"keywords": ["colony", "enemy"], "guarantee": True, **SMALL})
    text = r.choices[0].text
    assert "colon" in text.lower() and "enem" in text.lower(), text
    assert r.usage.completion_tokens > 0 and r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    dbs = r.model_extra["dbs"]
    assert dbs["found"] == {"colony": True, "enemy": True} and dbs["success_rate"] == 1.0
    assert dbs["candidate_tokens"] > 0 and dbs["seconds"] > 0


@GPT2_VOCAB
def test_chat_goes_through_the_models_template(client, server):
    r = client.chat.completions.create(model=_name(client), messages=[{"role": "user", "content": "Tell me"}],
                                       max_tokens=16, seed=2,
                                       extra_body={"keywords": "river", "guarantee": True, **SMALL})
    msg = r.choices[0].message
    assert msg.role == "assistant" and "river" in msg.content.lower()
    # the rendered prompt is the context: the same text as /v1/generate given that context and the
    # chat door's preset
    from dbs_fast.config import JSON_NAMES, DBSConfig

    chat = DBSConfig.chat(guarantee=True, max_new_tokens=16, **SMALL).to_dict()
    plain = httpx.post(server.url + "/v1/generate", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                       json={"context": "<|user|>Tell me\n<|assistant|>", "keywords": "river", "seed": 2,
                             **{j: chat[f] for f, j in JSON_NAMES.items()}}).json()
    assert plain["generated"] == msg.content and r.usage.prompt_tokens == plain["prompt_tokens"]


@pytest.mark.parametrize("raw,param", [(b'{"keywords": "colony",', "body"), (b"[1, 2]", "body"),
                                       (b'{"keywords": "colony", "bogus": 1}', "bogus"),
                                       (b'{"keywords": "colony,,enemy"}', "keywords")])
def test_every_door_answers_the_same_bad_body_in_one_shape(server, raw, param):
    """The same bad body sent to /v1/generate, /v1/completions and /v1/chat/completions: one status
    (400), OpenAI's error object, `param` naming the field (the body itself when it is not JSON or
    not an object)."""
    auth = {"Authorization": f"Bearer {KEY}", "content-type": "application/json"}
    got, model = {}, httpx.get(server.url + "/v1/models", headers=auth).json()["data"][0]["id"].encode()
    for path, extra in (("/v1/generate", b""), ("/v1/completions", b'"prompt": "It is", "model": "%s", ' % model),
                        ("/v1/chat/completions",
                         b'"messages": [{"role": "user", "content": "Hi"}], "model": "%s", ' % model)):
        body = raw if not raw.startswith(b"{") or not extra else b"{" + extra + raw[1:]
        r = httpx.post(server.url + path, content=body, headers=auth, timeout=30)
        assert set(r.json()) == {"error"}, (path, r.text)
        got[path] = (r.status_code, r.json()["error"]["param"], r.json()["error"]["type"])
        said = r.json()["error"]["message"]
        assert param != "bogus" or said == "`bogus`: not a field of this endpoint (its fields: the service's /docs " \
                                           "and /openapi.json)", said
    assert set(got.values()) == {(400, param, "invalid_request_error")}, got


def test_chat_takes_content_parts_and_refuses_what_is_not_text(client):
    """OpenAI's content parts: text parts are joined and answered as the same message in one
    string; an image part is refused, named."""
    kw = dict(model=_name(client), max_tokens=12, seed=2, extra_body={"keywords": "river", **SMALL})
    parts = [{"type": "text", "text": "Tell"}, {"type": "text", "text": "me"}]
    got = client.chat.completions.create(messages=[{"role": "user", "content": parts}], **kw)
    same = client.chat.completions.create(messages=[{"role": "user", "content": "Tell\nme"}], **kw)
    assert got.choices[0].message.content == same.choices[0].message.content
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(messages=[{"role": "user", "content": [parts[0], image]}], **kw)
    assert e.value.body["param"] == "messages" and "image_url" in e.value.body["message"], e.value.body


@pytest.mark.parametrize("chat", [False, True])
def test_streamed_deltas_join_to_the_same_text(client, chat):
    """Deltas are only text no later chunk can change: joined, they are the non-streamed text."""
    for seed in range(4):
        kw = dict(model=_name(client), max_tokens=24, seed=seed,
                  extra_body={"keywords": ["colony", "mouth"], "stop_at": "max", "stream_lag": 0, **SMALL})
        if chat:
            kw["messages"] = [{"role": "user", "content": "Go"}]
            whole = client.chat.completions.create(**kw).choices[0].message.content
            chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
            deltas = [c.choices[0].delta.content or "" for c in chunks if c.choices]
        else:
            kw["prompt"] = "It is"
            whole = client.completions.create(**kw).choices[0].text
            chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
            deltas = [c.choices[0].text for c in chunks if c.choices]
        assert "".join(deltas) == whole
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0


@pytest.mark.parametrize("chat", [False, True])
def test_a_fixed_lag_streams_text_before_the_end_and_joins_to_the_same_text(client, chat):
    """stream_lag: text older than the lag is committed after each chunk, so a one-sentence answer
    streams in pieces; joined, the deltas are the non-streamed text with the same stream_lag."""
    early = 0
    for seed in range(3):
        kw = dict(model=_name(client), max_tokens=24, seed=seed,
                  extra_body={"keywords": ["colony", "mouth"], "stream_lag": 1, **SMALL})
        if chat:
            kw["messages"] = [{"role": "user", "content": "Go"}]
            whole = client.chat.completions.create(**kw).choices[0].message.content
            deltas = [c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kw)
                      if c.choices]
        else:
            kw["prompt"] = "It is"
            whole = client.completions.create(**kw).choices[0].text
            deltas = [c.choices[0].text for c in client.completions.create(stream=True, **kw) if c.choices]
        assert "".join(deltas) == whole
        early += sum(1 for d in deltas[:-1] if d)             # text that came before the last chunk
    assert early > 0


@pytest.mark.parametrize("chat", [False, True])
def test_streamed_logprobs_join_to_the_unstreamed_answers(client, chat):
    """With `logprobs`, each chunk carries the entries of the tokens its text begins, so the
    chunks' entries joined are the non-streamed choice's, and some come before the last chunk."""
    early = 0
    for seed in range(3):
        kw = dict(model=_name(client), max_tokens=24, seed=seed,
                  extra_body={"keywords": ["colony", "mouth"], "stream_lag": 1, **SMALL})
        if chat:
            kw.update(messages=[{"role": "user", "content": "Go"}], logprobs=True, top_logprobs=2)
            whole = client.chat.completions.create(**kw).choices[0]
            want = [(t.token, t.logprob, [a.token for a in t.top_logprobs]) for t in whole.logprobs.content]
            chunks = [c.choices[0] for c in client.chat.completions.create(stream=True, **kw) if c.choices]
            got = [[(t.token, t.logprob, [a.token for a in t.top_logprobs]) for t in c.logprobs.content]
                   for c in chunks if c.logprobs]
            text = "".join(c.delta.content or "" for c in chunks)
            assert text == whole.message.content
        else:
            kw.update(prompt="It is", logprobs=2)
            whole = client.completions.create(**kw).choices[0]
            lp = whole.logprobs
            want = list(zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, lp.text_offset))
            chunks = [c.choices[0] for c in client.completions.create(stream=True, **kw) if c.choices]
            got = [list(zip(c.logprobs.tokens, c.logprobs.token_logprobs, c.logprobs.top_logprobs,
                            c.logprobs.text_offset)) for c in chunks if c.logprobs]
            assert "".join(c.text for c in chunks) == whole.text
        assert [e for part in got for e in part] == want
        assert all(c.logprobs is not None for c in chunks if (c.delta.content if chat else c.text))
        early += sum(len(part) for part in got[:-1])
    assert early > 0


def test_echo_starts_each_choice_with_its_prompt_streamed_or_not(client, model_dir):
    """A completion's `echo`: every choice's text is its prompt then the same generated text
    (a list of prompts each its own, token ids their text); streamed, the prompt is the first
    chunk. With `logprobs` it is refused, naming `echo`; chat refuses it."""
    kw = dict(model=_name(client), max_tokens=12, seed=4, n=2, extra_body={"keywords": "river", **SMALL})
    plain = client.completions.create(prompt="It is", **kw).choices
    echoed = client.completions.create(prompt="It is", echo=True, **kw).choices
    assert [c.text for c in echoed] == ["It is" + c.text for c in plain]
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode("The doctor", add_special_tokens=False).ids
    both = client.completions.create(prompt=[ids, ids], echo=True, **{**kw, "n": 1}).choices
    assert both[0].text.startswith("The doctor") and both[0].text == both[1].text
    one = {**kw, "n": 1}
    chunks = [c.choices[0].text for c in client.completions.create(prompt="It is", echo=True, stream=True, **one)
              if c.choices]
    assert chunks[0] == "It is" and "".join(chunks) == echoed[0].text
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(prompt="It is", echo=True, logprobs=1, **one)
    assert e.value.body["param"] == "echo", e.value.body
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(messages=[{"role": "user", "content": "Hi"}], extra_body={"echo": True},
                                       **{k: v for k, v in one.items() if k != "extra_body"})
    assert e.value.body["param"] == "echo", e.value.body


@pytest.mark.parametrize("chat", [False, True])
def test_n_choices_come_back_where_the_beams_converged(chat):
    """`n` gives n choices: the beams' distinct texts first, then (beams kept twice converge on
    one text, as a short chat answer's often do) those texts again in turn, as OpenAI's samples
    may repeat; streamed, the others come whole at the end."""
    from types import SimpleNamespace

    from dbs_fast.serving.openai_api import Reply

    beams = [{"text": "A dog runs.", "finished": True}, {"text": "A dog sits.", "finished": False}]
    result = SimpleNamespace(generated="A dog runs.", beams=beams, logprobs=None, stopped="eos", context="It is")
    reply = Reply(chat, "m", [], 5)
    got = [c["message"]["content"] if chat else c["text"] for c in reply._choices(result)]
    assert got == ["A dog runs.", "A dog sits.", "A dog runs.", "A dog sits.", "A dog runs."]
    assert [c["index"] for c in reply._choices(result)] == list(range(5))
    assert [c["finish_reason"] for c in reply._choices(result)] == ["stop", "length"] * 2 + ["stop"]
    ends = [json.loads(e[len("data: "):])["choices"][0] for e in reply.end(result)]
    assert [e["index"] for e in ends] == list(range(5))
    converged = SimpleNamespace(**{**vars(result), "beams": beams[:1]})
    three = Reply(chat, "m", [], 3)._choices(converged)
    assert [c["index"] for c in three] == [0, 1, 2]
    assert {c["message"]["content"] if chat else c["text"] for c in three} == {"A dog runs."}
    # the finished before the beams the budget ended, whatever their scores
    mixed = [*beams, {"text": "A dog ran.", "finished": True}]
    two = Reply(chat, "m", [], 2)._choices(SimpleNamespace(**{**vars(result), "beams": mixed}))
    assert [c["message"]["content"] if chat else c["text"] for c in two] == ["A dog runs.", "A dog ran."]
    assert [c["finish_reason"] for c in two] == ["stop", "stop"]


@pytest.mark.parametrize("chat", [False, True])
def test_a_stream_with_n_sends_each_choice_as_the_unstreamed_answer_has_it(client, chat):
    """`n` streamed: choice 0 streams as it is committed, the others come whole at the end (the
    beams are chosen there); joined by index, the deltas are the unstreamed answer's choices."""
    kw = dict(model=_name(client), max_tokens=24, seed=3, n=2,
              extra_body={"keywords": ["colony", "mouth"], "stream_lag": 1, "stop_at": "max", **SMALL})
    if chat:
        kw["messages"] = [{"role": "user", "content": "Go"}]
        want = [c.message.content for c in client.chat.completions.create(**kw).choices]
        chunks = [c for c in client.chat.completions.create(stream=True, **kw) if c.choices]
        parts = [(c.choices[0].index, c.choices[0].delta.content or "") for c in chunks]
        assert {c.choices[0].index for c in chunks if c.choices[0].delta.role} == {0, 1}
    else:
        kw["prompt"] = "It is"
        want = [c.text for c in client.completions.create(**kw).choices]
        parts = [(c.choices[0].index, c.choices[0].text)
                 for c in client.completions.create(stream=True, **kw) if c.choices]
    assert len(want) == 2
    assert ["".join(t for i, t in parts if i == k) for k in range(2)] == want


def test_a_stream_without_a_lag_takes_the_services_default(client):
    from dbs_fast.serving.service import STREAM_LAG

    kw = dict(model=_name(client), prompt="It is", max_tokens=24, seed=1)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        stream=True, extra_body={"keywords": ["colony", "mouth"], **SMALL}, **kw) if c.choices)
    assert streamed == client.completions.create(
        extra_body={"keywords": ["colony", "mouth"], "stream_lag": STREAM_LAG, **SMALL}, **kw).choices[0].text


def test_n_returns_distinct_choices(client):
    r = client.completions.create(model=_name(client), prompt="It is", max_tokens=12, seed=0, n=3,
                                  extra_body={"keywords": "river", "beams": 4, "candidates": 3, "chunk": 3,
                                              "stop_at": "max"})
    texts = [c.text for c in r.choices]
    assert len(texts) == 3 and len(set(texts)) == len(texts)
    assert [c.index for c in r.choices] == list(range(len(texts)))


def test_n_asks_the_search_for_n_finished_answers(model_dir):
    """`n` above the finished answers a request gathers (`finished`, 1 by default) raises it to n,
    so that a search that stops at a sentence end returns n finished answers (at 1 it ended at the
    first, and n = 2 came back as one choice); each finished answer is a `stop` choice, a beam cut
    at the budget a `length` one."""
    from types import SimpleNamespace

    from dbs_fast.serving.openai_api import Reply, completion_model, job_arguments

    def given(**extra):
        body = completion_model()(model=model_dir.name, prompt="It is", keywords="river", **extra)
        return job_arguments(body, str(model_dir), 7, None, chat=False)["given"]

    assert given(n=3)["finished"] == 3
    assert given(n=2, finished=5)["finished"] == 5 and given().get("finished") is None
    beams = [{"text": t, "finished": f} for t, f in ((" a.", True), (" b.", True), (" c", False))]
    result = SimpleNamespace(generated=" a.", beams=beams, stopped="sentence", prompt_tokens=2, new_tokens=2,
                             keywords=["river"], found={}, success_rate=1.0, seconds=0.1, candidate_tokens=9,
                             logprobs=None)
    choices = Reply(False, "m", [], 3).final([result])["choices"]
    assert [(c["text"], c["finish_reason"]) for c in choices] == [(" a.", "stop"), (" b.", "stop"), (" c", "length")]


@GPT2_VOCAB
def test_stop_sequences_cut_the_text(client):
    kw = dict(model=_name(client), prompt="It is", max_tokens=24, seed=5,
              extra_body={"keywords": "colony", "stop_at": "max", **SMALL})
    whole = client.completions.create(**kw).choices[0].text
    stop = whole[len(whole) // 2: len(whole) // 2 + 2]
    cut = client.completions.create(stop=[stop], **kw).choices[0]
    assert cut.text == whole[:whole.find(stop)] and cut.finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(stop=[stop], stream=True, **kw))
    assert streamed == cut.text


def test_no_key_is_401(server):
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model="x", prompt="It is", extra_body={"keywords": "colony"})
    assert httpx.get(server.url + "/v1/models").status_code == 401
    assert httpx.get(server.url + "/health").status_code == 200          # open unless --auth-health


@pytest.mark.parametrize("extra,field", [({"beams": 0}, "beams"), ({"seed": -1}, "seed"),
                                         ({"max_tokens": 100000}, "max_tokens"), ({"max_tokens": 0}, "max_tokens"),
                                         ({"seed": 2**64}, "seed"), ({"lambda": -1}, "lambda"),
                                         ({"stop_at": "never"}, "stop_at"), ({"min_p": 1.0}, "min_p")])
def test_bad_values_are_400_naming_the_field(client, extra, field):
    standard = {k: extra.pop(k) for k in ("seed", "max_tokens") if k in extra}
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=_name(client), prompt="It is", **standard,
                                  extra_body={"keywords": "colony", **extra})
    assert e.value.body["param"] == field and e.value.body["type"] == "invalid_request_error"


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("extra,field", [({"beams": "7"}, "beams"), ({"guarantee": "yes"}, "guarantee"),
                                         ({"n": 1.0}, "n"), ({"keywords": 5}, "keywords"), ({"bogus": 1}, "bogus"),
                                         ({"seed": -1}, "seed"), ({"prompt": "word " * 300}, "prompt"),
                                         ({"keywords": "colony,qzxvbnmw"}, "keywords")])
def test_every_bad_field_is_openais_error_shape_naming_it(server, path, extra, field):
    """Wrong JSON types are refused, not coerced; pydantic's own errors, the engine's and the
    service's all answer OpenAI's error object with `param` naming the field."""
    body = {"model": "gpt2", "max_tokens": 4, "keywords": "colony", "beams": 2, "candidates": 2, **extra}
    if path.endswith("chat/completions"):
        prompt = body.pop("prompt", "It is")
        body["messages"] = [{"role": "user", "content": prompt}]
        field = "messages" if field == "prompt" else field
    else:
        body.setdefault("prompt", "It is")
    r = httpx.post(server.url + path, json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert 400 <= r.status_code < 500, r.text
    err = r.json()["error"]
    assert set(r.json()) == {"error"} and set(err) == {"message", "type", "param", "code"}
    assert err["param"] == field and err["message"], err


@pytest.mark.parametrize("kw,field,words", [
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "tool and function calling"),
    ({"response_format": {"type": "json_object"}}, "response_format", "free text"),
    ({"logit_bias": {"999999": -100}}, "logit_bias", "token ids"),
    ({"logit_bias": {"198": -101}}, "logit_bias", "-100..100"),
    ({"messages": []}, "messages", "at least one message"),
    ({"extra_body": {"keywords": "x", "task": "commongen", "paper": True}}, "paper", "two presets")])
def test_chat_refusals_give_their_own_reason(client, kw, field, words):
    kw = {"messages": [{"role": "user", "content": "Write."}], "extra_body": {"keywords": "colony"}, **kw}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=_name(client), max_tokens=8, **kw)
    assert e.value.body["param"] == field and words in e.value.body["message"], e.value.body


def test_an_unknown_method_or_path_is_openais_error_shape(server):
    """Under /v1/ and outside it, as OpenAI's own: the URL named, and where to find the endpoints
    or the method that is allowed."""
    headers = {"Authorization": f"Bearer {KEY}"}
    for method, path, status, kind, words in (
            ("GET", "/v1/completions", 405, "invalid_request_error", "(GET /v1/completions): POST is allowed"),
            ("POST", "/v1/embeddings", 404, "not_found_error", "Invalid URL (POST /v1/embeddings)"),
            ("GET", "/nothing", 404, "not_found_error", "/openapi.json")):
        r = httpx.request(method, server.url + path, headers=headers, json={})
        assert r.status_code == status and r.json()["error"]["type"] == kind, r.text
        assert words in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("kw,field", [({"logprobs": 21}, "logprobs"), ({"logprobs": True}, "logprobs"),
                                      ({"temperature": -0.5}, "temperature"),
                                      ({"extra_body": {"keywords": "x", "store": True}}, "store"),
                                      ({"extra_body": {"keywords": "x", "service_tier": "flex"}}, "service_tier"),
                                      ({"presence_penalty": 2.5}, "presence_penalty"),
                                      ({"frequency_penalty": -3}, "frequency_penalty"),
                                      ({"n": 9}, "n"),
                                      ({"extra_body": {"keywords": "x", "task": "poetry"}}, "task")])
def test_what_cannot_be_honoured_is_400_naming_it(client, kw, field):
    kw = {"extra_body": {"keywords": "colony"}, **kw}
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=_name(client), prompt="It is", max_tokens=8, **kw)
    assert e.value.body["param"] == field


def test_presence_and_frequency_penalties_are_honoured(client):
    """OpenAI's penalties reach the draw: the same seeds give other texts with them, and the
    chat door takes them too."""
    kw = dict(model=_name(client), prompt="It is", max_tokens=12, extra_body={"keywords": "colony", **SMALL})
    plain = [client.completions.create(seed=s, **kw).choices[0].text for s in range(3)]
    penalised = [client.completions.create(seed=s, presence_penalty=2, frequency_penalty=2, **kw).choices[0].text
                 for s in range(3)]
    assert plain != penalised
    r = client.chat.completions.create(model=_name(client), messages=[{"role": "user", "content": "Hi"}], max_tokens=8,
                                       presence_penalty=-0.5, frequency_penalty=0.5, extra_body=SMALL)
    assert r.choices[0].message.content


def test_a_list_of_prompts_is_answered_as_each_prompt_alone(client):
    """OpenAI's list of prompts: a job each, in one answer; prompt i's choices come from index
    i * n, each the answer to that prompt sent alone with the same seed, the usage summed and `dbs`
    one object per prompt. Streamed, each prompt's deltas, joined by index, are its choices, with
    one usage chunk after them all. A list is no longer than the server's queue."""
    kw = dict(model=_name(client), max_tokens=12, seed=4, n=2, extra_body={"keywords": "river", **SMALL})
    prompts = ["It is", "The doctor said", "Once"]
    both = client.completions.create(prompt=prompts, **kw)
    alone = [client.completions.create(prompt=p, **kw) for p in prompts]
    for i, one in enumerate(alone):
        assert [(c.index, c.text) for c in both.choices if c.index // 2 == i] == \
            [(2 * i + c.index, c.text) for c in one.choices]
    assert both.usage.total_tokens == sum(one.usage.total_tokens for one in alone)
    assert [d["found"] for d in both.model_extra["dbs"]] == [one.model_extra["dbs"]["found"] for one in alone]
    chunks = list(client.completions.create(prompt=prompts, stream=True, stream_options={"include_usage": True},
                                            **kw))
    parts = [(c.choices[0].index, c.choices[0].text) for c in chunks if c.choices]
    assert ["".join(t for i, t in parts if i == c.index) for c in both.choices] == [c.text for c in both.choices]
    assert {i for i, _ in parts} == {c.index for c in both.choices}
    assert [c.usage.total_tokens for c in chunks if c.usage] == [both.usage.total_tokens] and not chunks[-1].choices
    assert len({c.id for c in chunks}) == 1
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(prompt=["It is"] * 1000, **kw)
    assert e.value.body["param"] == "prompt" and "1 to" in e.value.body["message"]


def test_a_prompt_of_token_ids_is_read_as_the_text_they_decode_to(client, model_dir):
    """OpenAI's token-id prompts (a list of ints, or a list of such lists, as evaluation harnesses
    send them): each is answered as the text its ids decode to; an id outside the vocabulary is a
    400 naming `prompt`."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    kw = dict(model=_name(client), max_tokens=12, seed=2, extra_body={"keywords": "river", **SMALL})
    prompts = ["It is", "The doctor said"]
    ids = [tok.encode(p, add_special_tokens=False).ids for p in prompts]
    as_text = [client.completions.create(prompt=p, **kw).choices[0].text for p in prompts]
    assert client.completions.create(prompt=ids[0], **kw).choices[0].text == as_text[0]
    both = client.completions.create(prompt=ids, **kw)
    assert [c.text for c in both.choices] == as_text
    for bad in ([tok.get_vocab_size(with_added_tokens=True)], [[]]):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(prompt=bad, **kw)
        assert e.value.body["param"] == "prompt" and "token ids" in e.value.body["message"]


def test_temperature_zero_and_fields_that_ask_nothing_are_answered(client):
    """What applications send unchanged: temperature 0 (the likeliest token at each draw: the same
    text whatever the seed), a developer message (the system's instructions), and fields that ask
    for nothing the engine does (`store` false, `metadata`, `parallel_tool_calls`, `service_tier`)."""
    kw = dict(model=_name(client), max_tokens=16, extra_body={"keywords": "river", **SMALL})
    texts = {client.completions.create(prompt="It is", temperature=0, seed=seed, **kw).choices[0].text
             for seed in range(3)}
    assert len(texts) == 1
    sampled = {client.completions.create(prompt="It is", seed=seed, **kw).choices[0].text for seed in range(3)}
    assert len(sampled) > 1
    msgs = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Tell me"}]
    got = client.chat.completions.create(messages=msgs, seed=1, store=False, metadata={"app": "test"},
                                         parallel_tool_calls=False, service_tier="auto", **kw)
    same = client.chat.completions.create(messages=[{**msgs[0], "role": "system"}, msgs[1]], seed=1, **kw)
    assert got.choices[0].message.content == same.choices[0].message.content


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="It is", extra_body={"keywords": "colony"})
    assert client.models.retrieve(_name(client)).id == _name(client)        # GET /v1/models/{model}
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-4")
    assert e.value.body["param"] == "model" and "gpt-4" in e.value.body["message"]


def test_a_body_over_the_limit_is_413(exported):
    dbs = DirectedBeamSearch(exported["gpt2"])
    s = Server(create_app(ServiceOptions(max_rows=24, max_body_bytes=200), dbs=dbs)).wait_ready()
    try:
        big = {"context": "It is " * 100, "keywords": "colony"}
        assert httpx.post(s.url + "/v1/generate", json=big, timeout=30).status_code == 413
        chunked = httpx.post(s.url + "/v1/generate", content=iter([json.dumps(big).encode()]), timeout=30,
                             headers={"content-type": "application/json"})
        assert chunked.status_code == 413
        small = httpx.post(s.url + "/v1/generate", json={"keywords": "colony", "max_new_tokens": 4, "beams": 2,
                                                               "candidates": 3}, timeout=30)
        assert small.status_code == 200
        assert "access-control-allow-origin" not in small.headers          # CORS off unless asked
    finally:
        s.stop()


def test_docs_page_is_served_from_local_files(server):
    page = httpx.get(server.url + "/docs")
    assert page.status_code == 200 and "/docs-assets/swagger-ui-bundle.js" in page.text
    assert httpx.get(server.url + "/docs-assets/swagger-ui-bundle.js").status_code == 200
    assert "//cdn" not in page.text and "unpkg" not in page.text


def test_a_full_queue_is_the_sdks_rate_limit_error(exported):
    dbs = DirectedBeamSearch(exported["gpt2"])
    model = dbs.decoder or dbs.backend
    step = model.step
    model.step = lambda *a, **k: (time.sleep(0.02), step(*a, **k))[1]
    s = Server(create_app(ServiceOptions(model=str(exported["gpt2"]), max_rows=6, max_queue=1), dbs=dbs)).wait_ready()
    c = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=60)
    name = c.models.list().data[0].id
    long = dict(model=name, prompt="It is", max_tokens=200, extra_body={"keywords": "colony", "beams": 1,
                                                                         "candidates": 6, "chunk": 1, "stop_at": "max"})
    try:
        stream = c.completions.create(stream=True, **long)
        next(iter(stream))                                                       # running: every row is taken
        waiting = threading.Thread(target=lambda: c.completions.create(**{**long, "max_tokens": 2}))
        waiting.start()
        _wait(lambda: httpx.get(s.url + "/health").json()["queue"] == 1)
        with pytest.raises(openai.RateLimitError):
            c.completions.create(**{**long, "max_tokens": 2})
        stream.close()
        waiting.join(60)
    finally:
        model.step = step
        s.stop()


def _random_value(rng):
    pick = rng.integers(9)
    if pick == 0:
        return int(rng.integers(-2**40, 2**40))
    if pick == 1:
        return float(rng.normal() * 10 ** rng.integers(0, 12))
    if pick == 2:
        return "".join(chr(int(c)) for c in rng.integers(1, 0x2FFF, rng.integers(0, 40)))   # unicode, controls
    if pick == 3:
        return "word " * int(rng.integers(0, 3000))                                         # long strings
    if pick == 4:
        return [_random_value(rng) for _ in range(rng.integers(0, 4))]
    if pick == 5:
        return {"role": "user", "content": _random_value(rng)}
    if pick == 6:
        return None
    if pick == 7:
        return bool(rng.integers(2))
    return "colony,enemy"


FUZZ_FIELDS = ["model", "prompt", "messages", "max_tokens", "temperature", "top_p", "n", "seed", "stop", "stream",
               "keywords", "ban", "beams", "candidates", "chunk", "lambda", "order", "guarantee", "stop_at", "task",
               "logprobs", "context", "max_new_tokens", "user", "stream_options", "tools", "response_format",
               "paper", "repetition_penalty", "presence_penalty", "frequency_penalty", "echo", "logit_bias"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/generate"])
def test_no_input_is_a_server_error(server, path):
    """1,000 random bodies (types, ranges, unicode, long strings) on each generation endpoint: every
    answer is a 2xx or a 4xx, never a 5xx. On the OpenAI endpoints every 4xx is OpenAI's error
    object, /v1/generate's too, and a valid body with one field made random that fails names that field."""
    import numpy as np

    rng = np.random.default_rng(len(path))
    headers = {"Authorization": f"Bearer {KEY}"}
    statuses, named = [], 0
    valid = {"model": "gpt2", "max_tokens": 4, "keywords": "colony", "beams": 2, "candidates": 2}
    valid.update({"/v1/completions": {"prompt": "It is"}, "/v1/generate": {"context": "It is"},
                  "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hi"}]}}[path])
    if path == "/v1/generate":
        valid = {**{k: v for k, v in valid.items() if k not in ("model", "max_tokens")}, "max_new_tokens": 4}
    with httpx.Client(base_url=server.url, headers=headers, timeout=60) as http:
        for i in range(1000):
            one = None
            if i % 2 == 0:                                  # half: one field of a valid body made random
                one = str(rng.choice(FUZZ_FIELDS))
                body = {**valid, one: _random_value(rng)}
            else:
                body = {f: _random_value(rng) for f in rng.choice(FUZZ_FIELDS, rng.integers(0, 8), replace=False)}
            r = http.post(path, json=body)
            statuses.append(r.status_code)
            assert r.status_code < 500, (path, body, r.text[:300])
            if r.status_code < 400:
                continue
            got = r.json()
            assert set(got) == {"error"} and set(got["error"]) == {"message", "type", "param", "code"}, got
            assert isinstance(got["error"]["message"], str) and got["error"]["message"], got
            if one is not None:
                assert got["error"]["param"] == one, (one, body[one], got)
                named += 1
    assert statuses.count(200) > 0 and sum(400 <= s < 500 for s in statuses) > 100
    assert named > 100


def test_a_rule_reads_the_same_at_every_door_in_that_doors_words(server):
    """A value is checked once (DBSConfig), with one message; each door fills in its name for the
    field: `stop` in /v1/generate, `stop_at` on the OpenAI endpoints (`stop` is OpenAI's stop
    sequences there)."""
    def error(path, body):
        r = httpx.post(server.url + path, json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
        assert r.status_code == 400, r.text
        return r.json()["error"]

    generate = error("/v1/generate", {"keywords": "colony", "stop": "never", **SMALL})
    completion = error("/v1/completions", {"model": "gpt2", "prompt": "It is", "keywords": "colony",
                                           "stop_at": "never", **SMALL})
    rule = "must be one of ('max', 'sentence', 'eos'), got 'never'"
    assert generate["message"] == f"`stop` {rule}" and generate["param"] == "stop"
    assert completion["message"] == f"`stop_at` {rule}" and completion["param"] == "stop_at"
    for path, extra in (("/v1/generate", {}), ("/v1/completions", {"model": "gpt2", "prompt": "It is"})):
        e = error(path, {"keywords": "colony", "temperature": -1.0, **extra, **SMALL})
        assert e["message"] == "`temperature` must be >= 0 (0 = the likeliest token), got -1.0", e
        assert e["param"] == "temperature", e
    # a message that names another option names it as the door does: the budget is `max_tokens` there
    long = error("/v1/completions", {"model": "gpt2", "prompt": "It is", "keywords": "colony", "max_tokens": 10**6})
    assert "`max_tokens` (1000000)" in long["message"] and "max_new_tokens" not in long["message"], long
    assert long["param"] == "max_tokens"
    long = error("/v1/generate", {"keywords": "colony", "max_new_tokens": 10**6})
    assert "`max_new_tokens` (1000000)" in long["message"] and long["param"] == "max_new_tokens", long


def test_a_request_without_keywords_is_answered_by_the_same_engine_unguided(client, server, model_dir):
    """An application pointed at us unchanged sends no `keywords`: it gets the model's own text,
    from the same search with no guide words, through every door alike."""
    from dataclasses import replace

    from dbs_fast.config import DBSConfig

    r = client.completions.create(model=_name(client), prompt="It is", max_tokens=12, seed=4, extra_body=SMALL)
    assert r.choices[0].text and r.model_extra["dbs"]["found"] == {}
    plain = httpx.post(server.url + "/v1/generate", json={"context": "It is", "seed": 4, "max_new_tokens": 12,
                                                          **SMALL}, headers={"Authorization": f"Bearer {KEY}"},
                       timeout=60).json()
    assert plain["generated"] == r.choices[0].text and plain["keywords"] == [] and plain["success_rate"] == 1.0
    engine = DirectedBeamSearch(model_dir).generate("It is", None, seed=4,
                                                    config=replace(DBSConfig(), max_new_tokens=12, **SMALL))
    assert engine.generated == plain["generated"]
    chat = client.chat.completions.create(model=_name(client), max_tokens=12, seed=4, extra_body=SMALL,
                                          messages=[{"role": "user", "content": "Tell me about rivers."}])
    assert chat.choices[0].message.content


def test_logit_bias_is_honoured_at_every_door(client, server, model_dir):
    """OpenAI's logit_bias reaches the draw: -100 on the tokens of a plain answer gives another
    answer to the same request, and /v1/generate, given the same field, the same text."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    kw = dict(model=_name(client), prompt="It is", max_tokens=12, seed=5, extra_body={"keywords": "river", **SMALL})
    plain = client.completions.create(**kw).choices[0].text
    bias = {str(t): -100 for t in tok.encode(plain, add_special_tokens=False).ids}
    biased = client.completions.create(logit_bias=bias, **kw).choices[0].text
    assert biased != plain
    same = httpx.post(server.url + "/v1/generate", json={"context": "It is", "keywords": "river", "seed": 5,
                                                         "max_new_tokens": 12, "logit_bias": bias, **SMALL},
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=60).json()
    assert same["generated"] == biased, same
    chat = client.chat.completions.create(model=_name(client), max_tokens=8, logit_bias={"13": 5}, extra_body=SMALL,
                                          messages=[{"role": "user", "content": "Hi"}])
    assert chat.choices[0].message.content


def test_logprobs_come_in_openais_shapes(client, server):
    """A completion's `logprobs` (the alternatives beside each token) and chat's `logprobs` with
    `top_logprobs`: every choice's tokens join into its text, up to a stop sequence's cut, each
    with its log-probability and that many likeliest tokens; /v1/generate returns the engine's own."""
    kw = dict(model=_name(client), max_tokens=12, seed=6, extra_body={"keywords": "river", **SMALL})
    r = client.completions.create(prompt="It is", logprobs=2, n=2, **kw)
    for c in r.choices:
        lp = c.logprobs
        assert "".join(lp.tokens) == c.text and lp.text_offset[0] == 0 and len(lp.tokens) == len(lp.token_logprobs)
        for tok, p, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
            assert p <= 0 and len(top) in (2, 3) and top[tok] == p
    cut = client.completions.create(prompt="It is", logprobs=0, stop=[r.choices[0].text[3:6]], **kw).choices[0]
    assert "".join(cut.logprobs.tokens).startswith(cut.text)
    assert len(cut.logprobs.tokens) <= len(r.choices[0].logprobs.tokens)
    chat = client.chat.completions.create(messages=[{"role": "user", "content": "Hi"}], logprobs=True, top_logprobs=3,
                                          **kw).choices[0]
    content = chat.logprobs.content
    assert "".join(t.token for t in content) == chat.message.content
    assert all(len(t.top_logprobs) == 3 and t.top_logprobs[0].logprob >= t.logprob - 1e-5 and
               bytes(t.bytes) == t.token.encode() for t in content)
    assert all(a.logprob == t.logprob for t in content for a in t.top_logprobs if a.token == t.token)
    unasked = client.chat.completions.create(messages=[{"role": "user", "content": "Hi"}], **kw).choices[0]
    assert unasked.logprobs is None
    plain = httpx.post(server.url + "/v1/generate", json={"context": "It is", "keywords": "river", "seed": 6,
                                                          "max_new_tokens": 12, "logprobs": 2, **SMALL},
                       headers={"Authorization": f"Bearer {KEY}"}, timeout=60).json()
    assert [e["token"] for e in plain["logprobs"]] == r.choices[0].logprobs.tokens


def test_the_chat_door_starts_from_the_chat_preset(model_dir):
    """/v1/chat/completions answers with `DBSConfig.chat()` under the body's options, completions
    with the default; a task or --paper in the body replaces it."""
    from dbs_fast.config import DBSConfig
    from dbs_fast.serving.openai_api import chat_model, completion_model, job_arguments
    from dbs_fast.text.chat import ChatTemplate

    template = ChatTemplate.of(model_dir)
    chat = chat_model()(model=model_dir.name, messages=[{"role": "user", "content": "Hi"}], keywords="river")
    assert job_arguments(chat, str(model_dir), 7, template, chat=True)["base"] == DBSConfig.chat()
    plain = completion_model()(model=model_dir.name, prompt="It is", keywords="river")
    assert job_arguments(plain, str(model_dir), 7, template, chat=False)["base"] == DBSConfig()
    paper = chat_model()(model=model_dir.name, messages=[{"role": "user", "content": "Hi"}], paper=True)
    assert job_arguments(paper, str(model_dir), 7, template, chat=True)["base"] == DBSConfig.paper()
