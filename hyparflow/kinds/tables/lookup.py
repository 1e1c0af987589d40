"""The lookups of sharded tables: ids to their owners, rows back, gradients to the
owners again (all-to-all by non-blocking point-to-point messages over the ranks that
share the tables), as TensorFlow operations inside the compiled stage functions.

One lookup of a microbatch's ids `x` (any shape) of a table whose rows are owned in
contiguous ranges (`Placement.sizes`):

1. `route` (numpy): each id's owner; the ids sorted by owner, stably, so each owner
   gets a rank's ids in the order of its batch; counts, then the ids (as row
   numbers in the owner's part) go to the owners. The owner's `requested` is every
   rank's ids for it, in rank order: the order of the global batch, whose r-th
   slice is replica r's.
2. `tf.gather(part, requested)` on the owner: a plain TensorFlow gather, so the
   part's gradient is the `tf.IndexedSlices` a gather gives: one (row, value) pair
   per looked-up id, which the stage keeps (`Gradients.keep`) and the owner's
   optimizer applies as `model.fit` applies the whole table's pairs: Keras's SGD,
   Adam, Adagrad and the rest treat each row alone (dense slot updates touch every
   row alike), so a part stepped on the pairs of its rows ends where those rows end.
3. `exchange` (numpy, with a gradient): the rows back to the ranks that asked, put
   back in batch order; its backward sends each row's gradient to its owner in the
   order of `requested`.

An id outside the table fails on every rank at step 1 (the flag rides with the
counts), with Keras's words, so no rank waits for a message that never comes."""

import numpy as np
import tensorflow as tf

from ...engine.comm import timeout_seconds, wait_all

__all__ = ["Router", "TAG_BASE"]

TAG_BASE = 1 << 12
_ROLES = 4
COUNTS, IDS, ROWS, GRADS = range(_ROLES)


class Router:
    """The ranks that share the sharded tables (`comm`: set once they are connected)
    and the bytes this rank sent to the others (for the benchmark)."""

    def __init__(self):
        self.comm = None
        self.bytes = 0
        self.largest = 0  # the largest message sent, in bytes

    def alltoall(self, blocks, counts_in, tail, dtype, tag, what):
        """Send blocks[p] to rank p; receive counts_in[p] rows of shape `tail` from each."""
        comm = self.comm
        out, reqs = [None] * comm.size, []
        for p in range(comm.size):
            if p == comm.rank:
                out[p] = blocks[p]
                continue
            out[p] = np.empty((int(counts_in[p]),) + tuple(tail), dtype)
            reqs.append(comm.irecv(out[p], p, tag))
            block = np.ascontiguousarray(blocks[p], dtype)
            reqs.append(comm.isend(block, p, tag))
            self.bytes += block.nbytes
            self.largest = max(self.largest, block.nbytes)
        wait_all(reqs, timeout_seconds(), f"the other ranks' {what}", comm.spin)
        return out


def _offsets(counts):
    return np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)


class Lookup:
    """The lookup of one sharded table (`part`: this rank's `TablePart`)."""

    def __init__(self, part, router, site):
        self.part, self.router = part, router
        self.tag = TAG_BASE + site * _ROLES
        p = part.placement
        self.ends = np.cumsum(p.sizes).astype(np.int64)
        self.starts = np.asarray(p.starts, np.int64)
        self.rows, self.dim = p.table.rows, p.table.dim
        self.what = f"lookups of layer {part.op.name!r}"

    # -- numpy, inside py_function -------------------------------------------
    def route(self, ids):
        shape = tuple(ids.shape)
        ids = ids.numpy().astype(np.int64, copy=False).reshape(-1)
        comm, size = self.router.comm, self.router.comm.size
        bad = np.flatnonzero((ids < 0) | (ids >= self.rows))
        owner = np.searchsorted(self.ends, ids, side="right")
        order = np.argsort(owner, kind="stable")
        # With a bad id nothing but the flag is sent: every rank raises after the counts.
        counts = (np.bincount(owner, minlength=size) if bad.size == 0
                  else np.zeros(size, np.int64))
        flag = [int(bad[0]), int(ids[bad[0]])] if bad.size else [-1, 0]
        head = [np.array([counts[p], *flag], np.int64) for p in range(size)]
        heads = self.router.alltoall(head, [3] * size, (), np.int64, self.tag + COUNTS,
                                     self.what)
        for r, (_, where, value) in enumerate(heads):
            if where >= 0:
                at = ",".join(str(int(i)) for i in np.unravel_index(where, shape)) \
                    if r == comm.rank else "?"
                mine = "" if r == comm.rank else f" (in replica {r}'s microbatch)"
                # Keras's words (model.fit's GatherV2 error), naming the layer.
                raise ValueError(
                    f"Exception encountered when calling Embedding.call() of layer "
                    f"{self.part.op.name!r}: indices[{at}] = {value} is not in "
                    f"[0, {self.rows}){mine}. Every id must be below the layer's "
                    f"input_dim={self.rows}: fix the ids, or raise input_dim.")
        recv = np.array([h[0] for h in heads], np.int64)
        local = (ids[order] - self.starts[owner[order]]).astype(np.int64)
        off = _offsets(counts)
        blocks = [local[off[p]:off[p + 1]] for p in range(size)]
        got = self.router.alltoall(blocks, recv, (), np.int64, self.tag + IDS, self.what)
        requested = np.concatenate(got) if got else np.zeros(0, np.int64)
        return requested, counts.astype(np.int64), recv, order.astype(np.int64)

    def rows_back(self, rows, sent, recv, order):
        rows, sent, recv, order = rows.numpy(), sent.numpy(), recv.numpy(), order.numpy()
        size = self.router.comm.size
        off = _offsets(recv)
        blocks = [rows[off[p]:off[p + 1]] for p in range(size)]
        got = self.router.alltoall(blocks, sent, (self.dim,), rows.dtype, self.tag + ROWS,
                                   self.what)
        out = np.empty((len(order), self.dim), rows.dtype)
        out[order] = np.concatenate(got)
        return out

    def grads_back(self, dy, sent, recv, order):
        dy, sent, recv, order = dy.numpy(), sent.numpy(), recv.numpy(), order.numpy()
        size = self.router.comm.size
        ordered = dy[order]
        off = _offsets(sent)
        blocks = [ordered[off[p]:off[p + 1]] for p in range(size)]
        got = self.router.alltoall(blocks, recv, (self.dim,), dy.dtype, self.tag + GRADS,
                                   f"gradients of {self.what}")
        return np.concatenate(got).reshape(-1, self.dim)

    # -- TensorFlow ----------------------------------------------------------
    def __call__(self, ids):
        """The looked-up rows of `ids` (any shape), shape ids.shape + (dim,)."""
        requested, sent, recv, order = tf.py_function(
            self.route, [tf.cast(ids, tf.int64)], [tf.int64, tf.int64, tf.int64, tf.int64])
        requested.set_shape([None])
        table = self.part.variable.value
        rows = tf.gather(table, requested)
        dim, dtype = self.dim, rows.dtype

        @tf.custom_gradient
        def exchange(rows, sent, recv, order):
            out = tf.py_function(self.rows_back, [rows, sent, recv, order], dtype)
            out.set_shape([None, dim])

            def grad(dy):
                g = tf.py_function(self.grads_back, [tf.convert_to_tensor(dy), sent, recv, order],
                                   dtype)
                g.set_shape([None, dim])
                return g, None, None, None

            return out, grad

        out = exchange(rows, sent, recv, order)
        return tf.reshape(out, tf.concat([tf.shape(ids), [dim]], 0))
