"""Numba in one place: where compiled kernels are cached, and how its worker threads start and
how many there are. The kernels (`kernels`, `kv_copy`) import `njit`/`prange` from here, so the
cache directory is set before Numba loads."""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

from .home import home

# cache=True needs a writable place; a read-only install falls back to the dbs-fast home.
os.environ.setdefault("NUMBA_CACHE_DIR", str(home() / "numba-cache"))

import numba  # noqa: E402
from numba import njit, prange  # noqa: E402,F401  (re-exported for the kernels)

_threads_started = False
SPIN_COUNT = "20000"      # libgomp's GOMP_SPINCOUNT for the kernel's workers (its default: 300000)


def start_threads(sleep_when_idle: bool = True) -> None:
    """Start Numba's worker threads (once), by default with their OpenMP runtime told to spin only
    briefly (GOMP_SPINCOUNT=20000, well under a millisecond) before it sleeps.

    The kernel runs between two ONNX Runtime calls on the same cores. GNU OpenMP's workers spin
    300000 times after each parallel region by default, and took the cores from the next decode
    step: 7 ms (5%) of the default's 70-row step and 8 ms of GPT-2 large int8's (AMD EPYC, AVX2).
    Not spinning at all (OMP_WAIT_POLICY=PASSIVE) gained the same on whole generations, but every
    parallel region then ends with a sleep and a wake-up: back-to-back calls took 7.5-11 ms
    instead of 6.7 on the same machine. libgomp reads the variable once, when it is loaded, so it
    is set around that load and then restored. Left alone when the user set GOMP_SPINCOUNT or
    OMP_WAIT_POLICY, when torch is loaded already, or with `sleep_when_idle=False` (the PyTorch
    baseline): torch's libgomp has the same soname, so the runtime loaded first is the one both
    use, and the baseline keeps PyTorch's own behaviour."""
    global _threads_started
    if _threads_started:
        return
    _threads_started = True
    from numba.np.ufunc.parallel import _launch_threads  # noqa: PLC0415  (Numba's private launcher)

    if (not sleep_when_idle or "torch" in sys.modules
            or any(v in os.environ for v in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"))):
        _launch_threads()
        return
    os.environ["GOMP_SPINCOUNT"] = SPIN_COUNT
    try:
        _launch_threads()
    finally:
        del os.environ["GOMP_SPINCOUNT"]


def set_threads(n: int | None, sleep_when_idle: bool = True) -> None:
    """Numba's thread count (the kernel runs between ORT calls, on the same cores); see
    `start_threads` for `sleep_when_idle`."""
    start_threads(sleep_when_idle)
    from .runtime import env_threads

    n = n or env_threads() or numba.config.NUMBA_NUM_THREADS
    numba.set_num_threads(max(1, min(n, numba.config.NUMBA_NUM_THREADS)))


# what `compiled_meanwhile`'s process runs: every kernel the engine calls from the host
WARM_UP = "from dbs_fast import kernels; from dbs_fast.kv import kv_copy; kernels.warm_up(); kv_copy.warm_up()"


@contextlib.contextmanager
def compiled_meanwhile():
    """The kernels compiled into Numba's cache by a process of their own while the block runs (the
    embedded model's export: a minute, mostly on one core), so that the first generation after it
    loads them instead of compiling them (24 s of a 30 s first generation on a 2-core Xeon). The
    process shares this one's cache directory and imports this one's dbs_fast; it is waited for at
    the end of the block and stopped if the block fails. Neither its failure nor a process that
    cannot start is an error: the generation then compiles, as it would without it. Yields the
    process (None where none started)."""
    # this dbs_fast first on the path, not one in the working directory: Numba's cache is per source file
    root = str(Path(__file__).resolve().parents[1])
    try:
        proc = subprocess.Popen([sys.executable, "-c", f"import sys; sys.path.insert(0, {root!r}); {WARM_UP}"],
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    except OSError:                     # no process to be had: the generation compiles
        yield None
        return
    try:
        yield proc
    except BaseException:
        proc.kill()
        raise
    finally:
        proc.wait()
