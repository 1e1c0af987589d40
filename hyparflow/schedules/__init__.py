"""Pipeline schedules as plain data: builders, lowering, validation, simulation.

A schedule is, for each stage, an ordered list of `Action`s. Builders
(`gpipe`, `one_f_one_b`, `zb_h1`, `zb_batched`) give compute-only lists;
`fuse` turns a forward followed at once by its backward on a stage that sends
nothing into one `FB` action (one compiled call; the executor and the planner
both read it); `lower` inserts the communication for a given stage graph and
closes the step with `ALLREDUCE` and `STEP`; `validate` and `simulate` check
the result without MPI or TensorFlow. Short string forms ("F0 F1 B0 B1") keep
tests readable.

Split backward (the zero-bubble schedules of Qi et al., ICLR 2024): `B` then
computes only what the stage's inputs need (sent upstream at once) and keeps,
for the layers whose weight gradients can wait, their inputs and output
gradients; `W` computes those weight gradients later, for one microbatch
(`W3`) or for several at once over their concatenated rows (`W0-3`: 0 to 3),
where the products run at the size the kernels are fast at.
"""

from dataclasses import dataclass, replace

__all__ = [
    "Action", "F", "B", "W", "FB", "SEND_ACT", "RECV_ACT", "SEND_GRAD", "RECV_GRAD",
    "ALLREDUCE", "STEP", "gpipe", "one_f_one_b", "zb_h1", "zb_batched", "forward_only", "build",
    "fuse", "lower", "validate", "simulate", "Simulation", "parse", "format_actions", "SCHEDULES",
    "SPLIT", "FILLS", "splits", "interleaved", "check_interleaved", "chunks_of", "CHUNKED",
]

F, B, W, FB = "F", "B", "W", "FB"
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
    count: int = 1  # W: microbatches microbatch .. microbatch + count - 1 in one call
    # Interleaved schedules: which of the rank's model chunks the action is for. Rank
    # s of S ranks runs chunk c as virtual stage s + c * S; `peer` is then a virtual
    # stage too. 0 (every other schedule): the rank's one stage, and stage = rank.
    chunk: int = 0

    @property
    def microbatches(self):
        return range(self.microbatch, self.microbatch + self.count)

    def __str__(self):
        tail = f".{self.chunk}" if self.chunk else ""
        if self.kind == W and self.count > 1:
            return f"W{self.microbatch}-{self.microbatch + self.count - 1}{tail}"
        if self.kind in (F, B, W, FB):
            return f"{self.kind}{self.microbatch}{tail}"
        if self.kind in _SHORT:
            return f"{_SHORT[self.kind]}{self.microbatch}{tail}@{self.peer}"
        return self.kind


def parse(text):
    """`"F0 F1 B0 B1"` -> list of Actions (the inverse of `format_actions`); a chunk
    other than 0 is a suffix: `F3.1` (microbatch 3 of chunk 1), `sa3.1@2`."""
    actions = []
    for word in text.split():
        head, _, rest = word.partition("@")
        if "." in head:
            head, _, c = head.rpartition(".")
            if not c.isdigit():
                raise ValueError(f"Cannot parse schedule word {word!r} in {text!r}")
            plain = head + ("@" + rest if rest else "")
            actions += [replace(a, chunk=int(c)) for a in parse(plain)]
            continue
        if word in (ALLREDUCE, STEP):
            actions.append(Action(word))
        elif word[:2] == FB and word[2:].isdigit():
            actions.append(Action(FB, int(word[2:])))
        elif word[0] == W and "-" in word and all(p.isdigit() for p in word[1:].split("-")):
            first, last = map(int, word[1:].split("-"))
            actions.append(Action(W, first, count=last - first + 1))
        elif word[0] in (F, B, W) and word[1:].isdigit():
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


def gpipe(num_stages, num_microbatches, chunks=1):
    """All forwards, then all backwards (GPipe); M activations alive per stage. With
    model chunks, forwards chunk by chunk and backwards from the last chunk down (any
    M: what the interleaved schedule falls back to for a short last batch)."""
    _check_sizes(num_stages, num_microbatches)
    m = range(num_microbatches)
    return [[Action(F, i, chunk=c) for c in range(chunks) for i in m]
            + [Action(B, i, chunk=c) for c in reversed(range(chunks)) for i in m]
            for _ in range(num_stages)]


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


def interleaved(num_stages, num_microbatches, chunks=2):
    """Interleaved 1F1B (Megatron-LM's virtual pipeline, Narayanan et al. SC'21): the
    model is cut into S * v virtual stages and rank s runs chunks c = 0 .. v-1 as
    virtual stages s, s + S, s + 2S, ...; one list per rank, each action naming its
    chunk. Forwards go through the chunks in groups of S microbatches (chunk 0 of
    microbatches 0..S-1, then chunk 1 of the same, ...), backwards likewise from the
    last chunk down; rank s warms up with 2 (S - s - 1) + (v - 1) S forwards, then
    alternates, then drains. With compute split evenly, the bubble is (S-1) chunk
    times at each end: (S - 1) / (v M) of the ideal time instead of (S - 1) / M.

    Each chunk backwards its microbatches in increasing order, as `gpipe` does, so
    gradients sum in the same order. Needs M a multiple of S (as Megatron does)."""
    _check_sizes(num_stages, num_microbatches)
    check_interleaved(num_stages, num_microbatches, chunks)
    S, M, v = num_stages, num_microbatches, chunks
    total = M * v

    def nth(k, forward):
        """The k-th forward (or backward) of a rank: (chunk, microbatch)."""
        chunk = (k % (S * v)) // S
        return (chunk if forward else v - 1 - chunk), (k // (S * v)) * S + k % S

    lists = []
    for s in range(S):
        warm = total if M == S else min((S - s - 1) * 2 + (v - 1) * S, total)
        actions = []
        for k in range(warm):
            c, i = nth(k, True)
            actions.append(Action(F, i, chunk=c))
        for k in range(total - warm):
            c, i = nth(k + warm, True)
            actions.append(Action(F, i, chunk=c))
            c, i = nth(k, False)
            actions.append(Action(B, i, chunk=c))
        for k in range(total - warm, total):
            c, i = nth(k, False)
            actions.append(Action(B, i, chunk=c))
        lists.append(actions)
    return lists


def check_interleaved(num_stages: int, num_microbatches: int, chunks: int) -> None:
    """Clear errors for what interleaving needs: v >= 2 chunks, S >= 2, M % S == 0."""
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 2:
        raise ValueError(f"schedule='interleaved' needs num_chunks >= 2 model chunks per "
                         f"rank (1 is plain '1f1b'). Received: num_chunks={chunks!r}")
    if num_stages < 2:
        raise ValueError(f"schedule='interleaved' needs num_stages >= 2 (one stage has no "
                         f"pipeline bubble to shrink). Received: num_stages={num_stages}")
    if num_microbatches % num_stages:
        raise ValueError(
            f"schedule='interleaved' needs num_microbatches to be a multiple of num_stages "
            f"(microbatches go through the chunks in groups of num_stages, as in Megatron-LM). "
            f"Received: num_microbatches={num_microbatches}, num_stages={num_stages}; use "
            f"num_microbatches={-(-num_microbatches // num_stages) * num_stages}.")


def chunks_of(lists):
    """How many model chunks each rank of these lists runs (1 unless interleaved)."""
    return 1 + max((a.chunk for actions in lists for a in actions), default=0)


def _greedy(num_stages, num_microbatches, batch_w):
    """A split-backward schedule found by playing the pipeline with unit-time F, B
    and W (as Qi et al. build theirs). Each stage, when it can, starts what can
    start earliest, B before F before W at equal times: the oldest B whose gradient
    has come; the next F while fewer than S - s microbatches are alive on stage s;
    deferred W work.

    Without `batch_w` (ZB-H1) a microbatch is alive from its F to its W (1F1B's
    memory) and each W is one microbatch's. With `batch_w` it is alive from F to B
    (1F1B's tapes), and W runs only when the stage would otherwise wait (or has
    nothing else left), for every microbatch waiting, in one call.

    B's come in microbatch order on every stage, as with `gpipe` and `one_f_one_b`,
    so the inputs' gradients sum in the same order."""
    S, M = num_stages, num_microbatches
    lists = [[] for _ in range(S)]
    free = [0] * S                             # when each stage is next free
    f_end = [[None] * M for _ in range(S)]
    b_end = [[None] * M for _ in range(S)]
    nf, nb, nw = [0] * S, [0] * S, [0] * S
    while any(nw[s] < M for s in range(S)):
        best = None  # (start, priority, stage, kind)
        for s in range(S):
            options = []
            if nb[s] < nf[s]:
                ready = b_end[s + 1][nb[s]] if s + 1 < S else f_end[s][nb[s]]
                if ready is not None:
                    options.append((max(free[s], ready), 0, s, B))
            alive = nf[s] - (nb[s] if batch_w else nw[s])
            if nf[s] < M and alive < S - s:
                ready = f_end[s - 1][nf[s]] if s > 0 else 0
                if ready is not None:
                    options.append((max(free[s], ready), 1, s, F))
            if nw[s] < nb[s]:
                soonest = min((o[0] for o in options), default=None)
                if not batch_w or soonest is None or soonest > free[s]:
                    options.append((free[s], 2, s, W))
            for o in options:
                if best is None or o[:3] < best[:3]:
                    best = o
        if best is None:
            raise RuntimeError("no stage can move")  # cannot happen: B's always come
        start, _, s, kind = best
        length = 1
        if kind == B:
            lists[s].append(Action(B, nb[s]))
            b_end[s][nb[s]] = start + 1
            nb[s] += 1
        elif kind == F:
            lists[s].append(Action(F, nf[s]))
            f_end[s][nf[s]] = start + 1
            nf[s] += 1
        else:
            length = nb[s] - nw[s] if batch_w else 1
            lists[s].append(Action(W, nw[s], count=length))
            nw[s] += length
        free[s] = start + length
    return lists


def zb_h1(num_stages, num_microbatches):
    """ZB-H1 (Qi et al.): 1F1B with each backward split into B and W, W filling
    the waits. At most S - s microbatches alive on stage s from F to W, as
    1F1B's activations from F to B."""
    _check_sizes(num_stages, num_microbatches)
    return _greedy(num_stages, num_microbatches, batch_w=False)


def zb_batched(num_stages, num_microbatches):
    """Zero-bubble with batched W: F's and B's with 1F1B's bound (at most S - s
    microbatches' tapes alive on stage s), and W only where the stage would wait
    (and at its end), for every microbatch waiting, in one call over their
    concatenated rows. Costs, besides 1F1B's memory, the kept inputs and output
    gradients of the deferred layers for up to M microbatches (the replica's
    batch)."""
    _check_sizes(num_stages, num_microbatches)
    return _greedy(num_stages, num_microbatches, batch_w=True)


def one_f_one_b_w(num_stages, num_microbatches):
    """1F1B's order with the backward split: each B computes only what the stage's
    inputs need (so the gradient goes upstream sooner, and the drain is shorter),
    and one W at the end computes every deferred weight gradient over the whole
    replica batch's rows, where the products run fastest and no per-microbatch
    gradient is summed. Costs, besides 1F1B's memory, the kept inputs and output
    gradients of the deferred layers for the M microbatches (the replica's batch)."""
    lists = one_f_one_b(num_stages, num_microbatches)
    return [actions + [Action(W, 0, count=num_microbatches)] for actions in lists]


def forward_only(num_stages, num_microbatches, chunks=1):
    """Inference: every stage forwards each microbatch in order, no backward (with
    model chunks, chunk by chunk: a rank's chunk c needs only earlier chunks)."""
    _check_sizes(num_stages, num_microbatches)
    return [[Action(F, i, chunk=c) for c in range(chunks) for i in range(num_microbatches)]
            for _ in range(num_stages)]


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b, "1f1b-w": one_f_one_b_w, "zb-h1": zb_h1,
             "zb-batched": zb_batched, "interleaved": interleaved}
CHUNKED = ("interleaved",)  # schedules whose ranks run several model chunks
SPLIT = ("1f1b-w", "zb-h1", "zb-batched")  # schedules whose backward is split into B and W
# Schedules whose executor also runs W wherever a stage would wait for a message
# (`Executor._fill`), on top of the W's placed here.
FILLS = ("zb-batched",)


def splits(actions):
    """Whether a stage's list splits its backward (has W actions)."""
    return any(a.kind == W for a in actions)


def fuse(compute, dests, recompute=False):
    """Replace, on each stage that sends no activations (the last), every F followed
    at once by the B of the same microbatch with one `FB` action: forward and
    backward in one compiled call, no tape kept between two calls. Not with
    `recompute` (whose point is to keep no forward's intermediates across calls;
    fused, a stage keeps them only inside the call, so fusing would be allowed, but
    the recomputed backward is what the user asked to measure)."""
    if recompute:
        return [list(a) for a in compute]
    out, n = [], len(compute)
    for s, actions in enumerate(compute):
        if all(dests[s + c * n] for c in range(chunks_of([actions]))):
            out.append(list(actions))
            continue
        fused, k = [], 0
        while k < len(actions):
            a = actions[k]
            nxt = actions[k + 1] if k + 1 < len(actions) else None
            if (a.kind == F and nxt is not None and nxt.kind == B and nxt.chunk == a.chunk
                    and nxt.microbatch == a.microbatch and not dests[s + a.chunk * n]):
                fused.append(Action(FB, a.microbatch, chunk=a.chunk))
                k += 2
            else:
                fused.append(a)
                k += 1
        out.append(fused)
    return out


def build(name, num_stages, num_microbatches, chunks=1):
    """Compute-only lists of schedule `name` (F, B and, for split schedules, W), one per
    rank; `chunks`: model chunks per rank, for the schedules in `CHUNKED` only."""
    try:
        builder = SCHEDULES[name]
    except KeyError:
        raise ValueError(
            f"Unknown schedule {name!r}; choose one of {sorted(SCHEDULES)}. "
            f"Received: schedule={name!r}"
        ) from None
    if name in CHUNKED:
        return builder(num_stages, num_microbatches, chunks)
    if chunks != 1:
        raise ValueError(f"num_chunks={chunks} model chunks per rank need "
                         f"schedule='interleaved'; {name!r} runs one stage per rank. "
                         f"Received: schedule={name!r}, num_chunks={chunks}")
    return builder(num_stages, num_microbatches)


def lower(compute, sources, dests):
    """Insert communication into compute-only lists.

    `sources[s]`: stages that send activations to stage s (its gradients go
    back to them); `dests[s]`: stages stage s sends activations to. With model
    chunks (interleaved), these are virtual stages: chunk c of rank s is virtual
    stage s + c * len(compute), and every message's peer is a virtual stage. Every
    forward is preceded by its receives and followed by its sends; every
    backward is preceded by the gradient receives and followed by the gradient
    sends. The step ends with `ALLREDUCE` and `STEP` on every stage.
    """
    lowered, n = [], len(compute)
    for s, actions in enumerate(compute):
        out = []
        for a in actions:
            v, i, c = s + a.chunk * n, a.microbatch, a.chunk
            if a.kind == F:
                out += [Action(RECV_ACT, i, p, chunk=c) for p in sources[v]]
                out.append(a)
                out += [Action(SEND_ACT, i, p, chunk=c) for p in dests[v]]
            elif a.kind == B:
                out += [Action(RECV_GRAD, i, p, chunk=c) for p in dests[v]]
                out.append(a)
                out += [Action(SEND_GRAD, i, p, chunk=c) for p in sources[v]]
            elif a.kind == FB:
                out += [Action(RECV_ACT, i, p, chunk=c) for p in sources[v]]
                out += [Action(RECV_GRAD, i, p, chunk=c) for p in dests[v]]
                out.append(a)
                out += [Action(SEND_GRAD, i, p, chunk=c) for p in sources[v]]
            else:
                out.append(a)
        lowered.append(out + [Action(ALLREDUCE), Action(STEP)])
    return lowered


def validate(lowered, num_microbatches, backward=True):
    """Raise ValueError unless every stage forwards and (with `backward`) backwards
    each microbatch once, backward after forward, and every receive has a
    matching send. A stage that splits its backward (W actions) computes the
    weights of every microbatch once, each after its B. With model chunks
    (interleaved), each rank does all this for every one of its chunks, and
    messages are matched between virtual stages."""
    sends, recvs = {}, {}
    n, chunks = len(lowered), chunks_of(lowered)
    for s, actions in enumerate(lowered):
        done_f, done_b, done_w = set(), set(), set()
        for a in actions:
            where = f"stage {s}" if chunks == 1 else f"stage {s} chunk {a.chunk}"
            key = (a.chunk, a.microbatch)
            if a.kind in (F, FB):
                if key in done_f:
                    raise ValueError(f"{where}: microbatch {a.microbatch} forwarded twice")
                done_f.add(key)
            if a.kind in (B, FB):
                if key not in done_f:
                    raise ValueError(f"{where}: backward of {a.microbatch} before its forward")
                if key in done_b:
                    raise ValueError(f"{where}: microbatch {a.microbatch} backwarded twice")
                done_b.add(key)
            elif a.kind == W:
                for i in a.microbatches:
                    if (a.chunk, i) not in done_b:
                        raise ValueError(f"{where}: weights of {i} ({a}) before its B")
                    if (a.chunk, i) in done_w:
                        raise ValueError(f"{where}: weights of {i} computed twice ({a})")
                    done_w.add((a.chunk, i))
            elif a.kind in (SEND_ACT, SEND_GRAD, RECV_ACT, RECV_GRAD):
                table = sends if a.kind in (SEND_ACT, SEND_GRAD) else recvs
                key = _message(a, s, n)
                table[key] = table.get(key, 0) + 1
        expected = {(c, i) for c in range(chunks) for i in range(num_microbatches)}
        if done_f != expected or done_b != (expected if backward else set()):
            def show(done):
                return sorted(done) if chunks > 1 else sorted(i for _, i in done)
            raise ValueError(
                f"stage {s}: forwards {show(done_f)} and backwards {show(done_b)} "
                f"must each be {show(expected)}"
            )
        if done_w and done_w != expected:
            raise ValueError(f"stage {s}: weights of {sorted(i for _, i in done_w)} computed; "
                             f"a stage that splits its backward must compute them for "
                             f"{sorted(range(num_microbatches))}")
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
    peak_kept: list = None  # microbatches between B and W (split backward) at most

    def __post_init__(self):
        if self.finish is None:
            self.finish = self.makespan

    def __str__(self):
        return (f"makespan={self.makespan:g} bubble={self.bubble:.3f} "
                f"peak_activations={self.peak_activations}")


def simulate(lowered, forward_time=1.0, backward_time=2.0, slowdown=None, copies=1,
             latency=0.0, tail=None, waits=None, weight_time=0.0, transfer=None):
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
    sent = {}  # (kind, src, dst, micro) -> time the message is available
    while any(pos[s] < len(lowered[s]) for s in range(n)):
        moved = False
        for s in range(n):
            while pos[s] < len(lowered[s]):
                a = lowered[s][pos[s]]
                if a.kind in (RECV_ACT, RECV_GRAD):
                    key = _message(a, s, n)
                    if key not in sent:
                        break
                    clock[s] = max(clock[s], sent[key])
                elif a.kind in (SEND_ACT, SEND_GRAD):
                    key = _message(a, s, n)
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


def _cost(a, s, f_times, b_times, w_cost, n=None):
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


def _kept(lowered):
    """Per stage, the most microbatches whose weight gradients wait (after B, before W)."""
    out = []
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


def _message(action, stage, ranks):
    """The (kind, source, destination, microbatch) a send or a receive on `stage` (of
    `ranks` lists) is about; with chunks, source and destination are virtual stages."""
    kind = "act" if action.kind in (SEND_ACT, RECV_ACT) else "grad"
    here = stage + action.chunk * ranks
    if action.kind in (SEND_ACT, SEND_GRAD):
        return kind, here, action.peer, action.microbatch
    return kind, action.peer, here, action.microbatch


class _Links:
    """When a message sent at a time arrives: after `latency`, or, on a network link
    (`transfer`), once the link has carried the messages sent on it before and
    then this one."""

    def __init__(self, transfer, latency):
        self.transfer, self.latency, self.free = transfer or {}, latency, {}

    def __call__(self, key, now):
        seconds = self.transfer.get(key[:3])
        if not seconds:
            return now + self.latency
        link = key[1:3]
        done = max(now, self.free.get(link, 0.0)) + seconds
        self.free[link] = done
        return max(done, now + self.latency)


def _shared(lowered, f_times, b_times, slowdown, copies, arrive, tails=None, waits=None,
            w_cost=None):
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
                    arrives = sent.get(_message(a, s, n), float("inf")) if a.kind in (
                        RECV_ACT, RECV_GRAD) else now
                    if arrives > now:  # not sent yet, or still on its way
                        break
                    if a.kind in (SEND_ACT, SEND_GRAD):
                        key = _message(a, s, n)
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
