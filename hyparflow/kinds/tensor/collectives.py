"""The collectives of split layers: sums, gathers and entries over the T ranks of a
stage, as TensorFlow operations with gradients (inside the compiled stage functions),
and the tags that keep independent collectives from pairing."""

import numpy as np
import tensorflow as tf

from ...engine.comm import sum_in_order, timeout_seconds, wait_all

__all__ = ["Collectives", "site_tag", "TAG", "SUM", "GATHER", "SCORES", "WEIGHTS", "ENTER", "SUBS"]

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
        out, reqs = [], []
        for p, shape in zip(members, shapes):
            if p == comm.rank:
                out.append(array)
                continue
            out.append(np.empty(shape, array.dtype))
            reqs.append(comm.irecv(out[-1], p, tag))
            reqs.append(comm.isend(array, p, tag))
        wait_all(reqs, timeout_seconds(), f"the other {self.peers} ({what})", comm.spin)
        return out

    def _summed(self, x, what, tag):
        def run(value):
            value = value.numpy()
            return sum_in_order(self.exchange(value, [value.shape] * self.comm.size, what, tag))

        out = tf.py_function(run, [x], x.dtype)
        out.set_shape(x.shape)
        return out

    def sum(self, x, what, tag=TAG):
        """Forward: the sum over ranks; backward: the gradient as it is."""

        @tf.custom_gradient
        def op(x):
            return self._summed(x, what, tag), lambda dy: dy

        return op(x)

    def enter(self, x, what, tag=TAG):
        """Forward: `x` as it is (replicated); backward: the sum of the ranks' partial
        gradients (each rank's split layer sees only its part)."""

        @tf.custom_gradient
        def op(x):
            return tf.identity(x), lambda dy: self._summed(dy, what, tag)

        return op(x)

    def gather(self, x, sizes, what, axis=-1, tag=TAG):
        """Forward: the ranks' parts joined on `axis` (their sizes `sizes`); backward:
        this rank's part."""
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

        @tf.custom_gradient
        def op(x):
            out = tf.py_function(run, [x], x.dtype)
            shape = x.shape.as_list()
            shape[axis] = sum(sizes)
            out.set_shape(shape)
            return out, part

        return op(x)
