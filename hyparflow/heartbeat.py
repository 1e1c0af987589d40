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
silence afterwards is not a loss. Python's GIL is released by TensorFlow and MPI
calls, so a busy rank keeps beating; only a frozen process falls silent.
"""

import os
import sys
import threading
import time

import numpy as np
from . import settings

__all__ = ["Heartbeat", "interval_seconds", "peer_timeout_seconds", "EXIT_CODE", "start",
           "neighbours"]

EXIT_CODE = 75  # EX_TEMPFAIL: a peer was lost; a restart on the hosts left may succeed

_BEAT, _VERDICT, _BYE = 1, 2, 3          # tags on the heartbeat's own communicator


def interval_seconds():
    """Seconds between beats: HYPARFLOW_HEARTBEAT_SECONDS (default 2)."""
    return settings.heartbeat_seconds()


def peer_timeout_seconds():
    """Silence after which a peer is lost: HYPARFLOW_PEER_TIMEOUT (default 20; 0 turns the
    heartbeat off)."""
    return settings.peer_timeout()


def neighbours(rank, size):
    """The ranks `rank` beats to and watches (the same set: the relation is symmetric):
    rank +-1 around the ring, and rank +-size//2 (half way round) from 4 ranks on."""
    out = {(rank + 1) % size, (rank - 1) % size}
    if size >= 4:
        out |= {(rank + size // 2) % size, (rank - size // 2) % size}
    out.discard(rank)
    return sorted(out)


def _lost_message(rank, lost, hosts, found_by, silence):
    names = ", ".join(f"rank {r} on host {hosts[r]}" for r in sorted(lost))
    places = sorted({hosts[r] for r in lost})
    how = (f"silent for more than {silence:g} s" if found_by is None else
           f"silent for more than {silence:g} s, found by rank {found_by}")
    return (f"hyparflow: rank {rank} on host {hosts[rank]}: lost {names} ({how}: the "
            f"host{'s' if len(places) > 1 else ''} {', '.join(places)} died, froze or lost "
            f"its network; HYPARFLOW_PEER_TIMEOUT). Ending this rank with exit code "
            f"{EXIT_CODE}.\n")


class Heartbeat:
    """The beating thread of one rank. `comm`: an mpi4py communicator of which this
    rank duplicates its own (collective); `hosts`: every rank's host name."""

    def __init__(self, comm, hosts, interval=None, limit=None, describe=None):
        from mpi4py import MPI

        from .comm import _poll, timeout_seconds

        self._MPI = MPI
        new, req = comm.Idup()
        _poll(req.Test, timeout_seconds(), "the other ranks to start the heartbeat")
        self.comm = new
        # An error about a dead peer (a reset connection) is ours to report, not fatal here.
        self.comm.Set_errhandler(MPI.ERRORS_RETURN)
        self.rank, self.size = new.Get_rank(), new.Get_size()
        self.hosts = list(hosts)
        self.interval = interval or interval_seconds()
        self.limit = limit or peer_timeout_seconds()
        self.describe = describe        # what this rank was doing, for the message
        self.peers = neighbours(self.rank, self.size)   # beaten to and watched
        now = time.monotonic()
        self.heard = {r: now for r in self.peers}
        self.gone = set()               # peers that said goodbye
        self._one = np.ones(1, np.uint8)
        self._sends = {}                # peer -> its last beat's request
        self._beat_in = np.zeros(1, np.uint8)
        self._verdict_in = np.zeros(self.size, np.uint8)
        self._recv = self.comm.Irecv(self._beat_in, MPI.ANY_SOURCE, _BEAT)
        self._recv_verdict = self.comm.Irecv(self._verdict_in, MPI.ANY_SOURCE, _VERDICT)
        self._recv_bye = self.comm.Irecv(self._beat_in[:0], MPI.ANY_SOURCE, _BYE)
        self._stop = threading.Event()
        self.beats = 0
        self.lost = set()               # ranks found lost, here or by a verdict
        self.finders = set()            # who found them (None: this rank)
        self._reason = None
        self._deadline = None           # when to report and end, once a loss is known
        self._sending, self._masks = [], []   # verdicts in flight, their buffers
        self._thread = threading.Thread(target=self._run, name="hyparflow-heartbeat",
                                        daemon=True)
        self._thread.start()

    # -- the thread
    def _run(self):
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
                          and now - self.heard[r] > self.limit]
                if silent:
                    self._found(silent, None)
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

    def _found(self, lost, finder):
        """Ranks found lost (by this rank: `finder` None): tell the others, and report
        once the other finders' verdicts have had time to come."""
        new = set(lost) - self.lost
        self.lost |= set(lost)
        self.finders.add(finder)
        if self._deadline is None:
            self._deadline = time.monotonic() + self.interval + 0.5
        if finder is None and new:
            self._tell(sorted(self.lost))

    def _tell(self, lost):
        """The verdict to every rank not counted lost (not only the neighbours: each must
        name the lost ranks); a moment for it to leave, never a wait on a dead link."""
        mask = np.zeros(self.size, np.uint8)
        mask[lost] = 1
        reqs = []
        for r in range(self.size):
            if r != self.rank and r not in self.lost and r not in self.gone:
                try:
                    reqs.append(self.comm.Isend(mask, r, _VERDICT))
                except self._MPI.Exception:
                    pass
        self._sending += reqs
        self._masks.append(mask)        # alive until sent

    def _receive(self, now):
        MPI = self._MPI
        status = MPI.Status()
        while self._recv.Test(status):
            self.heard[status.Get_source()] = now
            self._recv = self.comm.Irecv(self._beat_in, MPI.ANY_SOURCE, _BEAT)
        while self._recv_bye.Test(status):
            self.gone.add(status.Get_source())
            self._recv_bye = self.comm.Irecv(self._beat_in[:0], MPI.ANY_SOURCE, _BYE)
        while self._recv_verdict.Test(status):
            lost = [r for r in range(self.size) if self._verdict_in[r]]
            self._recv_verdict = self.comm.Irecv(self._verdict_in, MPI.ANY_SOURCE, _VERDICT)
            self._found(lost, status.Get_source())

    def _beat(self):
        for r in self.peers:
            if r in self.gone:
                continue
            req = self._sends.get(r)
            # One beat in flight per peer: a peer that stopped reading gets no pile-up.
            if req is None or req.Test():
                self._sends[r] = self.comm.Isend(self._one, r, _BEAT)
        self.beats += 1

    def _end(self):
        """Report the lost peers (the union of the verdicts), end the process."""
        lost = sorted(self.lost)
        others = sorted(f for f in self.finders if f is not None)
        found_by = None if None in self.finders or not others else others[0]
        reason = self._reason
        text = (_lost_message(self.rank, lost, self.hosts, found_by, self.limit) if lost else
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
        reqs = self._sending
        linger = time.monotonic() + max(0.5, min(1.0, self.interval))
        while time.monotonic() < linger:
            try:
                reqs = [q for q in reqs if not q.Test()]
            except self._MPI.Exception:
                reqs = []
            time.sleep(0.01)
        os._exit(EXIT_CODE)

    # -- the main thread
    def stop(self):
        """End the thread and say goodbye (this rank's silence from now on is no loss)."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join()
        MPI = self._MPI
        byes = []
        for r in self.peers:
            if r not in self.gone:
                try:
                    byes.append(self.comm.Isend(self._one[:0], r, _BYE))
                except MPI.Exception:
                    pass
        deadline = time.monotonic() + 2.0
        try:
            while byes and time.monotonic() < deadline:
                byes = [q for q in byes if not q.Test()]
                time.sleep(0.001)
            for req in (self._recv, self._recv_verdict, self._recv_bye):
                if not req.Test():
                    req.Cancel()
                    req.Wait()
            self.comm.Free()
        except MPI.Exception:
            pass


def start(comm, hosts, describe=None):
    """A Heartbeat for an MPICommunicator of more than one rank (None otherwise, or when
    HYPARFLOW_PEER_TIMEOUT=0)."""
    from .comm import MPICommunicator

    if not isinstance(comm, MPICommunicator) or comm.size < 2 or peer_timeout_seconds() is None:
        return None
    return Heartbeat(comm.comm, hosts, describe=describe)
