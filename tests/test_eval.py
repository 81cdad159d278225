"""The keyword sampler and `dbs-fast eval` end to end on a tiny model (2 sets), with resumption."""
import json

import pytest

from dbs_fast.cli import main as cli

pytest.importorskip("wordfreq")


def test_sampler_is_deterministic_without_stop_words():
    from wordfreq import top_n_list

    from dbs_fast.benchmarks.eval import STOP_WORDS, sample_sets

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
    assert cli(argv) == 0
    rows = (tmp_path / "o" / "results.jsonl").read_text().splitlines()
    assert len(rows) == 4 and {json.loads(r)["mode"] for r in rows} == {"dbs", "unguided"}
    summary = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert 0 <= summary["dbs"]["success_rate"]["mean"] <= 1 and summary["scorer"] == "self"
    assert cli(argv) == 0                                                     # resumed: nothing re-run
    assert len((tmp_path / "o" / "results.jsonl").read_text().splitlines()) == 4
    assert "| dbs |" in capsys.readouterr().out
