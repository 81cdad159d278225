"""Whether a change keeps the engine's texts: the paper's 50 sets at the default (context "It is")
and the first 100 CommonGen dev sets with the task's preset, seed i for set i, written by one
checkout; then two such files compared, list by list.

    python -m benchmarks.same_texts --out /tmp/new.json            # in each checkout
    python -m benchmarks.same_texts --compare /tmp/old.json /tmp/new.json
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def texts() -> dict:
    from dbs_fast.api import DirectedBeamSearch
    from dbs_fast.config import preset
    from dbs_fast.evaluation.runs import builtin_sets

    dbs, out = DirectedBeamSearch("default"), {}
    for name, (task, sets) in {"paper": (None, builtin_sets("paper")),
                               "commongen": ("commongen", builtin_sets("commongen-dev")[:100])}.items():
        cfg, ctx = preset(task)
        out[name] = [dbs.generate(ctx, ks, seed=i, config=cfg).text for i, ks in enumerate(sets)]
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path)
    p.add_argument("--compare", nargs=2, type=Path)
    a = p.parse_args(argv)
    if a.compare:
        old, new = (json.loads(f.read_text()) for f in a.compare)
        for name in old:
            same = sum(x == y for x, y in zip(old[name], new[name]))
            print(f"{name}: {same} of {len(old[name])} the same")
    else:
        a.out.write_text(json.dumps(texts(), indent=1))


if __name__ == "__main__":
    main()
