"""The machine a benchmark ran on, as one line: CPU model, the ISA flags that decide kernel speed
(AVX2, AVX-512, VNNI, AMX), cores and memory. Every speed figure is stored next to it."""

import os

from dbs_fast.session import cpu_flags, cpu_model

ISA = {"avx2": "AVX2", "avx512f": "AVX-512", "avx512_vnni": "VNNI", "amx_tile": "AMX"}


def machine() -> str:
    cpu = cpu_model()
    flags = cpu_flags()
    isa = [name for flag, name in ISA.items() if flag in flags]
    gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{cpu} ({', '.join(isa) or 'no AVX2'}), {os.cpu_count()} cpus, {gib:.0f} GiB"
