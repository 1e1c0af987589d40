"""Pipeline schedules as plain data: builders, lowering, validation, simulation.

A schedule is, for each stage, an ordered list of `Action`s. Builders
(`gpipe`, `one_f_one_b`) give compute-only lists (`F`/`B`); `lower` inserts the
communication for a given stage graph and closes the step with `ALLREDUCE`
and `STEP`; `validate` and `simulate` check the result without MPI or
TensorFlow. Short string forms ("F0 F1 B0 B1") keep tests readable.
"""

from dataclasses import dataclass

__all__ = [
    "Action", "F", "B", "SEND_ACT", "RECV_ACT", "SEND_GRAD", "RECV_GRAD",
    "ALLREDUCE", "STEP", "gpipe", "one_f_one_b", "forward_only", "build", "lower", "validate",
    "simulate", "Simulation", "parse", "format_actions", "SCHEDULES",
]

F, B = "F", "B"
SEND_ACT, RECV_ACT = "SEND_ACT", "RECV_ACT"
SEND_GRAD, RECV_GRAD = "SEND_GRAD", "RECV_GRAD"
ALLREDUCE, STEP = "ALLREDUCE", "STEP"

_SHORT = {SEND_ACT: "sa", RECV_ACT: "ra", SEND_GRAD: "sg", RECV_GRAD: "rg"}
_LONG = {v: k for k, v in _SHORT.items()}


@dataclass(frozen=True)
class Action:
    """One thing a stage does: `kind` on `microbatch`, with `peer` stage for messages."""

    kind: str
    microbatch: int = -1
    peer: int = -1

    def __str__(self):
        if self.kind in (F, B):
            return f"{self.kind}{self.microbatch}"
        if self.kind in _SHORT:
            return f"{_SHORT[self.kind]}{self.microbatch}@{self.peer}"
        return self.kind


def parse(text):
    """`"F0 F1 B0 B1"` -> list of Actions (the inverse of `format_actions`)."""
    actions = []
    for word in text.split():
        if word in (ALLREDUCE, STEP):
            actions.append(Action(word))
        elif word[0] in (F, B) and word[1:].isdigit():
            actions.append(Action(word[0], int(word[1:])))
        elif word[:2] in _LONG and "@" in word:
            micro, peer = word[2:].split("@")
            actions.append(Action(_LONG[word[:2]], int(micro), int(peer)))
        else:
            raise ValueError(f"Cannot parse schedule word {word!r} in {text!r}")
    return actions


def format_actions(actions):
    return " ".join(str(a) for a in actions)


def _check_sizes(num_stages, num_microbatches):
    if num_stages < 1 or num_microbatches < 1:
        raise ValueError(
            "A schedule needs num_stages >= 1 and num_microbatches >= 1. "
            f"Received: num_stages={num_stages}, num_microbatches={num_microbatches}"
        )


def gpipe(num_stages, num_microbatches):
    """All forwards, then all backwards (GPipe); M activations alive per stage."""
    _check_sizes(num_stages, num_microbatches)
    m = range(num_microbatches)
    return [[Action(F, i) for i in m] + [Action(B, i) for i in m] for _ in range(num_stages)]


def one_f_one_b(num_stages, num_microbatches):
    """PipeDream-Flush: warm-up forwards, then one forward one backward, then drain.

    Stage s keeps at most S - s microbatches of activations alive, and
    microbatches are backwarded in the same order as with `gpipe`, so both
    accumulate the same gradients in the same order.
    """
    _check_sizes(num_stages, num_microbatches)
    lists = []
    for s in range(num_stages):
        warm = min(num_stages - s - 1, num_microbatches)
        actions = [Action(F, i) for i in range(warm)]
        backward = 0
        for i in range(warm, num_microbatches):
            actions.append(Action(F, i))
            actions.append(Action(B, backward))
            backward += 1
        actions += [Action(B, i) for i in range(backward, num_microbatches)]
        lists.append(actions)
    return lists


def forward_only(num_stages, num_microbatches):
    """Inference: every stage forwards each microbatch in order, no backward."""
    _check_sizes(num_stages, num_microbatches)
    return [[Action(F, i) for i in range(num_microbatches)] for _ in range(num_stages)]


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b}


def build(name, num_stages, num_microbatches):
    try:
        builder = SCHEDULES[name]
    except KeyError:
        raise ValueError(
            f"Unknown schedule {name!r}; choose one of {sorted(SCHEDULES)}. "
            f"Received: schedule={name!r}"
        ) from None
    return builder(num_stages, num_microbatches)


def lower(compute, sources, dests):
    """Insert communication into compute-only lists.

    `sources[s]`: stages that send activations to stage s (its gradients go
    back to them); `dests[s]`: stages stage s sends activations to. Every
    forward is preceded by its receives and followed by its sends; every
    backward is preceded by the gradient receives and followed by the gradient
    sends. The step ends with `ALLREDUCE` and `STEP` on every stage.
    """
    lowered = []
    for s, actions in enumerate(compute):
        out = []
        for a in actions:
            if a.kind == F:
                out += [Action(RECV_ACT, a.microbatch, p) for p in sources[s]]
                out.append(a)
                out += [Action(SEND_ACT, a.microbatch, p) for p in dests[s]]
            elif a.kind == B:
                out += [Action(RECV_GRAD, a.microbatch, p) for p in dests[s]]
                out.append(a)
                out += [Action(SEND_GRAD, a.microbatch, p) for p in sources[s]]
            else:
                out.append(a)
        lowered.append(out + [Action(ALLREDUCE), Action(STEP)])
    return lowered


def validate(lowered, num_microbatches, backward=True):
    """Raise ValueError unless every stage forwards and (with `backward`) backwards
    each microbatch once, backward after forward, and every receive has a
    matching send."""
    sends, recvs = {}, {}
    for s, actions in enumerate(lowered):
        done_f, done_b = set(), set()
        for a in actions:
            if a.kind == F:
                if a.microbatch in done_f:
                    raise ValueError(f"stage {s}: microbatch {a.microbatch} forwarded twice")
                done_f.add(a.microbatch)
            elif a.kind == B:
                if a.microbatch not in done_f:
                    raise ValueError(f"stage {s}: backward of {a.microbatch} before its forward")
                if a.microbatch in done_b:
                    raise ValueError(f"stage {s}: microbatch {a.microbatch} backwarded twice")
                done_b.add(a.microbatch)
            elif a.kind in (SEND_ACT, SEND_GRAD):
                kind = "act" if a.kind == SEND_ACT else "grad"
                sends.setdefault((kind, s, a.peer, a.microbatch), 0)
                sends[(kind, s, a.peer, a.microbatch)] += 1
            elif a.kind in (RECV_ACT, RECV_GRAD):
                kind = "act" if a.kind == RECV_ACT else "grad"
                recvs.setdefault((kind, a.peer, s, a.microbatch), 0)
                recvs[(kind, a.peer, s, a.microbatch)] += 1
        expected = set(range(num_microbatches))
        if done_f != expected or done_b != (expected if backward else set()):
            raise ValueError(
                f"stage {s}: forwards {sorted(done_f)} and backwards {sorted(done_b)} "
                f"must each be {sorted(expected)}"
            )
    if sends != recvs:
        unmatched = sorted(set(sends.items()) ^ set(recvs.items()))
        raise ValueError(f"sends and receives do not match: {unmatched[:5]}")


@dataclass
class Simulation:
    """What `simulate` found: makespan in time units, per-stage busy time,
    bubble fraction (idle share of stage-time), peak activations in flight."""

    makespan: float
    busy: list
    bubble: float
    peak_activations: list
    finish: float = None  # with every stage's tail (None: no tails, the makespan)

    def __post_init__(self):
        if self.finish is None:
            self.finish = self.makespan

    def __str__(self):
        return (f"makespan={self.makespan:g} bubble={self.bubble:.3f} "
                f"peak_activations={self.peak_activations}")


def simulate(lowered, forward_time=1.0, backward_time=2.0, slowdown=None, copies=1,
             latency=0.0, tail=None, waits=None):
    """Play lowered lists with blocking receives and instant, buffered sends.

    `forward_time` / `backward_time`: one number for every stage, or a list
    with one per stage. Raises RuntimeError on deadlock (no stage can move).
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
    """
    n = len(lowered)
    f_times = list(forward_time) if isinstance(forward_time, (list, tuple)) else [forward_time] * n
    b_times = list(backward_time) if isinstance(backward_time, (list, tuple)) else [backward_time] * n
    tails = list(tail) if tail is not None else [0.0] * n
    waits = list(waits) if waits is not None else [(0.0, 0.0)] * n
    if slowdown is not None:
        return _shared(lowered, f_times, b_times, slowdown, copies, latency, tails, waits)
    f_times = [f + w[0] for f, w in zip(f_times, waits)]
    b_times = [b + w[1] for b, w in zip(b_times, waits)]
    pos = [0] * n
    clock = [0.0] * n
    busy = [0.0] * n
    alive = [0] * n
    peak = [0] * n
    sent = {}  # (kind, src, dst, micro) -> time the message is available
    while any(pos[s] < len(lowered[s]) for s in range(n)):
        moved = False
        for s in range(n):
            while pos[s] < len(lowered[s]):
                a = lowered[s][pos[s]]
                if a.kind in (RECV_ACT, RECV_GRAD):
                    key = _message(a, s)
                    if key not in sent:
                        break
                    clock[s] = max(clock[s], sent[key])
                elif a.kind in (SEND_ACT, SEND_GRAD):
                    sent[_message(a, s)] = clock[s] + latency
                elif a.kind in (F, B):
                    cost = f_times[s] if a.kind == F else b_times[s]
                    clock[s] += cost
                    busy[s] += cost
                    alive[s] += 1 if a.kind == F else -1
                    peak[s] = max(peak[s], alive[s])
                pos[s] += 1
                moved = True
        if not moved:
            stuck = {s: str(lowered[s][pos[s]]) for s in range(n) if pos[s] < len(lowered[s])}
            raise RuntimeError(f"schedule deadlocks; stages wait at {stuck}")
    makespan = max(clock) if clock else 0.0
    bubble = 1.0 - sum(busy) / (n * makespan) if makespan else 0.0
    finish = max((c + t for c, t in zip(clock, tails)), default=0.0)
    return Simulation(makespan, busy, bubble, peak, finish)


def _message(action, stage):
    """The (kind, source, destination, microbatch) a send or a receive is about."""
    kind = "act" if action.kind in (SEND_ACT, RECV_ACT) else "grad"
    if action.kind in (SEND_ACT, SEND_GRAD):
        return kind, stage, action.peer, action.microbatch
    return kind, action.peer, stage, action.microbatch


def _shared(lowered, f_times, b_times, slowdown, copies, latency=0.0, tails=None, waits=None):
    """`simulate` on shared cores: between two events (a computation ends, a message
    arrives, a wait ends) every computing stage moves at 1 / slowdown(busy ranks) of
    its own speed (processor sharing); a stage in an F/B's wait (`waits`) moves at
    full speed and is not busy."""
    n = len(lowered)
    tails = tails or [0.0] * n
    waits = waits or [(0.0, 0.0)] * n
    pos, left = [0] * n, [None] * n  # left: work still to do in the F/B (or tail) under way
    hold = [0.0] * n  # seconds of the F/B under way still to wait, before its work
    in_tail = [False] * n
    now, end, finish = 0.0, [0.0] * n, [0.0] * n
    busy, alive, peak = [0.0] * n, [0] * n, [0] * n
    sent = {}  # message -> when it arrives
    while True:
        moved = True
        while moved:  # every action that takes no time, until none can go
            moved = False
            for s in range(n):
                while left[s] is None and pos[s] < len(lowered[s]):
                    a = lowered[s][pos[s]]
                    arrives = sent.get(_message(a, s), float("inf")) if a.kind in (
                        RECV_ACT, RECV_GRAD) else now
                    if arrives > now:  # not sent yet, or still on its way
                        break
                    if a.kind in (SEND_ACT, SEND_GRAD):
                        sent[_message(a, s)] = now + latency
                    if a.kind in (F, B):
                        left[s] = f_times[s] if a.kind == F else b_times[s]
                        hold[s] = waits[s][0 if a.kind == F else 1]
                        alive[s] += 1 if a.kind == F else -1
                        peak[s] = max(peak[s], alive[s])
                        break
                    pos[s] += 1
                    end[s] = finish[s] = now
                    moved = True
                if left[s] is None and pos[s] == len(lowered[s]) and not in_tail[s]:
                    in_tail[s] = True
                    if tails[s] > 0:
                        left[s] = tails[s]
        running = [s for s in range(n) if left[s] is not None]
        arrivals = [t for t in sent.values() if t > now]
        if not running and not arrivals:
            if all(pos[s] == len(lowered[s]) for s in range(n)):
                break
            stuck = {s: str(lowered[s][pos[s]]) for s in range(n) if pos[s] < len(lowered[s])}
            raise RuntimeError(f"schedule deadlocks; stages wait at {stuck}")
        working = [s for s in running if hold[s] <= 0]
        rate = 1.0 / max(slowdown(len(working) * copies), 1e-12)
        ends = {s: hold[s] if hold[s] > 0 else left[s] / rate for s in running}
        first = min(running, key=lambda s: ends[s]) if running else None
        step = ends[first] if running else float("inf")
        arrival = min(arrivals) if arrivals else None
        if arrival is not None and arrival - now < step:
            step, first = arrival - now, None  # a message arrives first
        now = arrival if first is None else now + step
        for s in running:
            tailing = pos[s] == len(lowered[s])
            if not tailing:
                busy[s] += step
            if hold[s] > 0:  # waiting: its work starts once the wait is over
                hold[s] = 0.0 if s == first else hold[s] - step
                continue
            left[s] = 0.0 if s == first else left[s] - step * rate
            if left[s] <= 1e-12 * max(f_times[s], b_times[s], tails[s], 1e-30):
                left[s] = None
                if tailing:
                    finish[s] = now
                else:
                    pos[s] += 1
                    end[s] = finish[s] = now
    makespan = max(end) if end else 0.0
    bubble = 1.0 - sum(busy) / (n * makespan) if makespan else 0.0
    return Simulation(makespan, busy, bubble, peak, max(finish, default=0.0))
