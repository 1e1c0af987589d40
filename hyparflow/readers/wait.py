"""The time a rank waits for its next batch: per step in History, in the trace's
timeline, and a warning once (rank 0) when it passes a fifth of the step."""

import sys
import time

__all__ = ["Waits", "LIMIT"]

LIMIT = 0.2     # a wait past this share of the step is named
SETTLED = 4     # steps timed before judging (the first traces and compiles)


class Waits:
    """Wraps the steps' iterator: `over(steps)` yields its items, timing each wait;
    `stepped()` marks the end of the step that followed. `summary()` for History."""

    def __init__(self, timeline=None, warn=False):
        self.timeline, self.warn = timeline, warn
        self.waits, self.steps = [], []
        self._ready = None
        self.warned = False

    def over(self, steps):
        items = iter(steps)
        while True:
            start = time.perf_counter()
            item = next(items, None)
            end = time.perf_counter()
            if item is None:
                return
            self.waits.append(end - start)
            self._ready = start
            if self.timeline is not None:
                self.timeline.add("data", "data", start, end, step=len(self.waits) - 1)
            yield item

    def stepped(self):
        """The step after the last wait ended: its time, wait included."""
        if self._ready is None:
            return
        self.steps.append(time.perf_counter() - self._ready)
        self._ready = None
        if self.warn and not self.warned and len(self.steps) > SETTLED:
            share = self.fraction()
            if share > LIMIT:
                self.warned = True
                wait = sum(self.waits[1:len(self.steps)]) / (len(self.steps) - 1)
                print(f"hyparflow: waiting for data took {share:.0%} of each step on rank 0 "
                      f"({wait * 1e3:.1f} ms a step): training waits for its input. Give the "
                      "reading more threads (map(num_parallel_calls=tf.data.AUTOTUNE), a "
                      "PyDataset's workers), keep decoded data (dataset.cache(), "
                      "dataset.snapshot(path)), or run fewer ranks per node with more "
                      "threads each (docs/training.md, 'Waiting for data').",
                      file=sys.stderr, flush=True)

    def fraction(self):
        """The share of the steps' time spent waiting, the first step left out."""
        n = len(self.steps)
        total = sum(self.steps[1:n])
        return sum(self.waits[1:n]) / total if total > 0 else 0.0

    def summary(self):
        return {"seconds": list(self.waits), "fraction": self.fraction()}
