"""The collectives of split layers: sums, gathers and entries over the T ranks of a
stage, as TensorFlow operations with gradients (inside the compiled stage functions),
and the tags that keep independent collectives from pairing."""

import time

import numpy as np
import tensorflow as tf

from ...engine import order as _order
from ... import settings
from ...engine.comm import CommTimeout, sum_in_order, timeout_seconds, wait_all

__all__ = ["Collectives", "CollectiveOrderError", "site_tag", "TAG", "SUM", "GATHER", "SCORES",
           "WEIGHTS", "ENTER", "SUBS"]

TAG = 11  # a collective outside any split layer (the planner's measurements)

# Every collective of a split layer has a tag of its own: (site, role), a site being
# a split layer (its node index) or one of the layers a `Nested` splits inside it.
# The collectives of independent branches (an encoder's and a decoder's, or the
# backward sums of cross-attention's query and key/value) have no fixed order in a
# compiled function, so two tensor ranks may run them in different orders: with
# one tag, rank 0's first exchange would take rank 1's second (summing the wrong
# tensors where the shapes agree). MPI (and the in-process communicator) match
# messages of one tag in the order they were sent, and a site runs its collective
# once per call of a stage function, which every tensor rank makes in the same
# order, so the n-th exchange of a site pairs with the n-th on every rank.
SUM, GATHER, SCORES, WEIGHTS, ENTER = range(5)  # ENTER + k: the k-th input entered
_ROLES = 8
SUBS = 64  # layers a `Nested` may split inside one layer
_SITE_BASE = 16


def site_tag(site, role):
    return _SITE_BASE + site * _ROLES + role


# What each tag's collective is (the layer a message names), as the stage functions
# made them: the same on every rank, so a peer's pending message names its layer here.
_SITES: dict = {}  # tag -> what


class CollectiveOrderError(RuntimeError):
    """Two ranks wait in different collectives: neither can go on."""


def _named(tag, what):
    _SITES[tag] = what


class Collectives:
    """Sums and gathers over the T ranks of a stage, as TensorFlow operations with
    gradients (for use inside the compiled stage functions)."""

    def __init__(self, comm=None):
        self.comm = comm  # set once the ranks are connected

    peers = "tensor ranks"  # who the waiting message names

    def exchange(self, array, shapes, what, tag=TAG, members=None):
        """Every member's array (shapes[k] for members[k]; members: every rank by
        default), in member order. `tag`: the collective's own (see `site_tag`), so
        that independent ones never pair."""
        comm = self.comm
        members = range(comm.size) if members is None else members
        array = np.ascontiguousarray(array)
        out, reqs, recvs = [], [], {}
        for p, shape in zip(members, shapes):
            if p == comm.rank:
                out.append(array)
                continue
            out.append(np.empty(shape, array.dtype))
            recvs[p] = comm.irecv(out[-1], p, tag)
            reqs.append(recvs[p])
            reqs.append(comm.isend(array, p, tag))
        self.wait(reqs, what, tag, recvs)
        return out

    def wait(self, reqs, what, tag=None, recvs=None):
        """Wait for `reqs` under the watchdog. A collective still waiting after
        HYPARFLOW_ORDER_SECONDS looks at what the peers it waits for have sent: a
        message of another collective from a peer whose message for this one has not
        come means that peer waits in the other one, and neither can go on; it is
        named at once. Otherwise it says what it waits for, and waits on."""
        comm, timeout = self.comm, timeout_seconds()
        waiting = f"the other {self.peers} ({what})"
        late = settings.order_seconds()
        if timeout is not None and timeout <= late:
            wait_all(reqs, timeout, waiting, comm.spin)
            return
        pending = [r for r in reqs if r is not None]
        try:
            wait_all(pending, late, waiting, comm.spin)
            return
        except CommTimeout:
            pass
        self._look(what, tag, recvs or {})
        print(f"hyparflow: rank {comm.rank} of the {self.peers} has waited {late:g} s in "
              f"{what}'s collective", flush=True)
        rest = None if timeout is None else timeout - late
        deadline = None if rest is None else time.monotonic() + rest
        while True:
            step = 1.0 if deadline is None else min(1.0, max(deadline - time.monotonic(), 0.0))
            try:
                wait_all(pending, step, waiting, comm.spin)
                return
            except CommTimeout:
                if deadline is not None and time.monotonic() >= deadline:
                    raise CommTimeout(f"waited more than {timeout:g} s for {waiting}") from None
                pending[:] = [r for r in pending if not r.test()]
                self._look(what, tag, recvs or {})

    def _look(self, what, tag, recvs):
        for p, req in recvs.items():
            if req.test():
                continue
            theirs = self.comm.pending_tag(p)
            if theirs is None or theirs == tag or theirs not in _SITES:
                continue
            raise CollectiveOrderError(
                f"rank {self.comm.rank} of the {self.peers} waits in {what}'s collective "
                f"(tag {tag}) while rank {p} waits in {_SITES[theirs]}'s (tag {theirs}): "
                "each waits for the other. The collectives of split layers run in one "
                "order on every rank; a layer that makes collectives of its own, or "
                "different models or inputs on the ranks, can break it.")

    def _summed(self, x, what, tag):
        def run(value):
            value = value.numpy()
            return sum_in_order(self.exchange(value, [value.shape] * self.comm.size, what, tag))

        out = _order.py_function(run, [x], x.dtype)
        out.set_shape(x.shape)
        return out

    def sum(self, x, what, tag=TAG):
        """Forward: the sum over ranks; backward: the gradient as it is."""
        _named(tag, what)

        @_order.custom_gradient
        def op(x):
            return self._summed(x, what, tag), lambda dy: dy

        return op(x)

    def enter(self, x, what, tag=TAG):
        """Forward: `x` as it is (replicated); backward: the sum of the ranks' partial
        gradients (each rank's split layer sees only its part)."""
        _named(tag, what)

        @_order.custom_gradient
        def op(x):
            return tf.identity(x), lambda dy: self._summed(dy, what, tag)

        return op(x)

    def gather(self, x, sizes, what, axis=-1, tag=TAG):
        """Forward: the ranks' parts joined on `axis` (their sizes `sizes`); backward:
        this rank's part."""
        _named(tag, what)
        rank = self.comm.rank
        start = sum(sizes[:rank])
        ndim = len(x.shape)
        axis = axis % ndim

        def run(value):
            value = value.numpy()
            shapes = [value.shape[:axis] + (n,) + value.shape[axis + 1:] for n in sizes]
            return np.concatenate(self.exchange(value, shapes, what, tag), axis=axis)

        def part(dy):
            index = [slice(None)] * ndim
            index[axis] = slice(start, start + sizes[rank])
            return dy[tuple(index)]

        @_order.custom_gradient
        def op(x):
            out = _order.py_function(run, [x], x.dtype)
            shape = x.shape.as_list()
            shape[axis] = sum(sizes)
            out.set_shape(shape)
            return out, part

        return op(x)
