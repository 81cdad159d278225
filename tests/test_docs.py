"""The README as a user meets it: its links lead somewhere, its Python example runs as written."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_readme_links_point_at_files_in_the_repository():
    links = [m for m in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README) if "://" not in m]
    assert links
    missing = [m for m in links if not (ROOT / m).exists()]
    assert not missing, missing


def test_readme_stays_a_guide():
    assert len(README.splitlines()) <= 300
    assert not re.search(r"\b[Ss]ession \d+|\b[Ii]ssue \d+|engine v2", README)


@pytest.mark.integration
def test_readme_python_example_runs_as_written(capsys):
    pytest.importorskip("optimum.exporters.onnx")
    code = re.search(r"After command 1:\n\n```python\n(.*?)```", README, re.S).group(1)
    exec(compile(code, "README.md", "exec"), {})
    out = capsys.readouterr().out                                       # the texts may hold paragraphs
    found = [line for line in out.splitlines() if line.startswith("{'enemy'")]
    assert "enemy" in out.split(found[0])[0] and "1.0" in found[0]
    tail = out[out.rindex("ice cream"):].lower()                        # the streamed pieces, joined, come last
    assert "river" in tail and "doctor" in tail
