"""Bad input on the command line: every option with a bad value ends in one error line naming it
and exit code 2, before the model loads; never a traceback."""
from __future__ import annotations

import pytest

from dbs_fast.cli import main as cli
from dbs_fast.config import OPTIONS

# one bad value per DBSConfig option (switches have none), and what the error names (the flag)
BAD_OPTION = {
    "lam": ("-1", "--lambda"), "beams": ("0", "--beams"), "candidates": ("0", "--candidates"),
    "chunk": ("0", "--chunk"), "top_p": ("1.5", "--top-p"), "min_p": ("1", "--min-p"),
    "temperature": ("-1", "--temperature"),
    "alpha": ("-1", "--alpha"), "alpha_fluent": ("-1", "--alpha-fluent"),
    "late_boost_first": ("maybe", "--late-boost-first"), "reserve_per_keyword": ("-1", "--reserve-per-keyword"),
    "c_star": ("-1", "--c-star"), "max_new_tokens": ("0", "--max-new-tokens"),
    "boost_order": ("sideways", "--boost-order"), "complete_words": ("maybe", "--complete-words"),
    "order": ("sideways", "--order"), "match": ("prefix", "--match"), "inflect": ("maybe", "--inflect"),
    "repetition_penalty": ("0", "--repetition-penalty"), "presence_penalty": ("2.5", "--presence-penalty"),
    "frequency_penalty": ("-3", "--frequency-penalty"), "no_repeat_ngram_size": ("-1", "--no-repeat-ngram-size"),
    "no_repeat_word_window": ("1", "--no-repeat-word-window"), "pick": ("best", "--pick"),
    "length_penalty": ("9", "--length-penalty"),
    "finished": ("0", "--finished"), "openings": ("verbs", "--openings"),
    "stop": ("eventually", "--stop"), "beams_type": ("many", "--beams"),
    "prompt_style": ("loud", "--prompt-style"), "heal": ("maybe", "--heal"), "shots": ("201", "--shots"),
    "sentence_deadline": ("-1", "--sentence-deadline"), "keyword_deadline": ("-1", "--keyword-deadline"),
    "min_sentence": ("-1", "--min-sentence"),
    "stream_lag": ("-1", "--stream-lag"), "lam_named": ("81", "--lambda-named"),
    "min_p_named": ("1", "--min-p-named"), "lam_ahead": ("81", "--lambda-ahead"),
    "boost_first_reserve": ("-1", "--boost-first-reserve"), "logit_bias": ('{"1": 500}', "--logit-bias"),
    "logprobs": ("21", "--logprobs"), "similarity_power": ("0", "--similarity-power"),
}
FLAG = {name: flag for name, flag, *_ in OPTIONS}

# the other inputs: sizes no machine holds, lengths past the model's window, flags and types
BAD_OTHER = [
    (["--seed", "-1"], "--seed"),
    (["--seed", "x"], "--seed"),
    (["--logit-bias", "198:-100"], "--logit-bias"),
    (["--logit-bias", '{"99999999": -100}'], "--logit-bias"),
    (["--threads", "0"], "--threads"),
    (["--beams", "100000"], "GiB"),                                  # rows x vocabulary x 4 bytes + KV
    (["--candidates", "100000"], "GiB"),
    (["--max-new-tokens", "100000"], "context window"),
    (["--context", "word " * 300], "context window"),                # the tiny model holds 256 positions
    (["--keywords", ",".join(f"w{i}" for i in range(63))], "at most 62 keywords"),
    (["--keywords", "colony!"], "must be words"),
    (["--provider", "tpu"], "--provider"),
    (["--backend", "jax"], "--backend"),
    (["--kv-layout", "paged"], "--kv-layout"),
    (["--format", "xml"], "--format"),
    (["--model", "/nonexistent"], "neither an embedded model (default, gemma3-270m)"),
    (["--bogus", "1"], "unrecognized arguments"),
]


def _bad_option_cases():
    for name, (value, names) in BAD_OPTION.items():
        flag = FLAG[name[:-len("_type")]] if name.endswith("_type") else FLAG[name]
        yield pytest.param([flag, value], names, id=f"{flag}={value}")


def test_the_table_covers_every_option():
    switches = {name for name, _, typ, _ in OPTIONS if typ == "switch"}
    assert {name for name, *_ in OPTIONS} - switches <= set(BAD_OPTION)


@pytest.mark.parametrize("args,names", list(_bad_option_cases()) + [pytest.param(a, n, id=a[0]) for a, n in BAD_OTHER])
def test_bad_input_is_one_line_and_exit_2(exported, capsys, args, names):
    argv = ["generate", "--model", str(exported["gpt2"]), "--keywords", "colony"] + args
    assert cli(argv) == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert last.startswith("dbs-fast generate: error:") and names in last, err
    assert "Traceback" not in err


@pytest.mark.parametrize("value", ["x", "0", "-2"])
def test_a_bad_thread_count_in_the_environment_is_one_line_and_exit_2(exported, capsys, monkeypatch, value):
    monkeypatch.setenv("DBS_FAST_THREADS", value)
    assert cli(["generate", "--model", str(exported["gpt2"]), "--keywords", "colony"]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == ("dbs-fast generate: error: the environment's DBS_FAST_THREADS must be "
                                            f"an integer >= 1, got {value!r}") and "Traceback" not in err


def test_the_thread_count_comes_from_the_environment_where_no_flag_gives_it(monkeypatch):
    from dbs_fast.runtime import env_threads, session_options

    monkeypatch.setenv("DBS_FAST_THREADS", "1")
    assert env_threads() == 1 and session_options(None).intra_op_num_threads == 1
    assert session_options(2).intra_op_num_threads == 2
    monkeypatch.delenv("DBS_FAST_THREADS")
    assert env_threads() is None and session_options(None).intra_op_num_threads == 0     # ORT's own


def test_an_unknown_flag_shows_the_commands_usage(capsys):
    assert cli(["serve", "--bogus"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: dbs-fast serve") and "unrecognized arguments: --bogus" in err


def test_every_flag_explains_itself(capsys):
    """--help of every command gives each flag a help text; choices are listed."""
    from dbs_fast.cli import build_parser

    for name, p in build_parser()._subparsers._group_actions[0].choices.items():
        for action in p._actions:
            assert action.help, (name, action.option_strings)
        p.format_help()                                  # every help text formats ("5%" must be "5%%")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "{next,any}" in out and "{max,sentence,eos}" in out and "{stem,lemma}" in out
    assert "(default: It is;" in out and "(default: 0)" in out
    # a preset's setting that no flag gives is named as left unset, not as a value the flag refuses
    assert "no --lambda-ahead" in out and "--lambda-ahead None" not in out


@pytest.mark.parametrize("fmt", ["markdown", "text"])
def test_format_marks_keywords_only_where_asked(exported, capsys, fmt):
    """markdown: the placed keyword in **bold**; text (to a file or pipe): plain."""
    assert cli(["generate", "--model", str(exported["gpt2"]), "--keywords", "colony", "--max-new-tokens", "6",
                "--beams", "2", "--candidates", "2", "--guarantee", "--format", fmt]) == 0
    out = capsys.readouterr().out.splitlines()[0]
    assert "colon" in out.lower()
    assert ("**" in out) == (fmt == "markdown") and "\033[" not in out


def test_the_found_count_is_the_success_rates(exported, capsys):
    """A word listed twice is found twice where it appears: the count agrees with the success rate."""
    assert cli(["generate", "--model", str(exported["gpt2"]), "--keywords", "colony,colony", "--max-new-tokens", "6",
                "--beams", "2", "--candidates", "2", "--guarantee"]) == 0
    assert "found 2/2 (success rate 1.00" in capsys.readouterr().out


def test_a_generation_without_keywords_says_so_not_found_0_of_0(exported, capsys):
    assert cli(["generate", "--model", str(exported["gpt2"]), "--keywords", "", "--max-new-tokens", "6",
                "--beams", "2", "--candidates", "2"]) == 0
    out = capsys.readouterr().out
    assert "no keywords (the model's own text), stopped:" in out and "found 0/0" not in out


def test_task_commongen_applies_the_eval_preset(exported, capsys):
    """`generate --task commongen` runs what `eval --sets commongen-dev` runs: the task's context
    and settings, flags given overriding them."""
    import json

    from dbs_fast.config import COMMONGEN_CONTEXT

    assert cli(["generate", "--model", str(exported["gpt2"]), "--keywords", "colony,enemy", "--task", "commongen",
                "--beams", "2", "--candidates", "2", "--max-new-tokens", "8", "--format", "json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["context"] == COMMONGEN_CONTEXT and r["new_tokens"] <= 8
    assert cli(["generate", "--model", str(exported["gpt2"]), "--keywords", "colony", "--task", "commongen",
                "--paper"]) == 2
    assert cli(["generate", "--model", str(exported["gpt2"]), "--keywords", "colony", "--task", "poetry"]) == 2


def test_highlight_marks_where_the_search_found_each_keyword():
    from dbs_fast.cli import highlight

    text = "It is a river and the rivers of a doctor."
    found = {"river": {"char": 3, "end": 8, "token": 2}, "doctor": {"char": 29, "end": 35, "token": 9},
             "river ": {"char": 3, "end": 8, "token": 2}, "lost": None}        # listed twice: marked once
    # the places found, in the generated text after the context "It is": not every word of the same stem
    assert highlight(text, found, "markdown", offset=5) == "It is a **river** and the rivers of a **doctor**."
    assert highlight(text, found, "text", offset=5) == text
    assert highlight(text, {}, "ansi") == text


def test_the_progress_bar_rates_chunks_from_its_first_chunk(monkeypatch):
    """The bar is drawn at the first chunk; a rate counted from 0 chunks put that chunk in no time
    ("131072 chunk/s")."""
    import io

    from dbs_fast.cli import Progress

    monkeypatch.setattr("sys.stderr", io.StringIO())
    p = Progress("dbs")
    p(1, 10)
    assert "?chunk/s" in str(p.bar)
    p.close()


def test_a_model_file_is_refused_with_the_export_that_makes_it_a_directory(tmp_path, capsys):
    f = tmp_path / "model.gguf"
    f.write_bytes(b"GGUF")
    assert cli(["generate", "--model", str(f), "--keywords", "river"]) == 2
    err = capsys.readouterr().err
    assert f"dbs-fast export --model {f} --out DIR" in err and "Traceback" not in err
