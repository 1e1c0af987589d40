"""An in-process communicator: several ranks as threads of one process, for tests.

`run_ranks(size, fn)` runs `fn(comm)` on `size` threads, each with its own
`LocalCommunicator`, and returns their results in rank order. Messages are
copied into per-(source, destination, tag) queues; collectives combine values
in rank order, so every rank sees bitwise the same result. A failure on one
thread makes every other wait raise `PeerFailure` instead of hanging.
"""

import collections
import threading

import numpy as np

from .comm import Communicator, poll, sum_in_order, timeout_seconds

__all__ = ["LocalWorld", "LocalCommunicator", "PeerFailure", "run_ranks"]


class PeerFailure(RuntimeError):
    """Another rank failed; this one stops instead of waiting for it."""


class _Group:
    def __init__(self, gid, members):
        self.gid = gid
        self.members = members  # world ranks, by group rank
        self.slots = {}
        self.reads = {}


class LocalWorld:
    def __init__(self, size, hosts=None):
        self.size = size
        # Host names the ranks report (tests of host-aware placement); None: this one's.
        self.hosts = None if hosts is None else list(hosts)
        if self.hosts is not None and len(self.hosts) != size:
            raise ValueError(f"run_ranks: hosts={hosts!r} must name one host per rank "
                             f"({size} ranks).")
        self.lock = threading.Condition()
        self.mail = collections.defaultdict(collections.deque)
        self.groups = {}
        self.failure = None
        world = self._group(("world",), list(range(size)))
        self.comms = [LocalCommunicator(self, world, r) for r in range(size)]

    def _group(self, gid, members):
        with self.lock:
            if gid not in self.groups:
                self.groups[gid] = _Group(gid, members)
            return self.groups[gid]

    def check(self):
        if self.failure is not None:
            raise PeerFailure(f"rank {self.failure[0]} failed: {self.failure[1]}")


class _LocalRequest:
    __slots__ = ("test",)

    def __init__(self, test):
        self.test = test


class LocalCommunicator(Communicator):
    spin = 0.0  # ranks are threads: a spinning wait would hold the GIL from the others

    def __init__(self, world, group, rank):
        self.world, self.group, self.rank = world, group, rank
        self.size = len(group.members)
        self._seq = 0

    def host(self):
        if self.world.hosts is None:
            return super().host()
        return self.world.hosts[self.group.members[self.rank]]

    # point to point --------------------------------------------------------
    def isend(self, buf, dest, tag):
        self.world.check()
        data = np.array(buf, copy=True)
        with self.world.lock:
            self.world.mail[(self.group.gid, self.rank, dest, tag)].append(data)
            self.world.lock.notify_all()
        return _LocalRequest(lambda: True)

    def irecv(self, buf, source, tag):
        key = (self.group.gid, source, self.rank, tag)
        done = []

        def test():
            if done:
                return True
            self.world.check()
            with self.world.lock:
                queue = self.world.mail.get(key)
                if not queue:
                    return False
                data = queue.popleft()
            if data.nbytes != buf.nbytes:
                raise RuntimeError(
                    f"message of {data.nbytes} bytes into a {buf.nbytes}-byte buffer "
                    f"(source {source}, tag {tag})"
                )
            buf.reshape(-1).view(np.uint8)[:] = data.reshape(-1).view(np.uint8)
            done.append(True)
            return True

        return _LocalRequest(test)

    def pending_tag(self, source):
        with self.world.lock:
            for (gid, src, dest, tag), queue in self.world.mail.items():
                if gid == self.group.gid and src == source and dest == self.rank and queue:
                    return tag
        return None

    # collectives -----------------------------------------------------------
    def _deposit(self, value):
        """Put `value` in this member's slot of the next collective; returns a test
        that is true once every member's is there (the values: `_take`)."""
        seq = self._seq
        self._seq += 1
        g, w = self.group, self.world
        with w.lock:
            g.slots.setdefault(seq, {})[self.rank] = value
            w.lock.notify_all()

        def ready():
            w.check()
            with w.lock:
                return len(g.slots[seq]) == self.size

        ready.seq = seq
        return ready

    def _take(self, seq):
        g, w = self.group, self.world
        with w.lock:
            values = [g.slots[seq][r] for r in range(self.size)]
            g.reads[seq] = g.reads.get(seq, 0) + 1
            if g.reads[seq] == self.size:
                del g.slots[seq], g.reads[seq]
        return values

    def _exchange(self, value):
        """Every member deposits `value`; each gets the list of all, in rank order."""
        ready = self._deposit(value)
        poll(ready, timeout_seconds(), f"collective #{ready.seq} on group {self.group.gid}",
              spin=0.0)
        return self._take(ready.seq)

    def iallreduce(self, buf):
        # Non-blocking as MPI's: the executor starts sums from inside a backward.
        ready, done = self._deposit(np.array(buf, copy=True)), []

        def test():
            if not done:
                if not ready():
                    return False
                buf[...] = sum_in_order(self._take(ready.seq))
                done.append(True)
            return True

        return _LocalRequest(test)

    def iallgatherv(self, send, recv, counts):
        ready, done = self._deposit(np.array(send, copy=True)), []

        def test():
            if not done:
                if not ready():
                    return False
                recv[...] = np.concatenate(self._take(ready.seq))
                done.append(True)
            return True

        return _LocalRequest(test)

    def allreduce(self, buf, timeout=None):
        buf[...] = sum_in_order(self._exchange(np.array(buf, copy=True)))
        return buf

    def bcast(self, buf, root, timeout=None):
        values = self._exchange(np.array(buf, copy=True) if self.rank == root else None)
        buf[...] = values[root]
        return buf

    def bcast_obj(self, obj, root):
        return self._exchange(obj if self.rank == root else None)[root]

    def allgather_obj(self, obj):
        return self._exchange(obj)

    def split(self, color, key):
        entries = self._exchange((color, key, self.rank))
        gid = (self.group.gid, self._seq, color)
        if color is None:
            return None
        mine = sorted((k, r) for c, k, r in entries if c == color)
        members = [self.group.members[r] for _, r in mine]
        group = self.world._group(gid, members)
        return LocalCommunicator(self.world, group, [r for _, r in mine].index(self.rank))

    def abort(self, code=1):
        with self.world.lock:
            if self.world.failure is None:
                self.world.failure = (self.group.members[self.rank], f"aborted with code {code}")
            self.world.lock.notify_all()


def run_ranks(size, fn, timeout=None, hosts=None):
    """Run `fn(comm)` on `size` threads; return results by rank or raise the first error.
    `hosts`: the host name each rank reports (`comm.host()`), as if they ran on several
    machines (default: this machine's for all)."""
    world = LocalWorld(size, hosts)
    results, errors = [None] * size, [None] * size

    def body(r):
        try:
            results[r] = fn(world.comms[r])
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors[r] = exc
            with world.lock:
                if world.failure is None:
                    world.failure = (r, repr(exc))
                world.lock.notify_all()

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    if any(t.is_alive() for t in threads):
        raise TimeoutError(f"ranks still running after {timeout} s")
    first = [e for e in errors if e is not None and not isinstance(e, PeerFailure)]
    if first:
        raise first[0]
    if any(errors):
        raise next(e for e in errors if e is not None)
    return results
