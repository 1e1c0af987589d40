"""Communicators: the protocol the executor uses, and its mpi4py implementation.

Tensors move as numpy buffers with mpi4py's capitalised (buffer) calls; pickled
calls carry only small set-up metadata. Every wait polls with short sleeps, so
a rank waiting for a message does not spin a core on an oversubscribed node,
and gives up after a timeout instead of hanging.
"""

from __future__ import annotations

import pickle
import time
from typing import TYPE_CHECKING, Any, Callable, Iterable, List, Optional, Protocol, Sequence, Tuple, Union

import numpy as np
import numpy.typing as npt
from .. import settings
from .shm import SHM_BYTES, Shared, attach

if TYPE_CHECKING:
    from .calls import Calls

__all__ = ["Communicator", "MPICommunicator", "CommTimeout", "wait_all", "wrap", "timeout_seconds",
           "sum_in_order", "poll"]


# A message buffer: a contiguous numpy array of any dtype.
Buffer = npt.NDArray[Any]


class Request(Protocol):
    """A non-blocking operation in flight: `test()` advances it, true once done."""

    def test(self) -> bool: ...


class CommTimeout(RuntimeError):
    """A wait for a message or collective took longer than the watchdog allows."""


def timeout_seconds() -> Optional[float]:
    """The watchdog: HYPARFLOW_TIMEOUT seconds (default 600; 0 disables)."""
    return settings.timeout()


def _spin_seconds() -> float:
    """How long a wait polls without sleeping before it backs off.

    MPI moves large messages and non-blocking collectives forward only inside
    Test calls, so sleeping between polls slows them; but on an oversubscribed
    node a spinning rank steals the core another rank needs. Default: 0.2 s of
    spinning when every rank has its own cores, none otherwise;
    HYPARFLOW_SPIN_SECONDS overrides. Why 0.2 s and not less: a rank that slept
    through a long wait computes its next action slower (2-stage pipelines with one
    microbatch, whose stages wait 40-100 ms for each other, ran 5-7 % slower with
    20 ms of spinning; docs/performance.md), and with a core of its own the spinning
    takes nothing from anyone."""
    value = settings.spin_seconds()
    if value is not None:
        return value
    from .. import _env

    return 0.0 if _env.oversubscribed() else 0.2


_SPIN: Optional[float] = None


def poll(test: Callable[[], object], timeout: Optional[float], what: str,
         spin: Optional[float] = None) -> None:
    """Wait until `test()` is true: spin for a while (`spin` seconds, default from
    `_spin_seconds`), then sleep a little longer each round (at most 1 ms) so a
    waiting rank leaves its core to others."""
    global _SPIN
    if test():
        return
    if spin is None:
        if _SPIN is None:
            _SPIN = _spin_seconds()
        spin = _SPIN
    start = time.monotonic()
    spin_until = start + spin
    while time.monotonic() < spin_until:
        if test():
            return
    pause = 2e-5
    while not test():
        if timeout is not None and time.monotonic() - start > timeout:
            raise CommTimeout(f"waited more than {timeout:g} s for {what}")
        time.sleep(pause)
        pause = min(pause * 2, 1e-3)


# Requests given up on by a wait that timed out, with their buffers: MPI may still
# write into a receive's buffer (a late message) or read a send's, so neither may be
# freed before the process ends (which the timeout's error brings about).
_ABANDONED: List[Request] = []


def wait_all(requests: Iterable[Optional[Request]], timeout: Optional[float] = None,
             what: str = "messages", spin: Optional[float] = None) -> None:
    pending = [r for r in requests if r is not None]

    def test() -> bool:
        # Every request, not up to the first unfinished one: a ring allreduce posts
        # its next round only inside its own test, so stopping early would run the
        # buckets one after another.
        pending[:] = [r for r in pending if not r.test()]
        return not pending

    try:
        poll(test, timeout, what, spin)
    except BaseException:
        _ABANDONED.extend(pending)
        raise


def sum_in_order(values: Sequence[Buffer]) -> Buffer:
    """Arrays added in rank order: every rank that adds the same list gets the same bits."""
    total = values[0].copy()
    for v in values[1:]:
        total += v
    return total


class Communicator:
    """What the executor needs from a communicator. `rank`/`size` are attributes."""

    rank: int
    size: int
    spin: float | None = None  # seconds a wait may spin; None: the default for MPI processes

    def host(self) -> str:
        """The name of this rank's host (where "table-row" tables and pipelines are
        placed); the in-process communicator can be given others (`run_ranks(hosts=)`)."""
        import socket

        return socket.gethostname()

    def isend(self, buf: Buffer, dest: int, tag: int) -> Request: raise NotImplementedError
    def irecv(self, buf: Buffer, source: int, tag: int) -> Request: raise NotImplementedError
    def allreduce(self, buf: Buffer, timeout: Optional[float] = None) -> Buffer:
        raise NotImplementedError

    def iallreduce(self, buf: Buffer) -> Request:
        """Start an in-place sum; returns a request (`test()`), done when `buf` holds it."""
        self.allreduce(buf)
        return _Done()
    def window(self, buf: Buffer) -> Optional[Shared]:
        """The shared-memory window sums of `buf` go through (`engine.shm`; MPI
        processes of one node only), or None: messages."""
        return None

    def iallgatherv(self, send: Buffer, recv: Buffer, counts: Sequence[int]) -> Request:
        """Start gathering every rank's 1-D `send` (`counts[p]` values from rank p) into
        `recv`, in rank order; returns a request (`test()`)."""
        raise NotImplementedError
    def bcast(self, buf: Buffer, root: int) -> Buffer: raise NotImplementedError
    # Objects travel pickled: any picklable value, so Any.
    def bcast_obj(self, obj: Any, root: int) -> Any: raise NotImplementedError
    def allgather_obj(self, obj: Any) -> List[Any]: raise NotImplementedError

    def gather_obj(self, obj: Any, root: int) -> Optional[List[Any]]:
        """`obj` of every rank as a list on `root`, None elsewhere."""
        everyone = self.allgather_obj(obj)
        return everyone if self.rank == root else None
    def split(self, color: Optional[int], key: int) -> Optional[Communicator]:
        raise NotImplementedError

    def pending_tag(self, source: int) -> Optional[int]:
        """The tag of a message from `source` that arrived and waits for a receive, if
        any (None where this cannot be seen)."""
        return None
    def abort(self, code: int = 1) -> None: raise NotImplementedError
    def free(self) -> None: pass

    def barrier(self) -> None:
        self.allgather_obj(None)


class _Done:
    def test(self) -> bool:
        return True


def _bytes(buf: Buffer) -> Buffer:
    """A flat byte view of a contiguous array (any dtype, bfloat16 included)."""
    return buf.reshape(-1).view(np.uint8)


class _MPIRequest:
    __slots__ = ("req", "buf")

    # `req`: an mpi4py request (untyped); `buf`: what it reads or writes, kept alive.
    def __init__(self, req: Any, buf: Union[Buffer, Tuple[Buffer, ...]]) -> None:
        self.req, self.buf = req, buf  # keep the buffer alive until completion

    def test(self) -> bool:
        return bool(self.req.Test())


RING_BYTES = 1 << 20  # allreduces of at least this many bytes use the ring below


class _RingAllreduce:
    """An in-place sum over a communicator by a ring of point-to-point messages:
    reduce-scatter then allgather, R - 1 steps each, advanced by `test()`.

    For large buffers on one node this is several times faster than MPICH's
    shared-memory allreduce here (point-to-point messages of megabytes go
    single-copy; the collective copies them through shared cells). Each chunk is
    summed on one rank and copied to the others, so every rank gets the same bits."""

    def __init__(self, comm: Any, buf: Buffer, tag: int) -> None:
        self.comm, self.tag = comm, tag   # an mpi4py communicator (untyped)
        self.size: int = comm.Get_size()
        self.rank: int = comm.Get_rank()
        self.chunks = np.array_split(buf.reshape(-1), self.size)
        self.tmp = np.empty(max(len(c) for c in self.chunks), buf.dtype)
        self.left, self.right = (self.rank - 1) % self.size, (self.rank + 1) % self.size
        self.step, self.done = 0, False
        self._post()

    def _indices(self) -> Tuple[int, int, bool]:
        r, n, s = self.rank, self.size, self.step
        if s < n - 1:
            return (r - s) % n, (r - s - 1) % n, True      # reduce-scatter
        t = s - (n - 1)
        return (r + 1 - t) % n, (r - t) % n, False         # allgather

    def _post(self) -> None:
        send, recv, reducing = self._indices()
        self.recv, self.reducing = recv, reducing
        target = self.tmp[:len(self.chunks[recv])] if reducing else self.chunks[recv]
        self.reqs = [self.comm.Isend(self.chunks[send], self.right, self.tag),
                     self.comm.Irecv(target, self.left, self.tag)]

    def test(self) -> bool:
        while not self.done:
            if not all(r.Test() for r in self.reqs):
                return False
            if self.reducing:
                chunk = self.chunks[self.recv]
                chunk += self.tmp[:len(chunk)]
            self.step += 1
            if self.step == 2 * (self.size - 1):
                self.done = True
            else:
                self._post()
        return True


class MPICommunicator(Communicator):
    """An mpi4py communicator (duplicated, so hyparflow's tags never meet the user's)."""

    # Large float sums of ranks on one node go through a shared window (`engine.shm`),
    # set up at the first such sum; `sums` then says how they go.
    shareable = True
    node_of: Optional[Callable[[int], int]] = None   # rank -> node (tests play nodes)

    def __init__(self, comm: Any, dup: bool = True, call: Optional[str] = None) -> None:
        """`call`: the public collective call this communicator is made for (e.g.
        "hf.fit"), which every rank of `comm` must be entering (hyparflow.calls)."""
        from mpi4py import MPI

        self._MPI: Any = MPI
        self._shared: Optional[Shared] = None
        self.sums: Optional[str] = None   # None: no large sum yet
        calls: Optional[Calls] = None   # the side channel of a collective call (with `call`)
        number, name = 0, call or ""
        if dup and comm.Get_size() > 1:
            # Non-blocking, so a rank alone in a call every rank must make (say
            # `if hf.is_main(): hf.evaluate(...)`) is told so instead of hanging: at
            # once when a peer has finished (hyparflow.calls), else by the watchdog.
            if call is not None:
                from .calls import calls_for

                calls = calls_for(comm)
                number = calls.enter(call)
            new, req = comm.Idup()
            timeout = timeout_seconds()
            test: Callable[[], object] = req.Test if calls is None else (
                lambda: req.Test() or calls.check(number, name, timeout))
            poll(test, timeout, f"the other ranks to enter {call or 'the same hyparflow call'}"
                  " (fit, evaluate and predict are collective: every rank must call them)")
            comm = new
        elif dup:
            comm = comm.Dup()
        self.comm: Any = comm
        self._owned = dup
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        self.tag_ub: int = self.comm.Get_attr(MPI.TAG_UB) or 32767
        if calls is not None:
            try:
                calls.open(self.comm)
                poll(calls.ready, timeout, "the other ranks to make hyparflow's side channel")
                calls.agree(self, number, name)
            except BaseException:
                self.free()
                raise

    def isend(self, buf: Buffer, dest: int, tag: int) -> Request:
        buf = np.ascontiguousarray(buf)
        return _MPIRequest(self.comm.Isend([_bytes(buf), self._MPI.BYTE], dest, tag % self.tag_ub), buf)

    def irecv(self, buf: Buffer, source: int, tag: int) -> Request:
        return _MPIRequest(self.comm.Irecv([_bytes(buf), self._MPI.BYTE], source, tag % self.tag_ub), buf)

    def allreduce(self, buf: Buffer, timeout: Optional[float] = None) -> Buffer:
        # One implementation: the blocking sum is the non-blocking one, waited for
        # under the watchdog (large sums take the ring too).
        req = self.iallreduce(buf)
        poll(req.test, timeout or timeout_seconds(), f"an allreduce of {buf.size} values",
              self.spin)
        return buf

    def iallreduce(self, buf: Buffer) -> Request:
        if self.size == 1:
            return _Done()
        shared = self.window(buf)
        if shared is not None:
            return shared.iallreduce(buf)
        if buf.nbytes >= RING_BYTES and buf.size >= self.size:
            self._rings = (getattr(self, "_rings", 0) + 1) % 4096
            return _RingAllreduce(self.comm, buf, self.tag_ub - 1 - self._rings)
        return _MPIRequest(self.comm.Iallreduce(self._MPI.IN_PLACE, buf, op=self._MPI.SUM), buf)

    def window(self, buf: Buffer) -> Optional[Shared]:
        """The shared window a sum of `buf` goes through, or None (messages): float32
        or float64, contiguous, of at least `SHM_BYTES`. Made at the first such call,
        which is collective (every rank makes it at the same point)."""
        if not (self.shareable and buf.nbytes >= SHM_BYTES and buf.flags.c_contiguous
                and buf.dtype in (np.float32, np.float64)):
            return None
        if self.sums is None:
            self._shared, self.sums = attach(
                self.comm, lambda test, what: poll(test, timeout_seconds(), what, self.spin),
                self._cross, self.node_of)
        return self._shared

    @staticmethod
    def _cross(comm: Any) -> "MPICommunicator":
        """The same-position ranks of the nodes: sums as messages (a ring)."""
        cross = MPICommunicator(comm, dup=False)
        cross.shareable = False
        return cross

    def iallgatherv(self, send: Buffer, recv: Buffer, counts: Sequence[int]) -> Request:
        if self.size == 1:
            recv[...] = send
            return _Done()
        return _MPIRequest(self.comm.Iallgatherv(send, [recv, list(counts)]), (send, recv))

    def bcast(self, buf: Buffer, root: int, timeout: Optional[float] = None) -> Buffer:
        if self.size == 1:
            return buf
        req = self.comm.Ibcast([_bytes(buf), self._MPI.BYTE], root=root)
        poll(req.Test, timeout or timeout_seconds(),
              f"a broadcast of {buf.nbytes} bytes from rank {root}", self.spin)
        return buf

    # Small metadata travels pickled (between our own ranks only), through
    # non-blocking buffer collectives so the watchdog covers these waits too.
    def _wait(self, req: Any, what: str) -> None:
        poll(req.Test, timeout_seconds(), what, self.spin)

    def bcast_obj(self, obj: Any, root: int) -> Any:
        if self.size == 1:
            return obj
        data = np.frombuffer(pickle.dumps(obj), np.uint8) if self.rank == root else None
        size = np.array([0 if data is None else data.size], np.int64)
        self._wait(self.comm.Ibcast(size, root=root), f"set-up data from rank {root}")
        buf = data.copy() if data is not None else np.empty(int(size[0]), np.uint8)
        self._wait(self.comm.Ibcast(buf, root=root), f"set-up data from rank {root}")
        return obj if self.rank == root else pickle.loads(buf.tobytes())

    def allgather_obj(self, obj: Any) -> List[Any]:
        if self.size == 1:
            return [obj]
        data = np.frombuffer(pickle.dumps(obj), np.uint8)
        sizes = np.zeros(self.size, np.int64)
        self._wait(self.comm.Iallgather(np.array([data.size], np.int64), sizes),
                   "the other ranks' set-up data")
        out = np.empty(int(sizes.sum()), np.uint8)
        self._wait(self.comm.Iallgatherv(data, [out, sizes.tolist()]),
                   "the other ranks' set-up data")
        starts = np.concatenate([[0], np.cumsum(sizes)])
        return [pickle.loads(out[a:b].tobytes()) for a, b in zip(starts[:-1], starts[1:])]

    def gather_obj(self, obj: Any, root: int) -> Optional[List[Any]]:
        everyone = self.allgather_obj(obj)
        return everyone if self.rank == root else None

    def split(self, color: Optional[int], key: int) -> Optional[Communicator]:
        sub = self.comm.Split(self._MPI.UNDEFINED if color is None else color, key)
        if sub == self._MPI.COMM_NULL:
            return None
        return MPICommunicator(sub, dup=False)

    def pending_tag(self, source: int) -> Optional[int]:
        status = self._MPI.Status()
        if self.comm.Iprobe(source, self._MPI.ANY_TAG, status):
            return int(status.Get_tag())
        return None

    def abort(self, code: int = 1) -> None:
        self.comm.Abort(code)

    def free(self) -> None:
        if self._shared is not None:
            self._shared.free()
            self._shared = None
        if self._owned or self.comm != self._MPI.COMM_WORLD:
            try:
                self.comm.Free()
            except Exception:
                pass


def wrap(comm: Any, call: Optional[str] = None) -> Tuple[Communicator, bool]:
    """`None` -> COMM_WORLD; an mpi4py communicator -> MPICommunicator (for the
    collective `call`, e.g. "hf.fit"); ours as is."""
    if isinstance(comm, Communicator):
        return comm, False
    if comm is None:
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
    return MPICommunicator(comm, call=call), True
