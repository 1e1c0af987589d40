"""Lost peers: a heartbeat beside the data path, so a rank whose peer went silent exits.

A peer that dies with its host's kernel still up resets its TCP connections and MPI
fails at once; a peer behind a cut link or on a frozen host (SIGSTOP, a hung node)
just stops answering, and a rank waiting for its activations would wait until the
watchdog (`HYPARFLOW_TIMEOUT`, sized for the slowest legitimate wait) gives up.
Here every rank's daemon thread sends a one-byte message to a few neighbours every
`HYPARFLOW_HEARTBEAT_SECONDS` on its own communicator, and notes when it last heard
from each. The neighbours (`neighbours`) are the ring's, rank +-1, and the ranks half
way round, rank +-N/2: at most 4 per rank, so N ranks send O(N) beats, not N^2. The
ring alone sees any loss (a lost set of ranks has a surviving ring neighbour at each
end), and the half-way partners are on another host when the hosts hold consecutive
ranks, so a lost host is seen from several others. A neighbour silent for more than
`HYPARFLOW_PEER_TIMEOUT` seconds is lost, whatever the step time: the rank that notices
sends its verdict to every rank it does not count lost, waits `interval + 0.5` s for the
verdicts of the other finders (the lost ranks' other neighbours, whose last beats came up
to an interval apart), then prints the union, which ranks on which hosts, and ends the
process with `EXIT_CODE`, without MPI_Abort, which may itself wait on the dead link. A
rank that receives a verdict does the same: every surviving rank names the same lost
ranks.

The thread runs only while ranks are inside a collective hyparflow call (from
`Runtime.connect` to `Runtime.close`): a rank that finished says goodbye, so its
silence afterwards is not a loss.

Silence alone is no verdict: a busy rank can fall silent too, when a long C++ call holds
Python's GIL (graph building, tracing) or its node is oversubscribed or swapping, and a
heartbeat that ends healthy runs is worse than none. So a silent peer must also fail a
probe of its host (`probe`): a peer on this machine (the same kernel, process and network
namespaces) is looked up in /proc, where a stopped (SIGSTOP, a frozen job) or vanished
process is lost and a running or sleeping one is only busy; a peer on another machine is
looked up there by the ranks that share its machine, asked over this communicator. No
answer within `probe_seconds` (the peer's machine froze, died or was cut off), or none to
ask (the peer is alone on its machine), is a verdict.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Set, Tuple

import numpy as np
import numpy.typing as npt

from .. import settings

__all__ = ["Heartbeat", "interval_seconds", "peer_timeout_seconds", "EXIT_CODE", "start",
           "neighbours", "machine", "probe"]

EXIT_CODE = 75  # EX_TEMPFAIL: a peer was lost; a restart on the hosts left may succeed

_BEAT, _VERDICT, _BYE, _PROBE, _ANSWER = 1, 2, 3, 4, 5   # kinds (tags) of the heartbeat's messages
# Stopping is correct under the MPI standard alone, on any implementation: no message may
# be left unread when a communicator is freed, and none may be sent to a rank that has
# freed it (MPICH then handed the context to the next communicator, whose receives the
# stale message matched; Open MPI hung in the next `Idup` and corrupted its heap at
# MPI_Finalize). So every rank counts the messages it sends to each rank; `stop` says
# goodbye, sends no more, and the ranks exchange their counts (an `Ialltoall` on the
# heartbeat's communicator); each then reads until it has every message sent to it, waits
# for its own sends, cancels its standing receives and only then frees the communicator
# (`_goodbye`, `_drained`). Every wait there is bounded by HYPARFLOW_TIMEOUT.
_ALIVE, _LOST = 1, 0                     # a probe's answer


def interval_seconds() -> float:
    """Seconds between beats: HYPARFLOW_HEARTBEAT_SECONDS (default 2)."""
    return settings.heartbeat_seconds()


def peer_timeout_seconds() -> Optional[float]:
    """Silence after which a peer is lost: HYPARFLOW_PEER_TIMEOUT (default 20; 0 turns the
    heartbeat off)."""
    return settings.peer_timeout()


def neighbours(rank: int, size: int) -> List[int]:
    """The ranks `rank` beats to and watches (the same set: the relation is symmetric):
    rank +-1 around the ring, and rank +-size//2 (half way round) from 4 ranks on."""
    out = {(rank + 1) % size, (rank - 1) % size}
    if size >= 4:
        out |= {(rank + size // 2) % size, (rank - size // 2) % size}
    out.discard(rank)
    return sorted(out)


def machine() -> List[int]:
    """What identifies this rank's machine for /proc: the kernel (its boot id) and the
    process and network namespaces (emulated hosts share a kernel but not a network,
    so a link cut between them must be seen as a host's loss). Then this process's id
    and start time (a pid reused by another process is not this rank)."""
    import zlib

    def inode(path: str) -> int:
        try:
            return os.stat(path).st_ino
        except OSError:
            return 0

    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = zlib.crc32(f.read().strip().encode())
    except OSError:
        boot = 0
    return [boot, inode("/proc/self/ns/pid"), inode("/proc/self/ns/net"), os.getpid(),
            _started(os.getpid()) or 0]


def _stat(pid: int) -> Optional[List[str]]:
    """The fields of /proc/PID/stat after the command name, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    return text.rsplit(")", 1)[1].split()


def _started(pid: int) -> Optional[int]:
    fields = _stat(pid)
    return int(fields[19]) if fields and len(fields) > 19 else None


def probe(pid: int, started: int) -> int:
    """_ALIVE when process `pid` (started at `started`, in clock ticks after boot) runs
    or sleeps here, _LOST when it is stopped, a zombie or gone."""
    fields = _stat(pid)
    if fields is None or (started and int(fields[19]) != started):
        return _LOST
    return _LOST if fields[0] in "TtZXx" else _ALIVE


def _probe_machine(row: npt.NDArray[np.int64]) -> int:
    """`probe` of the process in a `machine()` row (its pid and start time)."""
    return probe(int(row[3]), int(row[4]))


def _lost_message(rank: int, lost: Iterable[int], hosts: Sequence[str], found_by: Optional[int],
                  silence: float, why: Optional[Mapping[int, str]] = None) -> str:
    why = why or {}
    names = ", ".join(f"rank {r} on host {hosts[r]}" for r in sorted(lost))
    places = sorted({hosts[r] for r in lost})
    seen = sorted({why[r] for r in lost if r in why})
    how = (f"silent for more than {silence:g} s" if found_by is None else
           f"silent for more than {silence:g} s, found by rank {found_by}")
    if seen:
        how += f"; {', '.join(seen)}"
    return (f"hyparflow: rank {rank} on host {hosts[rank]}: lost {names} ({how}: the "
            f"host{'s' if len(places) > 1 else ''} {', '.join(places)} died, froze or lost "
            f"its network; HYPARFLOW_PEER_TIMEOUT). Ending this rank with exit code "
            f"{EXIT_CODE}.\n")


class Heartbeat:
    """The beating thread of one rank. `comm`: an mpi4py communicator of which this
    rank duplicates its own (collective); `hosts`: every rank's host name; `describe()`:
    what this rank was doing, for the message. mpi4py is untyped: its communicators and
    requests are Any here."""

    def __init__(self, comm: Any, hosts: Sequence[str], interval: Optional[float] = None,
                 limit: Optional[float] = None,
                 describe: Optional[Callable[[], str]] = None) -> None:
        from mpi4py import MPI

        from ..engine.comm import poll, timeout_seconds

        self._MPI: Any = MPI
        new, req = comm.Idup()
        poll(req.Test, timeout_seconds(), "the other ranks to start the heartbeat")
        self.comm: Any = new
        # An error about a dead peer (a reset connection) is ours to report, not fatal here.
        self.comm.Set_errhandler(MPI.ERRORS_RETURN)
        self.rank: int = new.Get_rank()
        self.size: int = new.Get_size()
        self.hosts = list(hosts)
        self.interval = interval or interval_seconds()
        # `start` makes none when the timeout is off (None).
        self.limit: float = limit or peer_timeout_seconds() or 0.0
        # How long the ranks on a silent peer's machine get to answer for it.
        self.probe_seconds = min(10.0, max(2 * self.interval, self.limit / 2))
        self.describe = describe        # what this rank was doing, for the message
        self.peers = neighbours(self.rank, self.size)   # beaten to and watched
        # Every rank's machine and process (`machine`), for probes.
        mine = np.array(machine(), np.int64)
        gathered = np.zeros((self.size, len(mine)), np.int64)
        req = new.Iallgather(mine, gathered)
        poll(req.Test, timeout_seconds(), "the other ranks to start the heartbeat")
        self.machines: npt.NDArray[np.int64] = gathered
        # Its own communicator: the tags need only tell the kinds apart.
        self.tags = {kind: kind for kind in (_BEAT, _VERDICT, _BYE, _PROBE, _ANSWER)}
        # Messages sent to and read from each rank, for `stop` (see the tags above).
        self._sent = np.zeros(self.size, np.int64)
        self._got = np.zeros(self.size, np.int64)
        self._out: List[Tuple[Any, Any]] = []   # sends in flight, with their buffers
        now = time.monotonic()
        self.heard = {r: now for r in self.peers}
        self.gone: Set[int] = set()     # peers that said goodbye
        self.asked: Dict[int, float] = {}   # silent peer -> when its machine's ranks must answer
        self.why: Dict[int, str] = {}   # lost peer -> what the probe saw
        self._one = np.ones(1, np.uint8)
        self._sends: Dict[int, Any] = {}    # peer -> its last beat's request
        self._beat_in = np.zeros(1, np.uint8)
        self._verdict_in = np.zeros(self.size, np.uint8)
        self._probe_in = np.zeros(1, np.int64)
        self._answer_in = np.zeros(2, np.int64)
        self._recv = self.comm.Irecv(self._beat_in, MPI.ANY_SOURCE, self.tags[_BEAT])
        self._recv_verdict = self.comm.Irecv(self._verdict_in, MPI.ANY_SOURCE, self.tags[_VERDICT])
        self._recv_bye = self.comm.Irecv(self._beat_in[:0], MPI.ANY_SOURCE, self.tags[_BYE])
        self._recv_probe = self.comm.Irecv(self._probe_in, MPI.ANY_SOURCE, self.tags[_PROBE])
        self._recv_answer = self.comm.Irecv(self._answer_in, MPI.ANY_SOURCE, self.tags[_ANSWER])
        self._stop = threading.Event()      # set by `stop`: say goodbye, drain, free
        self._stopping = False              # the goodbyes are sent: no new messages
        # While stopping: (the Ialltoall of the counts, the counts sent here, this rank's).
        self._counts: Optional[Tuple[Any, npt.NDArray[np.int64], npt.NDArray[np.int64]]] = None
        self._stop_limit: Optional[float] = None   # HYPARFLOW_TIMEOUT, once stopping
        self._stop_by: Optional[float] = None   # when `_drained` gives up
        self.stopped = threading.Event()    # the thread is done (freed, or gave up)
        self.freed = False                  # the communicator was freed (drained first)
        self.beats = 0
        self.lost: Set[int] = set()     # ranks found lost, here or by a verdict
        self.finders: Set[Optional[int]] = set()   # who found them (None: this rank)
        self._reason: Optional[str] = None
        self._deadline: Optional[float] = None   # when to report and end, once a loss is known
        self._thread = threading.Thread(target=self._run, name="hyparflow-heartbeat",
                                        daemon=True)
        self._thread.start()

    # -- the thread
    def _run(self) -> None:
        MPI = self._MPI
        next_beat = 0.0
        while True:
            try:
                now = time.monotonic()
                if self._stop.is_set() and not self._stopping:
                    self._goodbye(now)
                self._receive(now)
                if self._stopping and self._drained(now):
                    break
                if not self._stopping and now >= next_beat:
                    self._beat()
                    next_beat = now + self.interval
                silent = [r for r in self.peers if r not in self.gone and r not in self.lost
                          and r not in self.asked and now - self.heard[r] > self.limit]
                lost = [r for r in silent if self._probe(r, now)]
                lost += [r for r, due in self.asked.items() if now > due]
                if lost:
                    self._found(lost, None)
            except MPI.Exception as error:
                # MPI says a peer is unreachable (its connection was reset): the peer whose
                # beat or verdict failed is not known here, so name every silent-looking one.
                now = time.monotonic()
                quiet = [r for r in self.peers if r not in self.gone
                         and now - self.heard[r] > 2 * self.interval]
                self._reason = f"MPI error: {error.Get_error_string()}"
                if quiet:
                    self._found(quiet, None)
                else:
                    self._deadline = self._deadline or now
            if self._deadline is not None and time.monotonic() >= self._deadline:
                self._end()
            # Stopping, the ranks wait for each other: look often, the call's end waits.
            time.sleep(0.002) if self._stopping else self._stop.wait(min(0.25, self.interval / 4))
        self.stopped.set()

    def _same_machine(self, r: int) -> bool:
        return bool((self.machines[r][:3] == self.machines[self.rank][:3]).all())

    def _probe(self, r: int, now: float) -> bool:
        """Whether silent peer `r` is lost now: a peer on this machine by /proc; for one
        elsewhere, the ranks on its machine are asked (the verdict comes with their
        answer, or when none came in time), or it is lost at once when it is alone."""
        if self._same_machine(r):
            if _probe_machine(self.machines[r]) == _ALIVE:
                self.heard[r] = now - self.limit + self.interval   # busy: look again soon
                return False
            self.why[r] = "its process is stopped or gone"
            return True
        mates = [m for m in range(self.size) if m != r and m != self.rank
                 and (self.machines[m][:3] == self.machines[r][:3]).all()]
        if not mates:
            return True
        if self._stopping:
            # No new message once the goodbyes are out (the counts are given): a silent
            # peer elsewhere is left to its machine's ranks and to HYPARFLOW_TIMEOUT.
            self.heard[r] = now - self.limit + self.interval
            return False
        self.asked[r] = now + self.probe_seconds
        self.why[r] = f"no rank on its host answered for it within {self.probe_seconds:g} s"
        for m in mates:
            self._send(np.array([r], np.int64), m, self.tags[_PROBE])
        return False

    def _isend(self, data: npt.NDArray[Any], to: int, tag: int) -> Any:
        """Every message goes here: counted (for `stop`), its buffer kept until sent."""
        self._out = [(q, b) for q, b in self._out if not q.Test()]
        req = self.comm.Isend(data, to, tag)
        self._out.append((req, data))
        self._sent[to] += 1
        return req

    def _send(self, data: npt.NDArray[np.int64], to: int, tag: int) -> None:
        """A small message that must not be waited for."""
        try:
            self._isend(data, to, tag)
        except self._MPI.Exception:
            pass

    def _found(self, lost: Sequence[int], finder: Optional[int]) -> None:
        """Ranks found lost (by this rank: `finder` None): tell the others, and report
        once the other finders' verdicts have had time to come."""
        for r in lost:
            self.asked.pop(r, None)
        new = set(lost) - self.lost
        self.lost |= set(lost)
        self.finders.add(finder)
        if self._deadline is None:
            self._deadline = time.monotonic() + self.interval + 0.5
        if finder is None and new:
            self._tell(sorted(self.lost))

    def _tell(self, lost: Sequence[int]) -> None:
        """The verdict to every rank not counted lost (not only the neighbours: each must
        name the lost ranks); a moment for it to leave, never a wait on a dead link."""
        mask = np.zeros(self.size, np.uint8)
        mask[lost] = 1
        for r in range(self.size):
            if r != self.rank and r not in self.lost and r not in self.gone:
                try:
                    self._isend(mask, r, self.tags[_VERDICT])
                except self._MPI.Exception:
                    pass

    def _receive(self, now: float) -> None:
        MPI = self._MPI
        status = MPI.Status()

        def got() -> int:
            source: int = status.Get_source()
            self._got[source] += 1
            return source

        while self._recv.Test(status):
            source = got()
            self.heard[source] = now
            self.asked.pop(source, None)
            self._recv = self.comm.Irecv(self._beat_in, MPI.ANY_SOURCE, self.tags[_BEAT])
        while self._recv_probe.Test(status):
            # Another rank asks about a silent rank on this machine: look it up here
            # (not once stopping: the counts of this rank's messages are given).
            source = got()
            r = int(self._probe_in[0])
            self._recv_probe = self.comm.Irecv(self._probe_in, MPI.ANY_SOURCE, self.tags[_PROBE])
            if not self._stopping:
                self._send(np.array([r, _probe_machine(self.machines[r])], np.int64),
                           source, self.tags[_ANSWER])
        while self._recv_answer.Test(status):
            source = got()
            r, state = (int(v) for v in self._answer_in)
            self._recv_answer = self.comm.Irecv(self._answer_in, MPI.ANY_SOURCE, self.tags[_ANSWER])
            if r in self.asked and state == _ALIVE:
                del self.asked[r]
                self.why.pop(r, None)
                self.heard[r] = now - self.limit + self.interval   # busy: ask again soon
            elif r in self.asked:
                self.why[r] = f"its process is stopped or gone, seen by rank {source}"
                self._found([r], None)
        while self._recv_bye.Test(status):
            self.gone.add(got())
            self._recv_bye = self.comm.Irecv(self._beat_in[:0], MPI.ANY_SOURCE, self.tags[_BYE])
        while self._recv_verdict.Test(status):
            source = got()
            lost = [r for r in range(self.size) if self._verdict_in[r]]
            self._recv_verdict = self.comm.Irecv(self._verdict_in, MPI.ANY_SOURCE, self.tags[_VERDICT])
            self._found(lost, source)

    def _beat(self) -> None:
        for r in self.peers:
            if r in self.gone:
                continue
            req = self._sends.get(r)
            # One beat in flight per peer: a peer that stopped reading gets no pile-up.
            if req is None or req.Test():
                self._sends[r] = self._isend(self._one, r, self.tags[_BEAT])
        self.beats += 1

    def _goodbye(self, now: float) -> None:
        """`stop` was called: goodbyes to the peers (this rank's silence from now on is no
        loss), then no new message; every rank learns how many each sent it."""
        for r in self.peers:
            if r not in self.gone:
                self._isend(self._one[:0], r, self.tags[_BYE])
        self._stopping = True
        expected = np.zeros(self.size, np.int64)
        sent = self._sent.copy()
        self._counts = (self.comm.Ialltoall(sent, expected), expected, sent)
        from ..engine.comm import timeout_seconds

        self._stop_limit = timeout_seconds()
        self._stop_by = None if self._stop_limit is None else now + self._stop_limit

    def _drained(self, now: float) -> bool:
        """While stopping: True once every message sent to this rank is read and its own
        are sent, then its standing receives are cancelled and the communicator freed;
        or once HYPARFLOW_TIMEOUT has passed (the communicator is then left as it is:
        freeing it could lose a message still coming)."""
        assert self._counts is not None
        req, expected, _ = self._counts
        if req.Test() and (self._got >= expected).all():
            self._out = [(q, b) for q, b in self._out if not q.Test()]
            if not self._out:
                for recv in (self._recv, self._recv_verdict, self._recv_bye, self._recv_probe,
                             self._recv_answer):
                    recv.Cancel()
                    recv.Wait()
                self.comm.Free()
                self.freed = True
                return True
        if self._stop_by is not None and now > self._stop_by:
            sys.stderr.write(
                f"hyparflow: rank {self.rank}: the heartbeat's ranks did not all stop within "
                f"HYPARFLOW_TIMEOUT ({self._stop_limit:g} s); its communicator is left "
                f"unfreed.\n")
            _ABANDONED.append(self)   # its buffers stay alive: MPI may still write them
            return True
        return False

    def _end(self) -> None:
        """Report the lost peers (the union of the verdicts), end the process."""
        lost = sorted(self.lost)
        others = sorted(f for f in self.finders if f is not None)
        found_by = None if None in self.finders or not others else others[0]
        reason = self._reason
        text = (_lost_message(self.rank, lost, self.hosts, found_by, self.limit, self.why)
                if lost else
                f"hyparflow: rank {self.rank} on host {self.hosts[self.rank]}: a peer was "
                f"lost ({reason}). Ending this rank with exit code {EXIT_CODE}.\n")
        if reason and lost:
            text = text.rstrip("\n") + f" [{reason}]\n"
        if self.describe is not None:
            try:
                text += f"hyparflow: rank {self.rank} was at {self.describe()}.\n"
            except Exception:  # noqa: BLE001 - the report must not fail
                pass
        sys.stderr.write(text)
        sys.stderr.flush()
        # A moment for the verdicts to leave (never a wait on a dead link), and for the
        # other ranks, whose reports fall due within milliseconds of this one, to print
        # theirs: the launcher ends every rank once one has exited non-zero.
        reqs = [q for q, _ in self._out]
        linger = time.monotonic() + max(0.5, min(1.0, self.interval))
        while time.monotonic() < linger:
            try:
                reqs = [q for q in reqs if not q.Test()]
            except self._MPI.Exception:
                reqs = []
            time.sleep(0.01)
        os._exit(EXIT_CODE)

    # -- the main thread
    def stop(self) -> None:
        """Say goodbye (this rank's silence from now on is no loss), and once every rank
        has, free the heartbeat's communicator with no message left in flight (see the
        tags). Collective over the heartbeat's ranks; waits at most HYPARFLOW_TIMEOUT."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join()


_ABANDONED: List[Heartbeat] = []   # heartbeats whose ranks did not all stop: never freed


def start(comm: object, hosts: Sequence[str],
          describe: Optional[Callable[[], str]] = None) -> Optional[Heartbeat]:
    """A Heartbeat for an MPICommunicator of more than one rank (None otherwise, or when
    HYPARFLOW_PEER_TIMEOUT=0)."""
    from ..engine.comm import MPICommunicator

    if not isinstance(comm, MPICommunicator) or comm.size < 2 or peer_timeout_seconds() is None:
        return None
    return Heartbeat(comm.comm, hosts, describe=describe)
