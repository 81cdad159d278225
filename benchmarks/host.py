"""The machine a benchmark ran on, as one line: CPU model, the ISA flags that decide kernel speed
(`dbs_fast.session.ISA`: AVX2, AVX-512, VNNI, AMX), cores and memory. Every speed figure is
stored next to it."""

import os

from dbs_fast.session import cpu_signature


def machine() -> str:
    sig = cpu_signature()
    gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{sig['cpu']} ({', '.join(sig['isa']) or 'no AVX2'}), {os.cpu_count()} cpus, {gib:.0f} GiB"
