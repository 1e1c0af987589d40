"""Gradient buckets whose allreduces start during the step's last backward.

A bucket's gradients are final once the step's last backward has made them,
and that backward makes the last layers' gradients first. The stage's hooked
backward reports each variable as it arrives (`Stage.on_arrival`); a bucket
whose variables have all arrived starts its non-blocking allreduce at once, and
every arrival also tests the allreduces in flight, which is when MPI moves them
forward. What has not started by the end of the backward starts then.

Ranks must start the collectives of one communicator in the same order, so
buckets start strictly in their list order, never in arrival order. The list
follows the order in which gradients arrive: at the first step the buckets are
cut in the model's order and each rank notes the arrivals; rank 0 of each
group then chooses the order for its group, and the buckets are cut again
(as PyTorch's DDP rebuilds its buckets after its first iteration).
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Collection, Dict, Iterable, List, Optional, Protocol, Sequence, Set, Tuple

import numpy as np

from .. import settings
from . import wire as _wire
from .comm import Buffer, Communicator, Request


class _Gradients(Protocol):
    """What the buckets need of a stage's gradient buffers (engine.grads)."""

    def set_buckets(self, buckets: List[List[int]], sparse: Collection[int] = ...) -> None: ...
    def flat_grads(self, positions: List[int]) -> Buffer: ...


class _Stage(Protocol):
    """What the buckets need of a stage (engine.stage.Stage): its trainable variables
    (Keras's, untyped) and its gradient buffers."""

    trainable: Sequence[Any]
    grads: _Gradients


# A group's variables: (its communicator, None or one rank: nothing to sum; positions).
Group = Tuple[Optional[Communicator], List[int]]
# ZeRO's sum of a bucket on its owner only: reduce(comm, bucket, flat) -> request.
Reduce = Callable[[Communicator, List[int], Buffer], Optional[Request]]

__all__ = ["Buckets", "BUCKET_BYTES", "enabled"]

BUCKET_BYTES = 8 << 20  # gradient allreduce bucket size


def enabled(default: object) -> bool:
    """Whether buckets start inside the backward: HYPARFLOW_OVERLAP=1 or 0, else
    `default` (the runtime's: when the ranks span several nodes).

    Within one node, the cores that compute also move and add the gradients
    (MPI copies through shared memory), so starting early moves that work into
    the backward without hiding it: measured on 2 ranks over 2 cores, 0-5%
    slower. Between nodes the network moves the bytes while the cores compute."""
    forced = settings.overlap()
    return bool(default) if forced is None else forced


def cut(positions: Iterable[int], variables: Sequence[Any],
        nbytes: Optional[int] = None) -> List[List[int]]:
    """Consecutive runs of `positions` of about `nbytes` (default BUCKET_BYTES) each,
    one variable at least."""
    nbytes = BUCKET_BYTES if nbytes is None else nbytes
    out: List[List[int]] = []
    current: List[int] = []
    size = 0
    for k in positions:
        n = 4 * int(np.prod(variables[k].shape))
        if current and size + n > nbytes:
            out.append(current)
            current, size = [], 0
        current.append(k)
        size += n
    if current:
        out.append(current)
    return out


class Buckets:
    """The allreduce buckets of one rank's stage: [(communicator, [positions in
    stage.trainable])] for each group of `groups`, started as they complete."""

    def __init__(self, stage: _Stage, groups: Iterable[Group], wire: Any = None) -> None:
        """`wire`: the numpy dtype the sums travel in (None: float32, MPI's allreduce;
        16 bits: `engine.wire.Sum`, with a loss scale per group for float16)."""
        self.stage, self.groups = stage, list(groups)
        self.wire = wire
        self.scales = ([_wire.LossScale() for _ in self.groups]
                       if _wire.scaled(wire) else None)
        self.sent = 0  # bytes this rank sent in its sums (float32: as a ring would)
        self._lock = threading.Lock()
        self.sparse: Set[int] = set()  # positions whose pairs are gathered instead (`hyparflow.sparse`)
        self._lay([positions for _, positions in self.groups])
        self.learned = False
        # How a shared bucket is summed: comm.iallreduce by default; ZeRO sums each
        # row range on its owner only (`hyparflow.zero`): reduce(comm, bucket, flat).
        self.reduce: Optional[Reduce] = None
        self.arm()

    def _lay(self, orders: Sequence[Sequence[int]]) -> None:
        orders = [[k for k in order if k not in self.sparse] for order in orders]
        self.buckets = [(comm, bucket) for (comm, _), order in zip(self.groups, orders)
                        for bucket in cut(order, self.stage.trainable) if bucket]
        self._bucket_of = {k: j for j, (_, bucket) in enumerate(self.buckets) for k in bucket}
        # Each bucket's group (its loss scale, with a float16 wire).
        self._group_of = [g for g, ((_, _), order) in enumerate(zip(self.groups, orders))
                          for bucket in cut(order, self.stage.trainable) if bucket]
        self._orders = orders
        # Bytes of the dense buckets summed with other ranks each step (for the trace):
        # fixed by the layout, so counted here rather than at every step.
        width = 4 if self.wire is None else self.wire.itemsize
        self.nbytes = sum(width * int(np.prod(self.stage.trainable[k].shape))
                          for comm, bucket in self.buckets if _shares(comm) for k in bucket)
        self.stage.grads.set_buckets([bucket for _, bucket in self.buckets], self.sparse)

    def exclude(self, positions: Iterable[int]) -> None:
        """Take sparse variables out of the buckets (between steps)."""
        self.sparse |= set(positions)
        self._lay(self._orders)
        self.arm()

    @property
    def shared(self) -> bool:
        """Whether any variable is summed with another rank."""
        return any(_shares(comm) for comm, _ in self.groups)

    def arm(self) -> None:
        """Before a step: nothing arrived, nothing started."""
        self._missing = [len(bucket) for _, bucket in self.buckets]
        self._requests: List[Optional[Request]] = [None] * len(self.buckets)
        self._next = 0  # the first bucket not started
        self._arrivals: List[int] = []
        self._left = sum(self._missing)  # variables still to arrive
        self._early = 0  # buckets started while others were still being computed
        self.early = self.inside = 0

    def arrive(self, k: int) -> None:
        """Variable k's gradient is final (called from inside the backward)."""
        with self._lock:
            self._arrivals.append(k)
            j = self._bucket_of.get(k)
            if j is not None:
                self._missing[j] -= 1
                self._left -= 1
                while self._next < len(self.buckets) and self._missing[self._next] == 0:
                    self._start(self._next)
            self._progress()

    def _start(self, j: int) -> None:
        comm, bucket = self.buckets[j]
        flat = self.stage.grads.flat_grads(bucket)
        if comm is None or not _shares(comm):
            self._requests[j] = None
        elif self.reduce is not None:
            self._requests[j] = self.reduce(comm, bucket, flat)
        elif self.wire is not None:
            # One flag per variable ends the buffer (`Gradients.flat_grads`).
            scale = self.scales[self._group_of[j]].value if self.scales else 1.0
            self._requests[j] = _wire.start_sum(comm, flat, flat.size - len(bucket),
                                                self.wire, scale, j, self)
        else:
            self._requests[j] = comm.iallreduce(flat)
            # What a ring allreduce sends from each rank: 2 (n-1)/n of the buffer.
            self.sent += int(flat.nbytes * 2 * (comm.size - 1) / comm.size)
        self._next = j + 1
        self._early += self._left > 0

    def _progress(self) -> None:
        for request in self._requests[:self._next]:
            if request is not None:
                request.test()

    def finish(self) -> List[Request]:
        """After the step's backwards: start the buckets that have not started; returns
        every request, to wait for. `inside`: how many had started inside the
        backward; `early`: how many while others were still being computed."""
        with self._lock:
            self.early, self.inside = self._early, self._next
            while self._next < len(self.buckets):
                self._start(self._next)
            return [r for r in self._requests if r is not None]

    def settle(self) -> None:
        """After the step's sums are done: each group's loss scale (float16) halves if
        one of its buckets overflowed (and was summed again in float32), else counts a
        good step. Every rank of a group sees the same sums, so they agree."""
        if not self.scales:
            return
        overflowed = [False] * len(self.groups)
        for j, request in enumerate(self._requests):
            if getattr(request, "overflowed", False):
                overflowed[self._group_of[j]] = True
        for g, scale in enumerate(self.scales):
            if _shares(self.groups[g][0]):
                scale.update(overflowed[g])

    def learn(self) -> None:
        """After the first step: lay the buckets out in the order gradients arrived
        on each group's rank 0. Collective over each group (every member calls it
        at the same point of the same step)."""
        self.learned = True
        seen = {k: n for n, k in enumerate(self._arrivals)}
        orders: List[List[int]] = []
        for comm, positions in self.groups:
            # Never-arrived variables last, in the model's order.
            mine = sorted(range(len(positions)),
                          key=lambda j: (seen.get(positions[j], len(seen)), j))
            if comm is not None and _shares(comm):
                mine = comm.bcast_obj(mine, 0)
            orders.append([positions[j] for j in mine])
        self._lay(orders)
        self.arm()

    def early_positions(self) -> List[int]:
        """The variables whose gradients are worth reporting as they arrive: those of
        every shared bucket but the last to start (which starts after the backward
        anyway). Each report costs some tens of microseconds."""
        shared = [bucket for comm, bucket in self.buckets if _shares(comm)]
        return sorted(k for bucket in shared[:-1] for k in bucket)


def _shares(comm: Optional[Communicator]) -> bool:
    return comm is not None and comm.size > 1
