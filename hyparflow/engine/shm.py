"""In-node sums through an MPI-3 shared-memory window (`Win.Allocate_shared`).

The ranks of one communicator that sit on one node share a window: a segment per
rank of a header (three step counters) and a data area. A sum of a buffer, piece by
piece (at most a segment's data area each):

1. each rank copies its piece into its own segment and publishes `written`;
2. once every rank of the node has written, rank i adds its 1/n slice of the piece
   over every segment in local rank order, into its own segment (so every rank gets the same bits: each
   slice is added on one rank only), and, when the communicator spans several
   nodes, sums that slice with the same-position ranks of the other nodes (a ring
   of slices, `cross`: only slices travel between nodes, as Horovod's hierarchical
   allreduce); it writes the slice back into its own segment and publishes
   `summed`;
3. once every rank has summed, each rank copies the others' slices into its buffer
   and publishes `done`; no rank writes its segment again until every rank is done.

A reduce-scatter then an allgather, through memory: each rank moves about three
times the buffer through memory, where a ring of messages moves each chunk through
the MPI library's shared cells several times. Each rank writes only its own
counters (no atomics); `Win.Sync` orders the stores and loads, as MPI's unified
memory model asks. Every wait polls under the watchdog (`comm.poll`), and sums
queue in the order they started (every rank starts them in the same order).

Used by `comm.MPICommunicator.iallreduce` for float32 / float64 buffers of at least
`SHM_BYTES`, when every node holds as many of the communicator's ranks: at least two
when it spans several nodes, more than `AUTO_RANKS` on one (at least two with
HYPARFLOW_SHARED_SUMS=1); otherwise, or where the window cannot be made, the messages
(`why_not` says which). On one node the same phases also sum chosen ranges on chosen
ranks (`Shared.ireduce`: ZeRO's owners, who skip the third phase when no range is for
every rank) and hand ranges out from their owners (`Shared.igather`), for kinds/zero."""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence, Tuple

import numpy as np
import numpy.typing as npt

from .. import settings

__all__ = ["SHM_BYTES", "Shared", "attach", "used"]

Buffer = npt.NDArray[Any]
# (first, end, the rank that adds it, whether the sum reaches every rank)
Range = Tuple[int, int, int, bool]

SHM_BYTES = 64 << 10   # sums of at least this many bytes go through the window
CAPACITY = 16 << 20    # bytes of each rank's data area (larger sums go in pieces)
HEADER = 192           # three counters, each on its own 64-byte line
WRITTEN, SUMMED, DONE = 0, 8, 16   # their positions among the header's int64s
# On one node, by default the window serves groups of more ranks than this. Two
# ranks on 2 cores (benchmarks/shm_sum.py, docs/performance.md): the ring's single
# message each way beat the window's copy in from 8 MB (2.1 vs 5.3 ms at 8 MB); four
# ranks: the window was ahead (6.6 vs 11.4 ms at 8 MB), as the ring's steps grow with
# the ranks and the window's three phases do not. Across nodes it serves two per node
# too: only slices cross then, 2/3 of a flat ring's bytes (benchmarks/hosts_sum.py:
# 2 hosts x 2 ranks at 1 Gbit/s, 67 against 101 MB across per 32 MB sum, 336 against
# 489 ms).
AUTO_RANKS = 2

_USED = [0]   # pieces summed through a window in this process (tests, the trace)


def used() -> int:
    """How many pieces this process has summed through shared windows."""
    return _USED[0]


def _bounds(n: int, parts: int) -> List[Tuple[int, int]]:
    """`np.array_split`'s cut of n values into `parts` slices, as (start, end)."""
    q, r = divmod(n, parts)
    out, a = [], 0
    for p in range(parts):
        b = a + q + (p < r)
        out.append((a, b))
        a = b
    return out


class Shared:
    """The window of one communicator's ranks on a node (`node`), and `cross`: the
    same-position ranks of the other nodes (None on one node). Made by `attach`."""

    def __init__(self, comm: Any, node: Any, cross: Any, win: Any, capacity: int,
                 wait: Callable[[Callable[[], object], str], None]) -> None:
        self.comm, self.node, self.cross, self.win = comm, node, cross, win
        self.capacity, self.wait = capacity, wait
        self.rank, self.size = node.Get_rank(), node.Get_size()
        self.heads: List[Buffer] = []
        self.datas: List[Buffer] = []
        for j in range(self.size):
            memory, _ = win.Shared_query(j)
            raw = np.frombuffer(memory, np.uint8)
            self.heads.append(raw[:HEADER].view(np.int64))
            self.datas.append(raw[HEADER:HEADER + capacity])
        self.head = self.heads[self.rank]
        self.seq = int(self.head[DONE])
        self.queue: List[_Sum] = []

    def all_reached(self, counter: int, seq: int) -> bool:
        self.win.Sync()
        return all(int(h[counter]) >= seq for h in self.heads)

    def publish(self, counter: int, seq: int) -> None:
        self.win.Sync()   # the data before the counter
        self.head[counter] = seq
        self.win.Sync()

    def iallreduce(self, buf: Buffer) -> "_Sum":
        """Start an in-place sum of `buf` over the ranks; a request (`test()`)."""
        return self._queue(_Sum(self, buf.reshape(-1)))

    def ireduce(self, buf: Buffer, ranges: Sequence[Range]) -> "_Sum":
        """Start a sum of parts of the 1-D `buf`: for each (start, end, rank, every)
        of `ranges` (disjoint), `rank` adds [start, end) over the ranks, in rank
        order, into its `buf`; with `every` the sum reaches every rank's `buf` too.
        Elements in no range are left as they are. On one node only (`cross` None)."""
        assert self.cross is None, "ranges are summed on one node only"
        return self._queue(_Sum(self, buf, list(ranges)))

    def igather(self, buf: Buffer, ranges: Sequence[Tuple[int, int, int]]) -> "_Sum":
        """Start handing out parts of the 1-D `buf`: each (start, end, rank) of
        `ranges` goes from `rank`'s `buf` to every other rank's. On one node only."""
        assert self.cross is None, "ranges are handed out on one node only"
        return self._queue(_Sum(self, buf, [(a, b, r, True) for a, b, r in ranges],
                                add=False))

    def _queue(self, request: "_Sum") -> "_Sum":
        self.queue.append(request)
        self.advance()
        return request

    def advance(self) -> None:
        while self.queue and self.queue[0].step():
            self.queue.pop(0)

    def free(self) -> None:
        """Free the window once every rank of the communicator agrees no one can touch
        it any more (a non-blocking barrier under the watchdog: a peer that never
        comes leaves the window to the end of the process, rather than hang)."""
        if self.win is None:
            return
        try:
            self.wait(self.comm.Ibarrier().Test, "the other ranks to free the shared window")
        except Exception:   # noqa: BLE001 - leaking beats hanging at the end of a run
            self.win = None
            return
        win, self.win = self.win, None
        win.Unlock_all()
        win.Free()
        self.node.Free()
        if self.cross is not None:
            self.cross.free()


class _Sum:
    """One operation through the window, piece by piece (a request: `test()` advances
    it): a sum of the whole buffer (`ranges` None: rank i adds the i-th of n equal
    slices, and every rank gets every slice), a sum of `ranges` (`Shared.ireduce`),
    or, with `add` false, `ranges` handed out by the ranks that hold them."""

    def __init__(self, shared: Shared, buf: Buffer, ranges: Optional[List[Range]] = None,
                 add: bool = True) -> None:
        self.shared, self.buf, self.ranges, self.add = shared, buf, ranges, add
        per = shared.capacity // buf.itemsize
        self.pieces = [(a, min(a + per, buf.size)) for a in range(0, buf.size, per)]
        self.piece, self.state, self.done = 0, 0, not self.pieces
        self.seq = 0
        self.cross_req: Any = None
        self.cut: List[Range] = []

    def test(self) -> bool:
        if not self.done:
            self.shared.advance()
        return self.done

    def _cut(self, a: int, b: int) -> List[Range]:
        """The ranges of piece [a, b), from its start."""
        if self.ranges is None:
            return [(lo, hi, r, True) for r, (lo, hi) in enumerate(_bounds(b - a, self.shared.size))]
        return [(max(lo, a) - a, min(hi, b) - a, r, every) for lo, hi, r, every in self.ranges
                if lo < b and hi > a]

    def step(self) -> bool:
        """Advance while nothing waits for a peer; true once the whole buffer is done."""
        s = self.shared
        while not self.done:
            a, b = self.pieces[self.piece]
            m = b - a
            data = [d.view(self.buf.dtype)[:m] for d in s.datas] if self.state else []
            if self.state == 0:
                # The previous piece's readers are done with every segment.
                if not s.all_reached(DONE, s.seq):
                    return False
                self.seq = s.seq + 1
                self.cut = self._cut(a, b)
                mine = s.datas[s.rank].view(self.buf.dtype)[:m]
                if self.add:
                    np.copyto(mine, self.buf[a:b])
                else:   # only what this rank hands out
                    for lo, hi, r, _ in self.cut:
                        if r == s.rank:
                            np.copyto(mine[lo:hi], self.buf[a + lo:a + hi])
                s.publish(WRITTEN, self.seq)
                self.state = 1
                if not self.add:   # nothing to add: straight to the copies
                    s.publish(SUMMED, self.seq)
                    self.state = 3
            elif self.state == 1:
                if not s.all_reached(WRITTEN, self.seq):
                    return False
                for lo, hi, r, _ in self.cut:
                    if r == s.rank:
                        acc = _add(data, s.rank, lo, hi)
                        if s.cross is not None:   # one slice per rank; sizes agree
                            self.cross_req = s.cross.iallreduce(acc)
                self.state = 2
                if not any(every for *_, every in self.cut):
                    # Only the owners want their sums (ZeRO): no rank copies from
                    # another's slot, so no third phase.
                    for lo, hi, r, _ in self.cut:
                        if r == s.rank:
                            np.copyto(self.buf[a + lo:a + hi], data[r][lo:hi])
                    self._next()
            elif self.state == 2:
                if self.cross_req is not None:
                    if not self.cross_req.test():
                        return False
                    self.cross_req = None
                s.publish(SUMMED, self.seq)
                self.state = 3
            else:
                if not s.all_reached(SUMMED, self.seq):
                    return False
                for lo, hi, r, every in self.cut:
                    if (every and r != s.rank) or (self.add and r == s.rank):
                        np.copyto(self.buf[a + lo:a + hi], data[r][lo:hi])
                self._next()
        return True

    def _next(self) -> None:
        """This rank is done with the others' slots for this piece: the next one."""
        self.shared.seq = self.seq
        self.shared.publish(DONE, self.seq)
        _USED[0] += 1
        self.state = 0
        self.piece += 1
        self.done = self.piece == len(self.pieces)


def _add(data: List[Buffer], rank: int, lo: int, hi: int) -> Buffer:
    """[lo, hi) of every segment added, in local rank order, straight into `rank`'s own
    segment (read there by no other rank): the same bits whichever rank adds."""
    terms = [d[lo:hi] for d in data]
    acc = terms[rank]
    if rank >= 2:   # overwritten by the first addition, added later
        terms[rank] = acc.copy()
    np.add(terms[0], terms[1], out=acc)
    for term in terms[2:]:
        np.add(acc, term, out=acc)
    return acc


def why_not(sizes: List[int]) -> Optional[str]:
    """Why ranks on nodes holding `sizes` ranks each cannot share windows (None: they can)."""
    if len(set(sizes)) > 1:
        return (f"the nodes hold different numbers of the group's ranks ({sorted(set(sizes))})"
                "; shared sums need as many on each")
    if sizes[0] < 2:
        return "one rank of the group per node: nothing to share"
    return None


def attach(comm: Any, wait: Callable[[Callable[[], object], str], None],
           wrap: Callable[[Any], Any],
           node_of: Optional[Callable[[int], int]] = None) -> Tuple[Optional[Shared], str]:
    """Collective over the mpi4py communicator `comm`: its window (None when it cannot
    have one) and a sentence saying how its sums go. `node_of`: rank -> node number,
    for tests that play several nodes on one; default: the MPI library's
    shared-memory split. `wait(test, what)` polls under the watchdog; `wrap` makes
    the communicator of the same-position ranks of the nodes a hyparflow one (its
    sums: a ring of messages, the same bits on every rank)."""
    from mpi4py import MPI

    choice = settings.shared_sums()
    if choice is False:
        return None, "messages (HYPARFLOW_SHARED_SUMS=0)"
    rank = comm.Get_rank()
    # Everyone here first, so the blocking set-up calls below cannot wait on a
    # rank that never comes.
    wait(comm.Ibarrier().Test, "the other ranks to set up the shared window")
    node = (comm.Split(node_of(rank), rank) if node_of is not None
            else comm.Split_type(MPI.COMM_TYPE_SHARED, rank))
    sizes = np.zeros(comm.Get_size(), np.int64)
    req = comm.Iallgather(np.array([node.Get_size()], np.int64), sizes)
    wait(req.Test, "the other ranks' node sizes")
    reason = why_not([int(s) for s in sizes])
    if reason is None and choice is None and sizes[0] <= AUTO_RANKS and len(sizes) == sizes[0]:
        reason = (f"{int(sizes[0])} of the group's ranks on one node: there a ring's one "
                  "message each way moves fewer bytes; HYPARFLOW_SHARED_SUMS=1 forces the window")
    if reason is not None:
        node.Free()
        return None, f"messages ({reason})"
    capacity = CAPACITY   # not the first sum's size: a later one may be larger
    win: Any = None   # an mpi4py window (untyped)
    error = ""
    try:
        win = MPI.Win.Allocate_shared(HEADER + capacity, 1, comm=node)
    except Exception as exc:   # noqa: BLE001 - any failure: the messages instead
        error = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    ok = np.array([0 if win is None else 1], np.int32)
    req = comm.Iallreduce(MPI.IN_PLACE, ok, op=MPI.MIN)
    wait(req.Test, "the other ranks' shared windows")
    if not ok[0]:
        if win is not None:
            win.Free()
        node.Free()
        return None, f"messages (no shared window: {error or 'failed on another rank'})"
    win.Lock_all(MPI.MODE_NOCHECK)
    memory, _ = win.Shared_query(node.Get_rank())
    np.frombuffer(memory, np.uint8)[:HEADER].view(np.int64)[:] = 0
    win.Sync()
    # Zeroed counters everywhere before anyone reads them.
    wait(node.Ibarrier().Test, "the other ranks to clear the shared window")
    cross = wrap(comm.Split(node.Get_rank(), rank)) if len(sizes) > sizes[0] else None
    nodes = len(sizes) // int(sizes[0])
    how = (f"shared memory ({int(sizes[0])} ranks" + (f" x {nodes} nodes, slices between "
                                                      "nodes)" if cross is not None else ")"))
    return Shared(comm, node, cross, win, capacity, wait), how
