"""Two arms timed in turns in one process: a cold round, then `rounds` rounds whose order
alternates (A B, B A, ...), so that a drift of the machine's speed falls on both alike."""
from __future__ import annotations

import statistics
import time

from dbs_fast.bench.machine import machine


def in_turns(arms: tuple[str, str], run, rounds: int, per: int = 1):
    """`run(arm)` -> its results, every round for each arm. Returns (seconds per item of each timed
    round by arm, each arm's results by round: round 0, the cold one, first); `per`: items a run does."""
    seconds = {arm: [] for arm in arms}
    results = {arm: [] for arm in arms}
    for rnd in range(rounds + 1):
        for arm in (arms if rnd % 2 == 0 else arms[::-1]):
            t0 = time.perf_counter()
            res = run(arm)
            if rnd:                                   # round 0 is the cold one
                seconds[arm].append((time.perf_counter() - t0) / per)
            results[arm].append(res)
    return seconds, results


def summary(arms: tuple[str, str], seconds: dict, texts: dict, **fields) -> dict:
    """The report of `in_turns`: the machine and date, `fields`, each arm's median seconds, the
    second arm's time over the first's pair by pair ("B_over_A", median, and the pairs) and how
    many texts the two arms share."""
    a, b = arms
    pairs = [y / x for x, y in zip(seconds[a], seconds[b])]
    return {"machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), **fields,
            "seconds_per_generation": {k: statistics.median(v) for k, v in seconds.items()},
            f"{b}_over_{a}": statistics.median(pairs), "pairs": pairs,
            "same_texts": sum(x == y for x, y in zip(texts[a], texts[b])), "texts": texts}
