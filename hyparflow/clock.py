"""Timing a call: the median of several, each after a chosen idle time."""

from __future__ import annotations

import statistics
import time
from typing import Callable

__all__ = ["timed"]


def timed(fn: Callable[[], object], repeats: int = 5, idle: float = 0.0) -> float:
    """Median seconds of `repeats` calls of `fn`, each after `idle` seconds of sleep
    (a pipeline stage's call follows a wait for its input, and runs slower for it)."""
    times = []
    for _ in range(repeats):
        if idle:
            time.sleep(idle)
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)
