"""Probe scripts: one question about speed each, run from a checkout (`python -m benchmarks.NAME`),
not installed. See README.md here."""


def write(out, name: str, report: dict, lines: list[str]) -> None:
    """A benchmark's result: `name`.json (the figures) and `name`.md (the report) in `out`, made if
    missing; the report printed."""
    import json
    from pathlib import Path

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(report, indent=2))
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
