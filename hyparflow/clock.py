"""Timing a call: the median of several, each after a chosen idle time."""

import statistics
import time

__all__ = ["timed"]


def timed(fn, repeats=5, idle=0.0):
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
