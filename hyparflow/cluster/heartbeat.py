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

_BEAT, _VERDICT, _BYE, _PROBE, _ANSWER = 1, 2, 3, 4, 5   # kinds of the heartbeat's messages
# Ranks stop at different moments, so a goodbye or a beat can reach a rank that has
# already freed the heartbeat's communicator; MPI then gives that communicator's
# context to the next one made (the next call's, whose stage boundaries receive on
# small tags) and the message left unread would match there. So each heartbeat's tags
# lie high up, apart from every other message's, and differ from one heartbeat to the
# next (`_GENERATIONS` of them): what an earlier one left matches nothing later.
_GENERATIONS = 1024
_next_generation = 0                      # the generation of this process's next heartbeat
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
        top: int = self.comm.Get_attr(MPI.TAG_UB) or 32767
        self.hosts = list(hosts)
        self.interval = interval or interval_seconds()
        # `start` makes none when the timeout is off (None).
        self.limit: float = limit or peer_timeout_seconds() or 0.0
        # How long the ranks on a silent peer's machine get to answer for it.
        self.probe_seconds = min(10.0, max(2 * self.interval, self.limit / 2))
        self.describe = describe        # what this rank was doing, for the message
        self.peers = neighbours(self.rank, self.size)   # beaten to and watched
        # Every rank's machine and process (`machine`), for probes.
        global _next_generation
        mine = np.array(machine() + [_next_generation], np.int64)
        gathered = np.zeros((self.size, len(mine)), np.int64)
        req = new.Iallgather(mine, gathered)
        poll(req.Test, timeout_seconds(), "the other ranks to start the heartbeat")
        self.machines: npt.NDArray[np.int64] = gathered[:, :-1]
        # One generation for all: the ranks may have started different numbers before.
        generation = int(gathered[:, -1].max())
        _next_generation = generation + 1
        base = top // 2 + 8 * (generation % _GENERATIONS)
        self.tags = {kind: base + kind for kind in (_BEAT, _VERDICT, _BYE, _PROBE, _ANSWER)}
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
        self._stop = threading.Event()
        self.beats = 0
        self.lost: Set[int] = set()     # ranks found lost, here or by a verdict
        self.finders: Set[Optional[int]] = set()   # who found them (None: this rank)
        self._reason: Optional[str] = None
        self._deadline: Optional[float] = None   # when to report and end, once a loss is known
        self._sending: List[Any] = []   # verdicts in flight (requests)
        self._masks: List[npt.NDArray[np.uint8]] = []   # their buffers
        # Probes and answers in flight, with their buffers.
        self._small: List[Tuple[Any, npt.NDArray[np.int64]]] = []
        self._thread = threading.Thread(target=self._run, name="hyparflow-heartbeat",
                                        daemon=True)
        self._thread.start()

    # -- the thread
    def _run(self) -> None:
        MPI = self._MPI
        next_beat = 0.0
        while not self._stop.is_set():
            try:
                now = time.monotonic()
                self._receive(now)
                if now >= next_beat:
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
            self._stop.wait(min(0.25, self.interval / 4))

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
        self.asked[r] = now + self.probe_seconds
        self.why[r] = f"no rank on its host answered for it within {self.probe_seconds:g} s"
        for m in mates:
            self._send(np.array([r], np.int64), m, self.tags[_PROBE])
        return False

    def _send(self, data: npt.NDArray[np.int64], to: int, tag: int) -> None:
        """A small message that must not be waited for (its buffer kept until sent)."""
        try:
            self._small = [(q, b) for q, b in self._small if not q.Test()]
            self._small.append((self.comm.Isend(data, to, tag), data))
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
        reqs: List[Any] = []
        for r in range(self.size):
            if r != self.rank and r not in self.lost and r not in self.gone:
                try:
                    reqs.append(self.comm.Isend(mask, r, self.tags[_VERDICT]))
                except self._MPI.Exception:
                    pass
        self._sending += reqs
        self._masks.append(mask)        # alive until sent

    def _receive(self, now: float) -> None:
        MPI = self._MPI
        status = MPI.Status()
        while self._recv.Test(status):
            self.heard[status.Get_source()] = now
            self.asked.pop(status.Get_source(), None)
            self._recv = self.comm.Irecv(self._beat_in, MPI.ANY_SOURCE, self.tags[_BEAT])
        while self._recv_probe.Test(status):
            # Another rank asks about a silent rank on this machine: look it up here.
            r = int(self._probe_in[0])
            self._recv_probe = self.comm.Irecv(self._probe_in, MPI.ANY_SOURCE, self.tags[_PROBE])
            self._send(np.array([r, _probe_machine(self.machines[r])], np.int64),
                       status.Get_source(), self.tags[_ANSWER])
        while self._recv_answer.Test(status):
            r, state = (int(v) for v in self._answer_in)
            self._recv_answer = self.comm.Irecv(self._answer_in, MPI.ANY_SOURCE, self.tags[_ANSWER])
            if r in self.asked and state == _ALIVE:
                del self.asked[r]
                self.why.pop(r, None)
                self.heard[r] = now - self.limit + self.interval   # busy: ask again soon
            elif r in self.asked:
                self.why[r] = f"its process is stopped or gone, seen by rank {status.Get_source()}"
                self._found([r], None)
        while self._recv_bye.Test(status):
            self.gone.add(status.Get_source())
            self._recv_bye = self.comm.Irecv(self._beat_in[:0], MPI.ANY_SOURCE, self.tags[_BYE])
        while self._recv_verdict.Test(status):
            lost = [r for r in range(self.size) if self._verdict_in[r]]
            self._recv_verdict = self.comm.Irecv(self._verdict_in, MPI.ANY_SOURCE, self.tags[_VERDICT])
            self._found(lost, status.Get_source())

    def _beat(self) -> None:
        for r in self.peers:
            if r in self.gone:
                continue
            req = self._sends.get(r)
            # One beat in flight per peer: a peer that stopped reading gets no pile-up.
            if req is None or req.Test():
                self._sends[r] = self.comm.Isend(self._one, r, self.tags[_BEAT])
        self.beats += 1

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
        reqs = self._sending + [q for q, _ in self._small]
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
        """End the thread and say goodbye (this rank's silence from now on is no loss)."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join()
        MPI = self._MPI
        byes: List[Any] = []
        for r in self.peers:
            if r not in self.gone:
                try:
                    byes.append(self.comm.Isend(self._one[:0], r, self.tags[_BYE]))
                except MPI.Exception:
                    pass
        deadline = time.monotonic() + 2.0
        try:
            while byes and time.monotonic() < deadline:
                byes = [q for q in byes if not q.Test()]
                time.sleep(0.001)
            for req in (self._recv, self._recv_verdict, self._recv_bye, self._recv_probe,
                        self._recv_answer):
                if not req.Test():
                    req.Cancel()
                    req.Wait()
            # Read what has come meanwhile (beats and goodbyes crossing this one), so
            # that little is left unread when the context passes on (see the tags).
            status = MPI.Status()
            while self.comm.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG, status):
                sink = np.empty(max(1, status.Get_count(MPI.BYTE)), np.uint8)
                self.comm.Recv([sink, status.Get_count(MPI.BYTE), MPI.BYTE],
                               status.Get_source(), status.Get_tag())
            self.comm.Free()
        except MPI.Exception:
            pass


def start(comm: object, hosts: Sequence[str],
          describe: Optional[Callable[[], str]] = None) -> Optional[Heartbeat]:
    """A Heartbeat for an MPICommunicator of more than one rank (None otherwise, or when
    HYPARFLOW_PEER_TIMEOUT=0)."""
    from ..engine.comm import MPICommunicator

    if not isinstance(comm, MPICommunicator) or comm.size < 2 or peer_timeout_seconds() is None:
        return None
    return Heartbeat(comm.comm, hosts, describe=describe)
