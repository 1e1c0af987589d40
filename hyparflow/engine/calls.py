"""Which collective hyparflow call each rank is in, so that a call made on some ranks
only (`if hf.is_main(): hf.evaluate(...)`) is named at once instead of waiting for the
watchdog.

`fit`, `evaluate` and `predict` are collective: each starts by duplicating the caller's
communicator, which completes only when every rank has entered a call. Each rank counts
its calls per parent communicator (`Calls.enter`), and once every rank has entered, they
compare (name, number) (`Calls.agree`): a rank in `evaluate` while another is in
`predict` is a mistake both are told of. A rank that is never coming cannot be seen by
MPI: so the first call also makes a side channel (a duplicate of that call's own
communicator, once every rank is in it: two duplications in flight at once on one
parent are where MPI implementations have given ranks different context ids, so that
one communicator's messages met another's), and a process that ends says so on it to
every other rank (`atexit`, before mpi4py finalizes MPI), with
how many calls it made. A rank waiting to enter call n that hears a peer finished after
fewer than n calls raises `CollectiveMismatch` naming both; the peer cannot come. A rank
that waits long for peers that have not finished (rank 0 only, so a rank that loads data
alone does not make every other rank print) says what it waits for, once.
"""

from __future__ import annotations

import atexit
import pickle
import sys
import time
from typing import Any, Dict, List, Optional, Protocol, Tuple

import numpy as np

__all__ = ["CollectiveMismatch", "Calls", "calls_for", "NOTICE_SECONDS"]

_FINISHED = 1               # tag on the side channel: this process is ending
NOTICE_SECONDS = 30.0        # a wait this long to enter a call is said (rank 0 only)
_CHECK_EVERY = 0.05          # seconds between looks at the side channel while waiting


class _Gathers(Protocol):
    """What `Calls.agree` needs of a call's communicator (engine.comm.Communicator,
    which imports this module)."""

    rank: int

    def allgather_obj(self, obj: Any) -> List[Any]: ...


class CollectiveMismatch(RuntimeError):
    """The ranks are not in the same collective hyparflow call (one finished, or is in
    another call)."""


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def _fix(call: str) -> str:
    return (f"{call} is collective, as hf.fit: call it on every rank (not inside `if "
            f"hf.is_main():`), or pass comm=MPI.COMM_SELF to run it on one rank alone.")


class Calls:
    """This rank's calls over one parent communicator (an mpi4py communicator; mpi4py
    is untyped, so its communicators and requests are Any here)."""

    def __init__(self, parent: Any) -> None:
        from mpi4py import MPI

        self.MPI: Any = MPI
        self.rank: int = parent.Get_rank()
        self.size: int = parent.Get_size()
        self.count = 0
        self.last: Optional[str] = None
        self.finished: Dict[int, Tuple[int, Optional[str]]] = {}  # peer -> (its calls, its last call)
        self.channel: Any = None                 # the side channel (see `open`)
        self._pending: Optional[Tuple[Any, Any]] = None   # (communicator, request) being made
        self._said = False
        atexit.register(self._finish)

    # -- the waiting rank
    def enter(self, call: str) -> int:
        """Count a call (`call`: its name, e.g. "hf.evaluate"); returns its number."""
        self.count += 1
        self.last = call
        self._said = False
        self._started = time.monotonic()
        self._looked = 0.0
        return self.count

    def _channel(self) -> Any:
        if self.channel is None and self._pending is not None:
            new, req = self._pending
            if req.Test():
                new.Set_errhandler(self.MPI.ERRORS_RETURN)
                self.channel, self._pending = new, None
        return self.channel

    def _read(self) -> None:
        channel = self._channel()
        if channel is None:
            return
        status = self.MPI.Status()
        while channel.Iprobe(self.MPI.ANY_SOURCE, _FINISHED, status):
            buf = np.empty(status.Get_count(self.MPI.BYTE), np.uint8)
            channel.Recv(buf, status.Get_source(), _FINISHED)
            self.finished[status.Get_source()] = pickle.loads(buf.tobytes())

    def check(self, number: int, call: str, timeout: Optional[float]) -> bool:
        """While waiting to enter call `number`: raise when a peer finished before it, say
        once what this rank waits for when it waits long. Returns False (not done)."""
        now = time.monotonic()
        if now - self._looked < _CHECK_EVERY:
            return False
        self._looked = now
        self._read()
        gone = sorted(r for r, (count, _) in self.finished.items() if count < number)
        if gone:
            peers = "; ".join(
                f"rank {r} has finished (its script ended after {_ordinal(count)} "
                f"hyparflow call, {last})" if count else
                f"rank {r} has finished without a hyparflow call"
                for r, (count, last) in ((r, self.finished[r]) for r in gone))
            raise CollectiveMismatch(
                f"Rank {self.rank} waits in {call} (its {_ordinal(number)} hyparflow call) "
                f"for every rank, but {peers}. {_fix(call)}")
        if self.rank == 0 and not self._said and now - self._started > NOTICE_SECONDS:
            self._said = True
            limit = f"up to {timeout:g} s (HYPARFLOW_TIMEOUT)" if timeout else "(no timeout)"
            sys.stderr.write(
                f"hyparflow: rank 0 has waited {now - self._started:.0f} s for the other "
                f"ranks to enter {call} (its {_ordinal(number)} hyparflow call); it waits "
                f"{limit}. {_fix(call)}\n")
            sys.stderr.flush()
        return False

    def open(self, comm: Any) -> None:
        """Start the side channel from the first call's own communicator (an mpi4py
        communicator every rank has entered), if not made yet; then poll `ready`."""
        if self.channel is None and self._pending is None:
            self._pending = comm.Idup()

    def ready(self) -> bool:
        """Whether the side channel is made (every rank starts it in its first call,
        once all are there: wait for it then, so that a rank that ends can say so)."""
        return self._channel() is not None

    def agree(self, comm: _Gathers, number: int, call: str) -> None:
        """Once every rank has entered (on the call's own communicator, a
        `hyparflow.comm.Communicator`): the same call everywhere, or every rank raises."""
        everyone = comm.allgather_obj((call, number))
        if all(e == everyone[0] for e in everyone):
            return
        from .errors import REPORTED_ELSEWHERE

        where = ", ".join(f"rank {r} in {c} (its {_ordinal(n)} call)"
                          for r, (c, n) in enumerate(everyone))
        error = CollectiveMismatch(
            f"The ranks are in different hyparflow calls: {where}. hf.fit, hf.evaluate and "
            f"hf.predict are collective: every rank makes the same calls in the same order "
            f"(none inside `if hf.is_main():`); pass comm=MPI.COMM_SELF for a call on one "
            f"rank alone.")
        if comm.rank != 0:
            setattr(error, REPORTED_ELSEWHERE, True)   # every rank has it: rank 0 prints
            from . import errors

            errors.install_hook()
        raise error

    # -- the ending process
    def _finish(self) -> None:
        """Tell every other rank this process is ending, and after how many calls; then
        read every other rank's word and free the channel. The MPI standard wants every
        message received and every send complete before MPI_Finalize (Open MPI's
        corrupted its heap over one left in flight), so this waits for the other ranks
        to end too (their MPI_Finalize would wait for them anyway), at most
        HYPARFLOW_TIMEOUT, after which the channel and its buffers are left as they are."""
        try:
            channel = self._channel()
            if channel is None:
                return
            data = np.frombuffer(pickle.dumps((self.count, self.last)), np.uint8)
            reqs = [channel.Isend(data, r, _FINISHED) for r in range(self.size) if r != self.rank]

            def done() -> bool:
                self._read()
                reqs[:] = [q for q in reqs if not q.Test()]
                return not reqs and len(self.finished) == self.size - 1

            from .. import settings

            limit = settings.timeout()
            until = None if limit is None else time.monotonic() + limit
            while not done():
                if until is not None and time.monotonic() > until:
                    _LEFT.append((channel, reqs, data))   # MPI may still read `data`
                    return
                time.sleep(0.001)
            channel.Free()
            self.channel = None
        except Exception:  # noqa: BLE001 - an ending process reports what it can
            pass


_LEFT: List[Any] = []   # side channels whose ranks did not all end in time: never freed
_CALLS: Dict[int, Calls] = {}   # the parent communicator's Fortran handle -> its Calls


def calls_for(parent: Any) -> Calls:
    """The `Calls` of an mpi4py communicator (made at its first hyparflow call)."""
    key = parent.py2f()
    if key not in _CALLS:
        _CALLS[key] = Calls(parent)
    return _CALLS[key]
