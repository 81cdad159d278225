"""The keyword sampler and `dbs-fast eval` end to end on a tiny model (2 sets), with resumption."""
import json

import pytest

from dbs_fast.cli import main as cli

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
    assert cli(base + ["--sets", "nosuch"]) == 2
    assert "--runs" in capsys.readouterr().err


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
