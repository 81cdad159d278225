"""Prompt styles: a hidden prompt that names the keywords before the context, never in the result."""
from __future__ import annotations

from dataclasses import replace
from importlib.resources import files

import pytest

from dbs_fast import DBSConfig, DirectedBeamSearch
from dbs_fast.cli import main as cli
from dbs_fast.errors import DBSError
from dbs_fast.text.constraints import parse_keywords
from dbs_fast.text.prompt import few_shot, prompt_text, train_pool

KW = parse_keywords("dog,ice cream|gelato,park")
SMALL = DBSConfig(beams=2, candidates=3, chunk=3, max_new_tokens=9)


class Template:
    def render(self, messages):
        return "<|endoftext|>" + "".join(f"[{m['role']}] {m['content']}\n" for m in messages) + "[assistant] "


def test_each_style_names_the_keywords_and_only_none_is_empty():
    assert prompt_text("none", KW, "It is") == ""
    for style in ("instruction", "few-shot", "chat"):
        text = prompt_text(style, KW, "It is", Template())
        assert all(w in text for w in ("dog", "ice cream", "park")) and "gelato" not in text, style
    assert prompt_text("chat", KW, "x", Template()).startswith("<|endoftext|>[user] Write")
    with pytest.raises(DBSError, match="chat template") as e:
        prompt_text("chat", KW, "It is", None)
    assert e.value.field == "prompt_style"


def test_few_shot_examples_come_from_train_never_from_dev():
    pool = train_pool()
    dev = {frozenset(line.split()) for line in
           files("dbs_fast").joinpath("data/commongen_dev.txt").read_text().splitlines() if line}
    assert len(pool) == 200 and not any(frozenset(c) in dev for c, _ in pool)
    text = few_shot(["dog", "park"], "Scene:\n")
    assert text.count("Words: ") == 3 + 1 and few_shot(["dog"], "", 7).count("Words: ") == 8 and text.endswith("Words: dog, park\n")
    assert f"Scene:\n{pool[0][1]}\n" in text                  # the examples follow the same context
    assert f"\n{pool[0][1]}\n" in few_shot(["dog"], "It is")   # a context that cannot lead in: not repeated


@pytest.fixture(scope="module")
def dbs(exported):
    return DirectedBeamSearch(exported["gpt2"], config=SMALL)


@pytest.mark.parametrize("style", ["instruction", "few-shot"])
def test_the_prompt_is_read_but_the_result_continues_the_context(dbs, style):
    cfg = replace(SMALL, prompt_style=style)
    req = dbs.request("It is", "dog,park", config=cfg)
    read = dbs.backend.decode_batch([req.context_ids])[0] + req.heal.tail
    assert read == prompt_text(style, parse_keywords("dog,park"), "It is") + "It is"
    r = dbs.generate("It is", "dog,park", seed=0, config=cfg)
    assert r.text == "It is" + r.generated and "Words:" not in r.text and "Write" not in r.text
    assert r.prompt_tokens == len(req.context_ids) > len(dbs.request("It is", "dog,park").context_ids)


def test_a_chat_style_without_a_template_is_a_clear_error(exported, capsys):
    argv = ["generate", "--model", str(exported["gpt2"]), "--keywords", "dog", "--prompt-style", "chat"]
    assert cli(argv) == 2
    err = capsys.readouterr().err
    assert "chat template" in err and "Traceback" not in err


def test_bench_contexts_takes_token_counts_only(capsys):
    assert cli(["bench", "--contexts", "2,x"]) == 2
    assert "--contexts" in capsys.readouterr().err


@pytest.mark.parametrize("argv, says", [
    (["--model", "/nonexistent"], "`--model` goes with `--contexts`"),
    (["--shared", "64"], "`--shared` goes with `--contexts`"),
    (["--schedule", "plain"], "`--schedule` goes with `--contexts`"),
    (["--contexts", "2", "--model", "/nonexistent"], "neither an embedded model (default,"),
])
def test_bench_refuses_a_model_it_would_not_use_or_cannot_find(argv, says, capsys):
    """Before, `bench --model X` ran the whole bench on other models, ignoring X."""
    assert cli(["bench", *argv]) == 2
    assert says in capsys.readouterr().err


def test_the_contexts_floor_is_the_generations_arithmetic(tmp_path):
    """`bench --contexts` sets each length's growth beside the floor exact attention sets: a decode
    row's weight matmuls (2 x in x out) and its attention (4 x heads x head_dim per key, every
    layer; a sliding layer reads at most its window), times the rows the steps computed, and the
    prefill's (each context token once, causal, no LM head)."""
    import json

    from dbs_fast.bench.contexts import generation_flops, over_floor, step_flops

    m = {"hidden_size": 8, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1, "head_dim": 4, "vocab_size": 10}
    (tmp_path / "dbs_fast_model.json").write_text(json.dumps(m))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "intermediate_size": 16}))
    # per layer q 8x8, k and v 8x4, o 8x8, gate and up 8x16, down 16x8: 576 weights; the head 80
    layers, head = 2 * 2 * 576, 2 * 80
    assert step_flops(tmp_path, 10) == layers + head + 4 * 2 * 4 * 10 * 2
    f = generation_flops(tmp_path, context=3, rows=6, steps=4)
    assert f["prefill"] == 3 * layers + 4 * 2 * 4 * (1 + 2 + 3) * 2
    assert f["step"] == layers + head + 4 * 2 * 4 * 5 * 2 and f["decode"] == 4 * 6 * f["step"]
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "intermediate_size": 16, "sliding_window": 6,
                                                      "layer_types": ["sliding_attention", "full_attention"]}))
    assert step_flops(tmp_path, 10) == layers + head + 4 * 2 * 4 * (6 + 10)
    assert step_flops(tmp_path, 5) == layers + head + 4 * 2 * 4 * (5 + 5)
    base = {"flops": {"prefill": 10.0, "decode": 90.0}, "seconds_x": 1.0, "decode_x": 1.0}
    row = {"flops": {"prefill": 60.0, "decode": 135.0}, "seconds_x": 2.4, "decode_x": 1.65}
    assert over_floor(row, base) == pytest.approx({"step_floor_x": 1.5, "decode_over_floor": 1.1,
                                                   "floor_x": 1.95, "over_floor": 2.4 / 1.95})
