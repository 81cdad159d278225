"""The machine a benchmark ran on, as one line: CPU model, the ISA flags that decide kernel speed
(`dbs_fast.cpu.ISA`: AVX2, AVX-512, VNNI, AMX), cores and memory. Every speed figure is
stored next to it."""

import os

from dbs_fast.cpu import cpu_signature
from dbs_fast.kv.prefix_cache import DECODE_GRAPH


def machine() -> str:
    sig = cpu_signature()
    gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{sig['cpu']} ({', '.join(sig['isa']) or 'no AVX2'}), {os.cpu_count()} cpus, {gib:.0f} GiB"


def decode_graph_export(ap, model: str):
    """The export dir of `--model`, or an argparse error when it has no decode.onnx."""
    from pathlib import Path


    d = Path(model)
    if not (d / DECODE_GRAPH).is_file():
        ap.error(f"{d / DECODE_GRAPH} not found: export the model with this version (`dbs-fast export`)")
    return d


def report_arms(res: dict, arms, summary: str, out: str | None) -> None:
    """Print each arm's medians (seconds per generation, model and kernel ms per step) and the
    summary line of a whole-generation A/B, and write `res` to `out` as JSON if given."""
    import json

    for arm in arms:
        r = res[arm]
        print(f"{arm:8s} {r['seconds']:.2f} s per generation, model {r['model_ms']:.1f} ms, kernel "
              f"{r['kernel_ms']:.1f} ms per step")
    print(f"{summary} ({res['machine']})")
    if out:
        with open(out, "w") as f:
            json.dump(res, f, indent=2)
