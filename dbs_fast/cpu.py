"""The CPU a figure was measured on: its model name and the ISA flags that decide kernel speed."""
from __future__ import annotations

import platform

# ISA flags that decide kernel speed, as the manifest of a `--quantize auto` export records them
ISA = {"avx2": "AVX2", "avx512f": "AVX-512", "avx512_vnni": "AVX-512 VNNI", "avx_vnni": "AVX-VNNI",
       "amx_int8": "AMX-INT8"}


def cpu_flags() -> set[str]:
    """The ISA flags of this CPU (/proc/cpuinfo; empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        return set()


def cpu_model() -> str:
    """This CPU's model name (/proc/cpuinfo), else what the platform module says."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def cpu_signature(flags: set[str] | None = None) -> dict:
    """The CPU a timing was taken on: model name and the ISA flags of `ISA` it has."""
    flags = cpu_flags() if flags is None else flags
    return {"cpu": cpu_model(), "isa": [name for flag, name in ISA.items() if flag in flags]}
