"""The planner's cost model, pure and typed: a layer call's costs (`Row`), the network
(alpha-beta, per ring size, across hosts), the measured compute of a node's ranks, and
the interpolation between two measured batch sizes.

`planner` (the search and the command), `measure` (the drivers) and `profile` (the
layer profiles) import it; it imports nothing of hyparflow, TensorFlow, Keras or MPI.
"""

from __future__ import annotations

from typing import Callable, Mapping, NamedTuple, Protocol

__all__ = ["Row", "Network", "Compute", "Across", "Exchanges", "interpolate", "work_and_wait",
           "tensor_spans", "crosses", "summa_bytes", "summa_seconds"]


class Row(NamedTuple):
    """One layer call's costs (`profile.fit_model`): seconds = fixed + per_sample x
    batch; bytes of its weights, of their optimizer state, and of its activations per
    sample."""
    fixed: float
    per_sample: float
    param_bytes: float
    optimizer_bytes: float
    activation_bytes: float

    def seconds(self, batch: float) -> float:
        return self.fixed + self.per_sample * batch


class Network:
    """alpha (seconds per message) and beta (seconds per byte) within and across nodes.

    `groups`: {g: (alpha, beta)} per round of a ring over g ranks, measured on this
    node with every rank of the plan running (`measure.rings`). They replace the
    two-rank figures for collectives of g ranks: with more ranks than cores, each
    round waits for its peers to be scheduled, which a two-rank ping-pong never sees.
    `wait`: seconds until a rank that waits for a message has it once it is sent,
    the other ranks computing (`measure.rings`): on an oversubscribed node, every
    pipeline receive that waits pays it."""

    def __init__(self, alpha: float, beta: float, alpha_inter: float | None = None,
                 beta_inter: float | None = None,
                 groups: Mapping[int, tuple[float, float]] | None = None,
                 exchanges: Mapping[int, tuple[float, float]] | None = None,
                 wait: float = 0.0) -> None:
        self.alpha, self.beta, self.wait = alpha, beta, wait
        self.alpha_inter = alpha if alpha_inter is None else alpha_inter
        self.beta_inter = beta if beta_inter is None else beta_inter
        self.groups: dict[int, tuple[float, float]] = dict(groups or {})
        self.exchanges: dict[int, tuple[float, float]] = dict(exchanges or {})

    def _terms(self, across: bool, ranks: int | None = None) -> tuple[float, float]:
        if across:
            return self.alpha_inter, self.beta_inter
        if ranks is None:
            return self.alpha, self.beta
        return self.groups.get(ranks, (self.alpha, self.beta))

    def message(self, nbytes: float, across: bool = False, ranks: int | None = None) -> float:
        """One message, between two of `ranks` ranks that run together (default two)."""
        a, b = self._terms(across, ranks)
        return a + nbytes * b

    def exchange(self, nbytes: float, ranks: int, across: bool = False) -> float:
        """A split layer's exchange between `ranks` tensor ranks, each sending its
        `nbytes` to every other: measured as hyparflow runs it (inside the compiled
        stage, through a Python call) when known, else (ranks - 1) messages; `across`:
        the tensor ranks span hosts, (ranks - 1) messages over the link between them."""
        if across:
            return (ranks - 1) * self.message(nbytes, across=True)
        if ranks in self.exchanges:
            a, b = self.exchanges[ranks]
            return a + nbytes * b
        return (ranks - 1) * self.message(nbytes, ranks=ranks)

    def allreduce(self, nbytes: float, ranks: int, across: bool = False,
                  per_node: int = 1) -> float:
        """A gradient sum over `ranks` ranks: a ring (2 (R-1)/R bytes, 2 (R-1) rounds).
        Across nodes holding `per_node` >= 2 of them each, as the engine sums them
        (`engine/shm.py`): within each node through its shared window, and between
        nodes only each rank's 1/k slice, in a ring of the N nodes' same-position
        ranks; the k slices share a node's link, which so carries 2 (N-1)/N bytes, in
        2 (N-1) rounds instead of 2 (R-1)."""
        if ranks <= 1:
            return 0.0
        k = per_node
        if across and k >= 2 and ranks % k == 0 and ranks > k:
            nodes = ranks // k
            a, b = self._terms(True)
            return (self.allreduce(nbytes, k)
                    + 2 * (nodes - 1) / nodes * nbytes * b + 2 * (nodes - 1) * a)
        a, b = self._terms(across, ranks)
        return 2 * (ranks - 1) / ranks * nbytes * b + 2 * (ranks - 1) * a


class Exchanges(Protocol):
    """What a split kind's exchange cost needs of a network (`Network`, `Across`)."""

    def exchange(self, nbytes: float, ranks: int) -> float: ...


class Across:
    """A network whose exchanges all go over the link between hosts."""

    def __init__(self, network: Network) -> None:
        self.network = network

    def exchange(self, nbytes: float, ranks: int) -> float:
        return self.network.exchange(nbytes, ranks, across=True)


class Compute:
    """The model's compiled step measured with the plan's ranks on this node
    (`measure.compute`): `times` {n busy ranks: {batch: seconds}}, `optimizer` seconds
    per parameter byte with every rank stepping at once.

    With it, a plan's compute is what one of its ranks does alone (its threads, not
    the profiling process's), slowed by how many ranks compute at the same moment:
    on a shared node, ranks contend for memory bandwidth, and beyond the cores, for
    the cores themselves."""

    def __init__(self, times: Mapping[int | str, Mapping[int | str, float]],
                 optimizer: float | None = None) -> None:
        self.times: dict[int, dict[int, float]] = {
            int(n): {int(b): float(t) for b, t in row.items()} for n, row in times.items()}
        self.optimizer = optimizer
        self.most = max(self.times)

    def _at(self, busy: int, m: float) -> float:
        """Seconds of the whole step on `m` samples with `busy` ranks computing:
        affine in the batch between the two measured sizes."""
        points = sorted(self.times[busy].items())
        (b0, t0), (b1, t1) = points[0], points[-1]
        slope = (t1 - t0) / (b1 - b0) if b1 != b0 else 0.0
        return max(t0 + slope * (m - b0), 1e-9)

    def alone(self, m: float) -> float:
        return self._at(1, m)

    def slowdown(self, m: float) -> Callable[[float], float]:
        """busy ranks -> how many times longer each computation then takes."""
        alone = self.alone(m)
        factors = {n: max(1.0, self._at(n, m) / alone) for n in self.times}

        def slow(busy: float) -> float:
            count = max(1, int(round(busy)))
            if count in factors:
                return factors[count]
            return factors[self.most] * count / self.most  # more ranks than measured
        return slow


def interpolate(points: tuple[float, float], values: tuple[float, float], x: float,
                beyond: str = "flat") -> float:
    """`values` at `points` (two batch sizes) at `x`: linear in between; beyond them
    "flat" (the nearer value: for ratios, which level off) or "extend" (the line
    continued: for times, affine in the batch), never below a tenth of the nearer
    value."""
    (x0, x1), (y0, y1) = points, values
    if x1 == x0:
        return y0
    fraction = (x - x0) / (x1 - x0)
    if beyond == "flat":
        fraction = min(max(fraction, 0.0), 1.0)
    elif beyond != "extend":
        raise ValueError(f"`beyond` must be 'flat' or 'extend'. Received: {beyond!r}")
    y = y0 + (y1 - y0) * fraction
    return max(y, 0.1 * (y0 if x < x0 else y1 if x > x1 else min(y0, y1)))


def work_and_wait(every: float, one: float, slowdown: Callable[[float], float] | None,
                  ranks: int, num_tensor: int) -> tuple[float, float]:
    """(work, wait) of a computation that took `every` seconds with `ranks` ranks busy
    and `one` with `num_tensor`: work * slowdown(busy) + wait through both points,
    neither below zero (all work when nothing slows it)."""
    if slowdown is None:
        return every, 0.0
    many, few = slowdown(ranks), slowdown(num_tensor)
    if many <= few:
        return every / many, 0.0
    work = min(max((every - one) / (many - few), 0.0), every / many)
    return work, max(every - work * many, 0.0)


def tensor_spans(num_tensor: int, ranks_per_node: int | None) -> bool:
    """Whether some stage's `num_tensor` consecutive ranks span hosts of
    `ranks_per_node` ranks filled in order."""
    return bool(ranks_per_node) and num_tensor > 1 and (
        num_tensor > (ranks_per_node or 0) or (ranks_per_node or 1) % num_tensor != 0)


def crosses(src: int, dst: int, stages: int, replicas: int, num_tensor: int,
            ranks_per_node: int | None) -> bool:
    """Whether the boundary from stage `src` to `dst` crosses hosts in some replica, with
    `ranks_per_node` ranks on each host filled in rank order (None: one host)."""
    if not ranks_per_node:
        return False
    return any((r * stages + src) * num_tensor // ranks_per_node
               != (r * stages + dst) * num_tensor // ranks_per_node for r in range(replicas))


def summa_bytes(q: int, x_bytes: float, w_bytes: float) -> float:
    """Bytes one rank of a q x q mesh receives (and as many it sends) for one Dense on
    the mesh (SUMMA, `kinds.mesh.dense`) per microbatch, of a whole input of `x_bytes`
    and a kernel of `w_bytes`: three products (Y = XW, dX = dY W^T, dW = X^T dY),
    each moving (q - 1) blocks of 1/q^2 of its two operands (X or dX's partial sums,
    W or dW's): 3 (q - 1) / q^2 (X + W). Optimus's 6 (q - 1) / q, in units of a
    1/q share of each operand (X = W = 1/q): the 1D pair's 2 (T - 1) / T moves whole
    activations instead."""
    return 3 * (q - 1) * (x_bytes + w_bytes) / (q * q)


def summa_seconds(q: int, x_bytes: float, w_bytes: float,
                  network: "Exchanges") -> tuple[float, float]:
    """(forward, backward) seconds of one Dense on the q x q mesh per microbatch: q
    rounds forward, in each one rank of a row broadcasting its block of X to the q - 1
    others while one of a column broadcasts its block of W (together); backward 4q
    rounds (W's blocks broadcast, dX's partial sums reduced, X's blocks broadcast,
    dW's reduced). A round of one root and q - 1 peers is costed as a split layer's
    exchange among q ranks of that block (the measured one, on this node)."""
    x, w = x_bytes / (q * q), w_bytes / (q * q)
    forward = q * network.exchange(x + w, q)
    backward = 2 * q * (network.exchange(x, q) + network.exchange(w, q))
    return forward, backward
