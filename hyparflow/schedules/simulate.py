"""Playing a lowered schedule with per-stage times: makespan, bubble, peak live
activations, and on shared cores, processor sharing (`simulate`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from .actions import (ALLREDUCE, B, F, FB, RECV_ACT, RECV_GRAD, SEND_ACT, SEND_GRAD, STEP, W,
                      Action, chunks_of, message, splits)

__all__ = ["Simulation", "simulate"]

Lowered = Sequence[Sequence[Action]]          # one action list per rank
# A time for every stage, or one per (virtual) stage: a list or a tuple (anything else
# is one number for all).
Times = Union[float, List[float], Tuple[float, ...]]
WeightCost = Callable[[int, int], float]      # (stage, microbatches) -> seconds of a W
Message = Tuple[object, ...]                  # actions.message: (kind, source, destination, microbatch)


@dataclass
class Simulation:
    """What `simulate` found: makespan in time units, per-stage busy time,
    bubble fraction (idle share of stage-time), peak activations in flight."""

    makespan: float
    busy: List[float]
    bubble: float
    peak_activations: List[int]
    finish: float | None = None  # with every stage's tail (None: no tails, the makespan)
    peak_kept: List[int] | None = None  # microbatches between B and W (split backward) at most

    def __post_init__(self) -> None:
        if self.finish is None:
            self.finish = self.makespan

    def __str__(self) -> str:
        return (f"makespan={self.makespan:g} bubble={self.bubble:.3f} "
                f"peak_activations={self.peak_activations}")


def simulate(lowered: Lowered, forward_time: Times = 1.0, backward_time: Times = 2.0,
             slowdown: Optional[Callable[[int], float]] = None, copies: int = 1,
             latency: float = 0.0, tail: Optional[Sequence[float]] = None,
             waits: Optional[Sequence[Tuple[float, float]]] = None,
             weight_time: Union[Times, WeightCost] = 0.0,
             transfer: Optional[Mapping[Message, float]] = None) -> Simulation:
    """Play lowered lists with blocking receives and instant, buffered sends.

    `forward_time` / `backward_time` / `weight_time`: one number for every
    stage, or a list with one per stage (or, for lists with model chunks, one per
    virtual stage: chunk c of rank s is s + c * ranks; a rank runs one action at a
    time whichever chunk it is for). A `B` takes `backward_time`, an `FB`
    forward and backward time; a `W` of k microbatches takes `weight_time(s, k)`
    when it is a function, else k times the number (so for a split schedule,
    `backward_time` is B's share of the backward only). Raises RuntimeError on deadlock (no stage can move).
    Sends take no time (a caller adds their cost to the sender's times), and a
    message is there as soon as it is sent unless `latency` says otherwise;
    ALLREDUCE and STEP take no time.

    `slowdown`: for stages that share cores and memory, a function of how many
    ranks compute at once giving how many times longer each computation then
    takes; `copies` identical pipelines (replicas, tensor ranks) run alongside,
    so `k` busy stages are `k * copies` busy ranks. The play is then event by
    event: a stage computing alone in the bubble runs at full speed, and slows
    down when the others start.

    `latency`: seconds from a send until a receiver that waits for it has it (on
    an oversubscribed node, the wait for its next poll and for a core); it holds
    up only a receiver that gets there first.

    `tail`: per stage, work it does once its list is done (its gradients'
    allreduce and its optimizer step, which the executor starts as soon as the
    stage's last backward ends, while earlier stages still compute); `finish` is
    when the last tail ends. On shared cores a tail takes cores like a computation.

    `waits`: per stage, (forward, backward) seconds of each F and B spent waiting
    (for the other tensor ranks inside a split layer's exchange): they pass at full
    speed and take no core, however many ranks compute.

    `transfer`: {(kind, source, destination): seconds} of a message on a network
    link ("act" or "grad", virtual stages), which moves while both stages go on:
    it arrives that long after it is sent, and the messages of one link go one
    after another.
    """
    n = len(lowered)
    f_times = list(forward_time) if isinstance(forward_time, (list, tuple)) else [forward_time] * n
    b_times = list(backward_time) if isinstance(backward_time, (list, tuple)) else [backward_time] * n
    tails = list(tail) if tail is not None else [0.0] * n
    waits = list(waits) if waits is not None else [(0.0, 0.0)] * n
    w_cost: WeightCost
    if callable(weight_time):
        w_cost = weight_time
    else:
        w_times = list(weight_time) if isinstance(weight_time, (list, tuple)) else [weight_time] * n
        w_cost = lambda s, k: k * w_times[s]  # noqa: E731
    kept = _kept(lowered)
    arrive = _Links(transfer, latency)
    if slowdown is not None:
        sim = _shared(lowered, f_times, b_times, slowdown, copies, arrive, tails, waits, w_cost)
        sim.peak_kept = kept
        return sim
    f_times = [f + waits[k % n][0] for k, f in enumerate(f_times)]
    b_times = [b + waits[k % n][1] for k, b in enumerate(b_times)]
    pos = [0] * n
    clock = [0.0] * n
    busy = [0.0] * n
    alive = [0] * n
    peak = [0] * n
    sent: Dict[Message, float] = {}  # (kind, src, dst, micro) -> time the message is available
    while any(pos[s] < len(lowered[s]) for s in range(n)):
        moved = False
        for s in range(n):
            while pos[s] < len(lowered[s]):
                a = lowered[s][pos[s]]
                if a.kind in (RECV_ACT, RECV_GRAD):
                    key = message(a, s, n)
                    if key not in sent:
                        break
                    clock[s] = max(clock[s], sent[key])
                elif a.kind in (SEND_ACT, SEND_GRAD):
                    key = message(a, s, n)
                    sent[key] = arrive(key, clock[s])
                elif a.kind in (F, B, FB, W):
                    cost = _cost(a, s, f_times, b_times, w_cost, n)
                    clock[s] += cost
                    busy[s] += cost
                    alive[s] += {F: 1, B: -1}.get(a.kind, 0)
                    peak[s] = max(peak[s], alive[s] + (a.kind == FB))
                pos[s] += 1
                moved = True
        if not moved:
            stuck = {s: str(lowered[s][pos[s]]) for s in range(n) if pos[s] < len(lowered[s])}
            raise RuntimeError(f"schedule deadlocks; stages wait at {stuck}")
    makespan = max(clock) if clock else 0.0
    bubble = 1.0 - sum(busy) / (n * makespan) if makespan else 0.0
    finish = max((c + t for c, t in zip(clock, tails)), default=0.0)
    return Simulation(makespan, busy, bubble, peak, finish, kept)


def _cost(a: Action, s: int, f_times: Sequence[float], b_times: Sequence[float],
          w_cost: WeightCost, n: Optional[int] = None) -> float:
    """Seconds of work action `a` takes on stage `s` (of `n` ranks); times given per
    virtual stage (more than one per rank: chunks) are read at the action's."""
    v = s + a.chunk * n if n is not None and len(f_times) > n else s
    if a.kind == F:
        return f_times[v]
    if a.kind == B:
        return b_times[v]
    if a.kind == FB:
        return f_times[v] + b_times[v]
    return w_cost(s, a.count)


def _kept(lowered: Lowered) -> List[int]:
    """Per stage, the most microbatches whose weight gradients wait (after B, before W)."""
    out: List[int] = []
    for actions in lowered:
        now = peak = 0
        for a in actions:
            if a.kind in (B, FB) and splits(actions):
                now += 1
            elif a.kind == W:
                now -= a.count
            peak = max(peak, now)
        out.append(peak)
    return out


class _Links:
    """When a message sent at a time arrives: after `latency`, or, on a network link
    (`transfer`), once the link has carried the messages sent on it before and
    then this one."""

    def __init__(self, transfer: Optional[Mapping[Message, float]], latency: float) -> None:
        self.transfer: Mapping[Message, float] = transfer or {}
        self.latency = latency
        self.free: Dict[Message, float] = {}   # link (source, destination) -> when it is free

    def __call__(self, key: Message, now: float) -> float:
        seconds = self.transfer.get(key[:3])
        if not seconds:
            return now + self.latency
        link = key[1:3]
        done = max(now, self.free.get(link, 0.0)) + seconds
        self.free[link] = done
        return max(done, now + self.latency)


def _shared(lowered: Lowered, f_times: Sequence[float], b_times: Sequence[float],
            slowdown: Callable[[int], float], copies: int, arrive: _Links,
            tails: Sequence[float], waits: Sequence[Tuple[float, float]],
            w_cost: WeightCost) -> Simulation:
    """`simulate` on shared cores: between two events (a computation ends, a message
    arrives, a wait ends) every computing stage moves at 1 / slowdown(busy ranks) of
    its own speed (processor sharing); a stage in an F/B's wait (`waits`) moves at
    full speed and is not busy."""
    n = len(lowered)
    tails = tails or [0.0] * n
    waits = waits or [(0.0, 0.0)] * n
    pos = [0] * n
    left: List[Optional[float]] = [None] * n  # work still to do in the F/B (or tail) under way
    hold = [0.0] * n  # seconds of the F/B under way still to wait, before its work
    in_tail = [False] * n
    now, end, finish = 0.0, [0.0] * n, [0.0] * n
    busy, alive, peak = [0.0] * n, [0] * n, [0] * n
    sent: Dict[Message, float] = {}  # message -> when it arrives
    while True:
        moved = True
        while moved:  # every action that takes no time, until none can go
            moved = False
            for s in range(n):
                while left[s] is None and pos[s] < len(lowered[s]):
                    a = lowered[s][pos[s]]
                    arrives = sent.get(message(a, s, n), float("inf")) if a.kind in (
                        RECV_ACT, RECV_GRAD) else now
                    if arrives > now:  # not sent yet, or still on its way
                        break
                    if a.kind in (SEND_ACT, SEND_GRAD):
                        key = message(a, s, n)
                        sent[key] = arrive(key, now)
                    if a.kind in (F, B, FB, W):
                        left[s] = _cost(a, s, f_times, b_times, w_cost, n)
                        hold[s] = {F: waits[s][0], B: waits[s][1], W: 0.0}.get(
                            a.kind, waits[s][0] + waits[s][1])
                        alive[s] += {F: 1, B: -1}.get(a.kind, 0)
                        peak[s] = max(peak[s], alive[s] + (a.kind == FB))
                        break
                    pos[s] += 1
                    end[s] = finish[s] = now
                    moved = True
                if left[s] is None and pos[s] == len(lowered[s]) and not in_tail[s]:
                    in_tail[s] = True
                    if tails[s] > 0:
                        left[s] = tails[s]
        work = {s: w for s, w in enumerate(left) if w is not None}   # of the running stages
        running = list(work)
        arrivals = [t for t in sent.values() if t > now]
        if not running and not arrivals:
            if all(pos[s] == len(lowered[s]) for s in range(n)):
                break
            stuck = {s: str(lowered[s][pos[s]]) for s in range(n) if pos[s] < len(lowered[s])}
            raise RuntimeError(f"schedule deadlocks; stages wait at {stuck}")
        working = [s for s in running if hold[s] <= 0]
        rate = 1.0 / max(slowdown(len(working) * copies), 1e-12)
        ends = {s: hold[s] if hold[s] > 0 else work[s] / rate for s in running}
        first: Optional[int] = min(running, key=lambda s: ends[s]) if running else None
        step = ends[first] if first is not None else float("inf")
        arrival = min(arrivals) if arrivals else None
        if arrival is not None and arrival - now < step:
            step, first = arrival - now, None  # a message arrives first
        if first is None:
            assert arrival is not None   # nothing ends first: a message is on its way
            now = arrival
        else:
            now += step
        for s in running:
            tailing = pos[s] == len(lowered[s])
            if not tailing:
                busy[s] += step
            if hold[s] > 0:  # waiting: its work starts once the wait is over
                hold[s] = 0.0 if s == first else hold[s] - step
                continue
            remaining = left[s] = 0.0 if s == first else work[s] - step * rate
            if remaining <= 1e-12 * max(f_times[s], b_times[s], tails[s], 1e-30):
                left[s] = None
                if tailing:
                    finish[s] = now
                else:
                    pos[s] += 1
                    end[s] = finish[s] = now
    makespan = max(end) if end else 0.0
    bubble = 1.0 - sum(busy) / (n * makespan) if makespan else 0.0
    return Simulation(makespan, busy, bubble, peak, max(finish, default=0.0))
