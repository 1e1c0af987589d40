"""Where a rank would wait for a message, it does work that is due anyway: the step's
`W^T` copies (`kernels.Transposed`), and, in schedules that fill waits, batched W
(the deferred kernels' gradients). `Executor` takes these methods; which Dense
layers keep a `W^T` at all is chosen here too, by timing, before the first step."""

import time

from .. import schedules as sched
from .comm import poll

__all__ = ["Fill", "FILL_AT", "FILL_GRACE"]

FILL_AT = 2  # microbatches a W filling a wait takes at least (`Executor._fill`)
# A wait is filled with W only if its message has not come after this share of the
# W's expected time (`Executor._fill`).
FILL_GRACE = 0.25


class Fill:
    """The executor's filling of waits (a mixin: it reads the executor's stage, stages,
    communicator, schedule and timeline)."""

    def _choose_transposed(self, rows, microbatches):
        """Before the first training step (a collective): which Dense layers keep `W^T`
        (`kernels`). Each rank measures its own; the lowest rank holding a node decides
        for every rank that holds it, so replicas and tensor ranks run one product."""
        mine = {}
        if rows:
            for stage in self.stages:
                mine.update(stage.transposed_choices(rows, microbatches))
        agreed = {}
        for report in (self.comm.allgather_obj(mine) if self.comm.size > 1 else [mine]):
            for node, keep in report.items():
                agreed.setdefault(node, keep)
        self.adopt({"transposed": agreed})

    def _refresh_transposed(self):
        """The step's W^T copies (`Stage.begin_step`), where the rank would wait for a
        message anyway or, with no such wait, before its first backward: on a first
        stage they were on the pipeline's critical path before its first forward.
        Returns whether it copied any."""
        start = time.perf_counter()
        copies = sum(stage.refresh_transposed() for stage in self.stages)
        if copies:
            self._record("W^T copies", "transpose", start, layers=copies)
        return bool(copies)

    def _fill(self, reqs):
        """Where the schedule fills waits with batched W (the schedule table's `fills`): before
        waiting for a message that has not come, compute the weights of the
        microbatches waiting for them (at least `FILL_AT`, for products of at least
        that many microbatches' rows). The static schedule places W by unit times;
        this puts it where this run's stages actually wait, once the message has not
        come within `FILL_GRACE` of the W's expected time. Which microbatches go
        into one call then varies with timing, so sums differ by round-off only.
        Any wait also takes the step's W^T copies first (`_refresh_transposed`).
        Returns whether it computed anything."""
        if all(r is None or r.test() for r in reqs):
            return False  # it has come: no wait to fill
        filled = self._refresh_transposed()
        stage = self.stage
        if (not sched.TABLE[self.schedule].fills or not stage.splitting
                or len(stage.waiting) < FILL_AT):
            return filled
        ids = sorted(stage.waiting)
        # A message about to come is waited for: a W that outlasts the wait by far
        # delays this rank's next action, and with it the peer's (measured: a 13 ms
        # W filling a wait of 0.3 ms cost the MLP's S=2 pipeline 10 % a step).
        # (Polled as any wait is: spinning only where the rank has a core of its own.)
        deadline = time.perf_counter() + FILL_GRACE * stage.weight_seconds(ids)
        come = lambda: all(r is None or r.test() for r in reqs)  # noqa: E731
        poll(lambda: time.perf_counter() >= deadline or come(), None, "a message",
             self.comm.spin)
        if come():
            return filled
        start = time.perf_counter()
        stage.weight_grads(ids)
        self._record(f"W{ids[0]}-{ids[-1]}", "weight", start, microbatch=ids[0], count=len(ids),
                     layers=len(stage.deferred), filled=True)
        return True
