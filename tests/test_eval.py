"""The evaluation: the keyword sampler, `dbs-fast eval` end to end on a tiny model (with
resumption), text metrics, CommonGen's coverage and scores."""
import json

import numpy as np
import pytest

from dbs_fast.cli import main as cli
from dbs_fast.evaluation.metrics import distinct_n, rep_n
from dbs_fast.text.words import words

pytest.importorskip("wordfreq")


def test_sampler_is_deterministic_without_stop_words():
    from wordfreq import top_n_list

    from dbs_fast.evaluation.runs import STOP_WORDS, sample_sets

    a, b = sample_sets(5, seed=7), sample_sets(5, seed=7)
    assert a == b and a != sample_sets(5, seed=8)
    allowed = set(top_n_list("en", 1000)[500:1000])
    for s in a:
        assert len(s) == 5 == len(set(s))
        assert all(w in allowed and w not in STOP_WORDS for w in s)


def test_eval_end_to_end_and_resumes(exported, tmp_path, capsys):
    sets = tmp_path / "sets.txt"
    sets.write_text("colony,enemy\nspeed,mouth\n")
    argv = ["eval", "--model", str(exported["gpt2"]), "--keywords-file", str(sets), "--out", str(tmp_path / "o"),
            "--beams", "2", "--candidates", "2", "--chunk", "3", "--max-new-tokens", "6", "--batch", "2"]
    assert cli(argv + ["--judge", str(exported["gpt2"])]) == 2               # the generator cannot judge itself
    assert "is the generator itself" in capsys.readouterr().err
    argv += ["--judge", str(exported["llama"])]                               # another model (same tokenizer here)
    assert cli(argv) == 0
    rows = [json.loads(r) for r in (tmp_path / "o" / "results.jsonl").read_text().splitlines()]
    assert len(rows) == 6 and {r["mode"] for r in rows} == {"dbs", "paper", "unguided"}
    assert all(r["judge_ppl"] > 1 and 0 <= r["rep_4"] <= 1 for r in rows)
    assert all(r["stopped"] == "max" for r in rows if r["mode"] != "dbs")
    summary = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert 0 <= summary["dbs"]["success_rate"]["mean"] <= 1 and summary["scorer"] == "self"
    assert summary["judge"] == str(exported["llama"]) and 0 <= summary["paper"]["distinct_4"] <= 1
    assert summary["configs"]["paper"]["repetition_penalty"] == 1.0 and summary["configs"]["dbs"]["stop"] == "sentence"
    assert (tmp_path / "o" / "quality.png").stat().st_size > 0
    assert cli(argv) == 0                                                     # resumed: nothing re-run
    assert len((tmp_path / "o" / "results.jsonl").read_text().splitlines()) == 6
    out = capsys.readouterr().out
    assert "| dbs |" in out and "| unguided |" in out and "Examples" in out


def test_builtin_sets_are_the_papers():
    from dbs_fast.evaluation.runs import builtin_sets

    paper = builtin_sets("paper")
    assert len(paper) == 50 and all(len(s) == 5 for s in paper)
    assert paper[0] == ["enemy", "speed", "meet", "colony", "mouth"]
    assert len(builtin_sets("roc")) == 20


def test_eval_bad_runs_and_sets(exported, tmp_path, capsys):
    base = ["eval", "--model", str(exported["gpt2"]), "--out", str(tmp_path / "x"), "--judge", "none"]
    assert cli(base + ["--runs", "dbs,foo"]) == 2
    assert "--runs" in capsys.readouterr().err
    assert cli(base + ["--sets", "nosuch"]) == 2
    err = capsys.readouterr().err                   # every set --sets takes, chat among them
    assert all(f"'{name}'" in err for name in ("chat", "commongen-dev", "paper", "roc")), err


def test_keyword_misses_by_position():
    from dbs_fast.evaluation.runs import keyword_misses

    rows = [{"keywords": ["a", "b"], "found": {"a": {"char": 0}, "b": None}},
            {"keywords": ["c", "b"], "found": {"c": None, "b": None}}]
    m = keyword_misses(rows)
    assert m["miss_rate_by_position"] == {1: 0.5, 2: 1.0} and m["missed_words"] == {"b": 2, "c": 1}


def test_grid_configs_follow_the_paper():
    from dbs_fast.config import DBSConfig
    from dbs_fast.evaluation.runs import grid_configs

    lam = grid_configs(DBSConfig.paper(), "lambda")
    assert [c.lam for c in lam.values()] == [5, 10, 15, 20, 25]
    assert all(c.beams == c.candidates == c.chunk == 5 for c in lam.values())
    bsk = grid_configs(DBSConfig(), "bsk", bs_values=(3, 5), k_values=(2, 5))
    assert len(bsk) == 8 and {(c.beams, c.candidates, c.chunk) for c in bsk.values()} >= {(3, 5, 2), (5, 3, 5)}


def test_grid_and_stories_end_to_end(exported, tmp_path, capsys):
    base = ["eval", "--model", str(exported["gpt2"]), "--out", str(tmp_path / "g"), "--max-new-tokens", "4",
            "--batch", "2"]
    sets = tmp_path / "sets.txt"
    sets.write_text("colony,enemy\nspeed,mouth\n")
    argv = base + ["--keywords-file", str(sets), "--grid", "all", "--grid-lambdas", "5,20", "--grid-bs", "1,2",
                   "--grid-k", "2"]
    assert cli(argv) == 0
    grid = json.loads((tmp_path / "g" / "grid.json").read_text())
    assert len(grid["points"]) == 2 + 4 and all(p["sets"] == 2 for p in grid["points"])
    assert (tmp_path / "g" / "lambda.png").stat().st_size > 0 and (tmp_path / "g" / "bsk.png").stat().st_size > 0
    n = len((tmp_path / "g" / "grid.jsonl").read_text().splitlines())
    assert n == 12 and cli(argv) == 0 and len((tmp_path / "g" / "grid.jsonl").read_text().splitlines()) == n
    assert cli(base + ["--stories"]) == 0
    out = capsys.readouterr().out
    assert "He and his friends are bored on a weekend day." in out and "[go, decide]" in out
    assert len(json.loads((tmp_path / "g" / "stories.json").read_text())) == 4
    assert cli(base + ["--grid", "lambda", "--grid-bs", "x"]) == 2


def test_rows_of_changed_settings_are_not_reused():
    from dbs_fast.config import DBSConfig
    from dbs_fast.evaluation.runs import current_rows

    old, new = DBSConfig(alpha=0.001), DBSConfig(alpha=0.02)
    rows = [{"set": 0, "mode": "dbs", "config": old.to_dict(), "v": 1},
            {"set": 1, "mode": "dbs", "config": new.to_dict(), "v": 2},
            {"set": 1, "mode": "dbs", "config": new.to_dict(), "v": 3},
            {"set": 0, "mode": "other", "config": old.to_dict(), "v": 4}]
    got = current_rows(rows, {"dbs": new})
    assert [r["v"] for r in got] == [3]


# -- metrics on hand-made texts ------------------------------------------------------------------
def test_rep_n_and_distinct_n_by_hand():
    assert words("I'll be waiting, for YOU.") == ["i", "ll", "be", "waiting", "for", "you"]
    assert rep_n("a b a b", 2) == pytest.approx(1 - 2 / 3)       # ab, ba, ab
    assert rep_n("a b a b", 1) == pytest.approx(0.5)
    assert rep_n("a b c d e", 2) == 0.0 and rep_n("a", 2) == 0.0 and rep_n("", 4) == 0.0
    loop = "I'll be waiting for you. " * 5
    assert rep_n(loop, 4) == pytest.approx(1 - 6 / 27)          # 30 words, 27 4-grams, 6 distinct
    assert distinct_n(["a b", "a b"], 2) == 0.5 and distinct_n(["a b c"], 2) == 1.0 and distinct_n([], 2) == 0.0


def test_word_loop_by_hand():
    from dbs_fast.evaluation.metrics import word_loop

    assert word_loop("The city of music - a summer summer summer winter.")
    assert word_loop("child, child, doctor and child")                # punctuation is no word
    assert not word_loop("the cat and the dog the")                   # the third "the" is 5 words on
    assert word_loop("the cat and the dog the", window=6)
    assert not word_loop("") and not word_loop("a a") and word_loop("a a a")


@pytest.mark.parametrize("text, false", [
    ("It is one of the town's main rivers, which a doctor named Dr.", True), ("She met Mr.", True),
    ("He lives on Main St.", True), ("Fruit, e.g.", True), ("A trip to the U.S.", True), ("It was John F.", True),
    ('He said "Dr."', True), ("The price rose to 3.", False), ("It was in 2012.", False),
    ("The dog caught the frisbee.", False), ('He said "no."', False), ("It was I.", False), ("No period", False),
    ("The doctor said so. Then he left.", False)])
def test_a_false_sentence_end_is_an_abbreviation_or_an_initial(text, false):
    from dbs_fast.evaluation.metrics import false_end, number_end

    assert false_end(text) is false
    assert number_end(text) is (text.endswith(("3.", "2012.")))


# -- CommonGen ----------------------------------------------------------------------------------
def test_commongen_coverage_by_lemma():
    from dbs_fast.evaluation.metrics import coverage

    assert coverage("The player stood in the field looking at the batter.", ["field", "stand", "look"]) == 1.0
    assert coverage("Kids dance.", ["kid", "room", "dance"]) == pytest.approx(2 / 3)
    assert coverage("The geese ran.", ["goose", "run"]) == 1.0
    assert coverage("A standard field.", ["stand"]) == 0.0          # no false stem match


def test_eval_commongen_at_toy_size(exported, tmp_path, capsys):
    pytest.importorskip("pycocoevalcap")
    out = tmp_path / "cg"
    argv = ["eval", "--model", str(exported["gpt2"]), "--sets", "commongen-dev", "--limit", "2", "--out", str(out),
            "--beams", "2", "--candidates", "2", "--chunk", "3", "--max-new-tokens", "24", "--batch", "2",
            "--runs", "dbs,guarantee", "--judge", str(exported["llama"])]
    assert cli(argv) == 0
    s = json.loads((out / "summary.json").read_text())
    from dbs_fast.config import COMMONGEN, COMMONGEN_CONTEXT

    assert s["sets"] == 2 and s["context"] == COMMONGEN_CONTEXT and s["configs"]["dbs"]["order"] == "any"
    assert s["configs"]["dbs"]["lam"] == COMMONGEN["lam"]                # the task's defaults
    assert s["guarantee"]["commongen"]["coverage_text"] == 1.0        # guaranteed in the text
    c = s["dbs"]["commongen"]
    assert 0.0 <= c["bleu4"] <= 100.0 and c["cider"] >= 0.0 and c["words"] > 0 and "lower-cased" in c["tokenisation"]
    # the human references on the same ruler: sets 0-1's sentences use all their concepts, and the
    # first reference of each scored against the others, by the same code
    assert s["reference"]["coverage"] == 1.0 and s["reference"]["judge_ppl"]["median"] > 1.0
    assert s["human"]["sets"] == 2 and s["human"]["bleu4"] > 0 and s["human"]["cider"] > 0
    assert 1 <= s["dbs"]["distinct_beams"] <= 2                       # different final texts, at most b
    printed = capsys.readouterr().out
    assert "BLEU-4" in printed and "CIDEr-D" in printed and "| human (2 sets)" in printed and "human references" in printed
    assert "Different final beams per set" in printed
    # the frontier of the runs: one point per run, from the same summary, beside the human anchor
    assert cli(["eval", "--frontier", str(out), "--out", str(tmp_path / "fr")]) == 0
    fr = json.loads((tmp_path / "fr" / "frontier.json").read_text())
    assert [(p["run"], p["bleu4"]) for p in fr["points"]] == [(r, s[r]["commongen"]["bleu4"]) for r in ("dbs", "guarantee")]
    assert fr["human"]["bleu4"] == s["human"]["bleu4"] and (tmp_path / "fr" / "frontier.png").stat().st_size > 0
    assert cli(["eval", "--frontier", str(tmp_path / "nothing"), "--out", str(tmp_path / "fr")]) == 2


def test_eval_start_takes_later_sets_with_their_references_and_seeds(exported, tmp_path):
    """`--start 7 --limit 1` evaluates set 7 alone: its concepts, scored against set 7's references
    (the human anchor too), under seed 7, the seed it has in a run from the first set."""
    pytest.importorskip("pycocoevalcap")
    from dbs_fast.evaluation.runs import builtin_refs, builtin_sets

    out = tmp_path / "cg"
    argv = ["eval", "--model", str(exported["gpt2"]), "--sets", "commongen-dev", "--start", "7", "--limit", "1",
            "--out", str(out), "--beams", "2", "--candidates", "2", "--chunk", "3", "--max-new-tokens", "12",
            "--runs", "dbs", "--judge", "none"]
    assert cli(argv) == 0
    row = json.loads((out / "results.jsonl").read_text().splitlines()[0])
    assert row["keywords"] == builtin_sets("commongen-dev")[7]
    s = json.loads((out / "summary.json").read_text())
    report = (out / "summary.md").read_text()
    assert "(sets 7-7)" in report and "- set 7:" in report
    assert s["sets"] == 1 and s["first_set"] == 7 and s["human"]["sets"] == (1 if len(builtin_refs("commongen-dev")[7]) >= 2 else 0)
    from dbs_fast.api import DirectedBeamSearch
    from dbs_fast.config import DBSConfig

    cfg = DBSConfig(**s["configs"]["dbs"])
    alone = DirectedBeamSearch(exported["gpt2"]).generate(row["context"], row["keywords"], seed=7, config=cfg)
    assert alone.generated == row["generated"]
    assert cli(argv[:5] + ["--start", "993"] + argv[7:]) == 2          # past the last set: one line, exit 2


def test_commongen_scores_are_the_librarys_over_all_references():
    """BLEU-4 and CIDEr-D by pycocoevalcap on hand-made sentences: against every reference of a
    set at once, on lower-cased word and punctuation tokens, x100 and x10; the output sentence is
    the text up to its first sentence end."""
    pytest.importorskip("pycocoevalcap")
    from pycocoevalcap.bleu.bleu import Bleu
    from pycocoevalcap.cider.cider import Cider

    from dbs_fast.evaluation.runs import (
        caption_scores,
        commongen_scores,
        first_sentence,
    )

    refs = [["The dog catches the frisbee.", "A man throws a frisbee to his dog."],
            ["Kids dance in the room.", "The kid loves to dance in her room.", "Two kids dance."]]
    hyps = ["A dog catches a frisbee.", "The kids dance in a room."]
    got = caption_scores(hyps, refs)
    gts = {0: ["the dog catches the frisbee .", "a man throws a frisbee to his dog ."],
           1: ["kids dance in the room .", "the kid loves to dance in her room .", "two kids dance ."]}
    res = {0: ["a dog catches a frisbee ."], 1: ["the kids dance in a room ."]}
    assert got["bleu4"] == pytest.approx(100 * Bleu(4).compute_score(gts, res, verbose=0)[0][3])
    assert got["cider"] == pytest.approx(10 * Cider().compute_score(gts, res)[0])
    one = caption_scores(hyps, [[r[0]] for r in refs])
    assert got["bleu4"] > one["bleu4"]                     # more references, more matches
    assert first_sentence('He said "stop." Then he left.') == 'He said "stop."'
    rows = [{"set": 0, "context": "Scene:\nA", "generated": " dog catches a frisbee. Later a cat.",
             "keywords": ["dog", "frisbee", "cat"]}]
    c = commongen_scores(rows, refs)
    assert c["coverage"] == pytest.approx(2 / 3) and c["coverage_text"] == 1.0 and c["words"] == 5


def test_the_text_around_the_words_leaves_out_every_token_of_an_occurrence():
    """`around_words`: the perplexity over the tokens that overlap no occurrence of a guide word
    (by lemma: "Clients" for "client"); the log-probs cover the text's last tokens."""
    from dbs_fast.evaluation.chat import around_words

    text = "A barber greets two Clients."
    offsets = [(0, 1), (1, 4), (4, 8), (8, 15), (15, 19), (19, 25), (25, 27), (27, 28)]   # "A"," bar","ber",...
    lp = np.log(np.array([0.5, 0.01, 0.2, 0.5, 0.5, 0.02, 0.3, 0.5]))[1:]          # the first not scored
    assert around_words(lp, offsets, text, ["barber", "client"]) == pytest.approx(2.0)  # 0.5, 0.5, 0.5 left
    assert around_words(lp, offsets, text, ["dog"]) == pytest.approx(float(np.exp(-lp.mean())))
    assert np.isnan(around_words(lp[:2], offsets[:3], text[:8], ["barber"]))       # nothing left


def test_eval_chat_answers_guided_and_unguided_through_the_chat_template(chat_model_dir, exported, tmp_path, capsys):
    """`--sets chat`: each packaged message rendered by the generator's chat template, answered
    with its guide words and without (the reference, cut to as many sentences), both judged."""
    from dbs_fast.evaluation.chat import KINDS, chat_requests, sentences

    reqs = chat_requests()
    assert len(reqs) >= 100 and {k for k, *_ in reqs} == set(KINDS)
    assert all(len(kws) == 3 and msg for _, kws, msg in reqs)
    named = [(kws, msg) for k, kws, msg in reqs if k == "names"]
    assert all(all(w in msg for w in kws) for kws, msg in named)            # these name their words
    assert cli(["eval", "--sets", "chat", "--model", str(chat_model_dir), "--limit", "4", "--out", str(tmp_path),
                "--beams", "2", "--candidates", "2", "--chunk", "3", "--max-new-tokens", "12", "--judge", "none"]) == 2
    assert cli(["eval", "--sets", "chat", "--model", str(chat_model_dir), "--limit", "4", "--out", str(tmp_path),
                "--beams", "2", "--candidates", "2", "--chunk", "3", "--max-new-tokens", "12",
                "--judge", str(exported["llama"])]) == 0
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["requests"] == 4 and s["names"]["requests"] == 2 and s["leaves_out"]["requests"] == 2
    assert s["all"]["judge_ppl_median"] > 1 and s["all"]["reference_judge_ppl_median"] > 1
    assert s["all"]["judge_ppl_around_words_median"] > 1
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    for r in rows:
        assert len(sentences(r["reference"])) <= max(1, len(sentences(r["answer"])))
    assert "answer / reference" in capsys.readouterr().out


def test_two_chat_runs_are_paired_answer_by_answer(tmp_path, capsys):
    """`benchmarks.chat_pairs`: per kind, the geometric mean of the second run's judge perplexity
    over the first's for the same request, and the answers more fluent, less and the same."""
    from benchmarks.chat_pairs import main as pairs

    def row(kind, message, answer, ppl, found=1.0):
        return {"kind": kind, "message": message, "answer": answer, "judge_ppl": ppl, "found": found}

    base = [row("names", "a", "x y", 10.0), row("leaves_out", "b", "x", 8.0), row("leaves_out", "c", "z", 4.0)]
    new = [row("names", "a", "x y", 10.0), row("leaves_out", "b", "w v", 2.0, 0.5), row("leaves_out", "c", "q", 16.0)]
    for name, rows in (("base", base), ("new", new)):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = pairs([str(tmp_path / "base"), str(tmp_path / "new")])
    assert out["names"] == {"requests": 1, "coverage": [1.0, 1.0], "words": [2.0, 2.0], "paired": 1.0,
                            "better": 0, "worse": 0, "same": 1}
    assert out["leaves_out"]["paired"] == 1.0 and (out["leaves_out"]["better"], out["leaves_out"]["worse"]) == (1, 1)
    assert out["leaves_out"]["coverage"] == [1.0, 0.75] and out["leaves_out"]["words"] == [1.0, 1.5]
    assert "leaves_out" in capsys.readouterr().out
