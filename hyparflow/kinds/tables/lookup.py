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

A "column" table (`ColumnLookup`) sends every id to every rank instead, and the
slices of columns come back side by side.

A pooled lookup (`pooled`: a bag of ids per sample summed, `pooled.py` finds them)
sends each kept id with its sample's slot; the owner gathers its rows and sums them
per sample (`unsorted_segment_sum`, whose gradient hands a sample's pooled gradient
to each of its rows: the same pairs, in the same order, as the per-id lookup) and
sends one vector per sample it had ids for (row-wise: partial sums, added on the
sample's rank; "column": its columns of the whole sum). Rows and gradients may travel in 16 bits
(`Router.wire`, `communication_dtype`): cast back to float32 on arrival.

With tensor ranks (`Router.silent`), every tensor rank of a replica looks its ids up
(it needs the rows) but only tensor rank 0 sends gradients: the owners take the
others' as zeros, which leave each row's sum as it was.

An id outside the table fails on every rank at step 1 (the flag rides with the
counts), with Keras's words, so no rank waits for a message that never comes."""

import numpy as np
import tensorflow as tf

from ...engine import order as _order
from ...engine.comm import timeout_seconds, wait_all
from ...engine.wire import scaled

__all__ = ["Router", "Lookup", "ColumnLookup", "TAG_BASE", "pack", "unpack", "packed_rows"]

TAG_BASE = 1 << 12
_ROLES = 4
COUNTS, IDS, ROWS, GRADS = range(_ROLES)


def pack(block, wire):
    """A nonempty float32 gradient block for a float16 wire, with its scale: the
    values times 2**e, e chosen so the largest is near 2**15 (no overflow past
    65504, small values kept above float16's underflow), and a last row holding e
    (an integer: exact in float16). The scale is a power of two, so scaling and
    unscaling round nothing; only the cast to float16 does."""
    block = np.asarray(block, np.float32)
    top = float(np.max(np.abs(block))) if block.size else 0.0
    e = 0 if not np.isfinite(top) or top == 0.0 else int(
        np.clip(np.floor(np.log2(2.0 ** 15 / top)), -100, 100))
    row = np.full((1,) + block.shape[1:], e, np.float32)
    return np.concatenate([np.ldexp(block, e), row]).astype(wire)


def unpack(block, dtype):
    """`pack`'s inverse: the values, back in `dtype`, divided by their scale."""
    if not len(block):
        return block.astype(dtype)
    e = int(block[-1].reshape(-1)[0]) if block[-1].size else 0
    return np.ldexp(block[:-1].astype(dtype), -e)


def packed_rows(count):
    """The rows a packed block of `count` gradient rows travels in."""
    return count + 1 if count else 0


class Router:
    """The ranks that share the sharded tables (`comm`: set once they are connected),
    the dtype rows and gradients travel in (`wire`: None for as they are), and the
    bytes this rank sent to the others (for the benchmark): all (`bytes`: ids and
    counts too) and those of rows and gradients (`payload`)."""

    def __init__(self, wire=None):
        self.comm = None
        self.wire = wire
        # Ranks (of `comm`) whose lookups repeat another's: the tensor ranks t > 0 of a
        # replica look the same ids up as its tensor rank 0 and get the same
        # gradients; they send none, and the owners take theirs as zeros.
        self.silent = frozenset()
        self.bytes = 0
        self.payload = 0
        self.largest = 0  # the largest message sent, in bytes

    def gradients(self, blocks, counts_in, tail, dtype, tag, what):
        """`alltoall` of gradients, the silent ranks' (`silent`) left out: they send
        empty blocks, and what they would have sent arrives as zeros (zero pairs add
        nothing to a row's sum)."""
        comm = self.comm
        if comm.rank in self.silent:
            blocks = [block[:0] for block in blocks]
        counts = [0 if p in self.silent else counts_in[p] for p in range(comm.size)]
        if scaled(self.wire):
            # Each message scaled on its own (`pack`): no overflow, no underflow of
            # the small gradients, nothing for the ranks to agree on.
            out = [blocks[p] if p == comm.rank else
                   (pack(blocks[p], self.wire) if len(blocks[p]) else
                    np.zeros((0,) + tuple(tail), self.wire)) for p in range(comm.size)]
            got = self.alltoall(out, [packed_rows(int(c)) for c in counts], tail,
                                self.wire, tag, what)
            got = [g if p == comm.rank else unpack(g, dtype) for p, g in enumerate(got)]
        else:
            got = self.alltoall(blocks, counts, tail, dtype, tag, what, self.wire)
        for p in self.silent:
            got[p] = np.zeros((int(counts_in[p]),) + tuple(tail), dtype)
        return got

    def alltoall(self, blocks, counts_in, tail, dtype, tag, what, wire=None):
        """Send blocks[p] to rank p; receive counts_in[p] rows of shape `tail` (or
        tail[p], a list of shapes: one per rank) from each. `wire`: the dtype on the
        wire (received values are cast back to `dtype`: sums stay in it)."""
        comm = self.comm
        out, reqs, got = [None] * comm.size, [], []
        sent = dtype if wire is None else wire
        for p in range(comm.size):
            if p == comm.rank:
                out[p] = blocks[p]
                continue
            shape = tail[p] if isinstance(tail, list) else tail
            out[p] = np.empty((int(counts_in[p]),) + tuple(shape), sent)
            got.append(p)
            reqs.append(comm.irecv(out[p], p, tag))
            block = np.ascontiguousarray(blocks[p], sent)
            reqs.append(comm.isend(block, p, tag))
            self.bytes += block.nbytes
            if block.dtype.kind != "i":
                self.payload += block.nbytes
            self.largest = max(self.largest, block.nbytes)
        wait_all(reqs, timeout_seconds(), f"the other ranks' {what}", comm.spin)
        if wire is not None:
            for p in got:
                out[p] = out[p].astype(dtype)
        return out


def _offsets(counts):
    return np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)


class Lookup:
    """The lookup of one table sharded by rows ("table" or "row"; `part`: this rank's
    `TablePart`): each id goes to the one rank owning its row."""

    def __init__(self, part, router, site):
        self.part, self.router = part, router
        self.tag = TAG_BASE + site * _ROLES
        p = part.placement
        self.ends = np.cumsum(p.sizes).astype(np.int64)
        self.starts = np.asarray(p.starts, np.int64)
        self.rows, self.dim = p.table.rows, p.table.dim
        self.width = int(part.variable.shape[1])  # the columns of this rank's part
        self.what = f"lookups of layer {part.op.name!r}"

    # -- numpy, inside py_function -------------------------------------------
    def _heads(self, ids, shape, counts):
        """Send each rank how many ids it gets (counts[p]) with the flag of a bad id;
        raise Keras's error on every rank if any rank has one; the counts received."""
        comm, size = self.router.comm, self.router.comm.size
        bad = np.flatnonzero((ids < 0) | (ids >= self.rows))
        # With a bad id nothing but the flag is sent: every rank raises after the counts.
        if bad.size:
            counts = np.zeros(size, np.int64)
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
        return np.array([h[0] for h in heads], np.int64)

    def _ids(self, blocks, recv):
        got = self.router.alltoall(blocks, recv, (), np.int64, self.tag + IDS, self.what)
        return np.concatenate(got) if got else np.zeros(0, np.int64)

    def route(self, ids):
        shape = tuple(ids.shape)
        ids = ids.numpy().astype(np.int64, copy=False).reshape(-1)
        size = self.router.comm.size
        owner = np.searchsorted(self.ends, np.clip(ids, 0, self.rows - 1), side="right")
        order = np.argsort(owner, kind="stable")
        counts = np.bincount(owner, minlength=size).astype(np.int64)
        recv = self._heads(ids, shape, counts)
        local = (ids[order] - self.starts[owner[order]]).astype(np.int64)
        off = _offsets(counts)
        requested = self._ids([local[off[p]:off[p + 1]] for p in range(size)], recv)
        return requested, counts, recv, order.astype(np.int64)

    def rows_back(self, rows, sent, recv, order):
        rows, sent, recv, order = rows.numpy(), sent.numpy(), recv.numpy(), order.numpy()
        size = self.router.comm.size
        off = _offsets(recv)
        blocks = [rows[off[p]:off[p + 1]] for p in range(size)]
        got = self.router.alltoall(blocks, sent, (self.dim,), rows.dtype, self.tag + ROWS,
                                   self.what, self.router.wire)
        out = np.empty((len(order), self.dim), rows.dtype)
        out[order] = np.concatenate(got)
        return out

    def grads_back(self, dy, sent, recv, order):
        dy, sent, recv, order = dy.numpy(), sent.numpy(), recv.numpy(), order.numpy()
        size = self.router.comm.size
        ordered = dy[order]
        off = _offsets(sent)
        blocks = [ordered[off[p]:off[p + 1]] for p in range(size)]
        got = self.router.gradients(blocks, recv, (self.dim,), dy.dtype, self.tag + GRADS,
                                    f"gradients of {self.what}")
        return np.concatenate(got).reshape(-1, self.dim)

    # -- TensorFlow ----------------------------------------------------------
    def __call__(self, ids):
        """The looked-up rows of `ids` (any shape), shape ids.shape + (dim,)."""
        requested, sent, recv, order = _order.py_function(
            self.route, [tf.cast(ids, tf.int64)], [tf.int64, tf.int64, tf.int64, tf.int64])
        requested.set_shape([None])
        table = self.part.variable.value
        rows = tf.gather(table, requested)
        dim, width, dtype = self.dim, self.width, rows.dtype

        @_order.custom_gradient
        def exchange(rows, sent, recv, order):
            out = _order.py_function(self.rows_back, [rows, sent, recv, order], dtype)
            out.set_shape([None, dim])

            def grad(dy):
                g = _order.py_function(self.grads_back, [tf.convert_to_tensor(dy), sent, recv, order],
                                   dtype)
                g.set_shape([None, width])
                return g, None, None, None

            return out, grad

        out = exchange(rows, sent, recv, order)
        return tf.reshape(out, tf.concat([tf.shape(ids), [dim]], 0))

    # -- pooled lookups (`pooled.py`: a bag of ids per sample, summed) --------
    def _blocks(self, ids):
        """[indices into `ids` (ids kept for pooling, sample-major) for rank p]: the
        ids each rank pools, in batch order; and each block's ids as the owner
        numbers them (row numbers in its part)."""
        owner = np.searchsorted(self.ends, np.clip(ids, 0, self.rows - 1), side="right")
        order = np.argsort(owner, kind="stable")
        counts = np.bincount(owner, minlength=self.router.comm.size)
        off = _offsets(counts)
        picks = [order[off[p]:off[p + 1]] for p in range(len(counts))]
        return picks, [ids[k] - self.starts[p] for p, k in enumerate(picks)]

    def _put(self, out, p, samples, block):
        out[samples] += block  # a partial sum of the rows rank p owns

    def _take(self, dy, p, samples):
        return dy[samples]

    def _tails(self, size):
        """The shape of one pooled vector from each rank."""
        return [(self.dim,)] * size

    def pooled_route(self, ids, keep):
        """Each kept id (all of them when `keep` is empty) to the rank that pools it,
        with its slot: the sample's number among the samples of that block (its
        samples ascend, so slots are 0..k-1). Returns for TensorFlow: the rows this
        rank looks up (`requested`, every rank's in rank order: the global batch's),
        each one's segment among this rank's pooled vectors, their number, how many
        vectors each rank gets from this one (`theirs`) and sends it (`mine`), and
        the samples of this rank's vectors from each rank (`samples`, rank order)."""
        shape = tuple(ids.shape)
        ids = ids.numpy().astype(np.int64, copy=False)
        keep = keep.numpy()
        flat = ids.reshape(-1)
        sample = np.repeat(np.arange(shape[0], dtype=np.int64), shape[1])
        if keep.size:  # masked: the ids Keras's mask drops add nothing, and are not sent
            kept = keep.reshape(-1)
            ids_kept, sample = flat[kept], sample[kept]
        else:
            ids_kept = flat
        size = self.router.comm.size
        picks, local = self._blocks(ids_kept)
        blocks, samples, mine = [], [], np.zeros(size, np.int64)
        for p in range(size):
            s = sample[picks[p]]
            first = np.ones(len(s), bool)
            first[1:] = s[1:] != s[:-1]
            samples.append(s[first])
            mine[p] = len(samples[p])
            blocks.append(np.stack([local[p], np.cumsum(first) - 1], axis=1))
        recv = self._heads(flat, shape, np.array([len(b) for b in blocks], np.int64))
        got = self.router.alltoall(blocks, recv, (2,), np.int64, self.tag + IDS, self.what)
        theirs = np.array([int(g[-1, 1]) + 1 if len(g) else 0 for g in got], np.int64)
        base = _offsets(theirs)
        segments = np.concatenate([g[:, 1] + base[q] for q, g in enumerate(got)])
        requested = np.concatenate([g[:, 0] for g in got])
        return (requested, segments, np.int64(base[-1]), theirs, mine,
                np.concatenate(samples).astype(np.int64))

    def pooled_back(self, pooled, theirs, mine, samples, batch):
        """Each rank its vectors (one per sample it had ids for here), added into
        the microbatch's pooled sums in rank order (samples with none stay 0)."""
        pooled, theirs, mine = pooled.numpy(), theirs.numpy(), mine.numpy()
        samples = samples.numpy()
        size = self.router.comm.size
        off = _offsets(theirs)
        blocks = [pooled[off[p]:off[p + 1]] for p in range(size)]
        got = self.router.alltoall(blocks, mine, self._tails(size), pooled.dtype,
                                   self.tag + ROWS, self.what, self.router.wire)
        out = np.zeros((int(batch), self.dim), pooled.dtype)
        at = _offsets(mine)
        for p in range(size):
            self._put(out, p, samples[at[p]:at[p + 1]], got[p])
        return out

    def pooled_grads(self, dy, theirs, mine, samples):
        """The pooled gradient of each sample to the ranks that pooled it (a "column"
        rank: its columns): one vector per (sample, rank) as in the forward."""
        dy, theirs, mine, samples = dy.numpy(), theirs.numpy(), mine.numpy(), samples.numpy()
        size = self.router.comm.size
        at = _offsets(mine)
        blocks = [self._take(dy, p, samples[at[p]:at[p + 1]]) for p in range(size)]
        got = self.router.gradients(blocks, theirs, (self.width,), dy.dtype, self.tag + GRADS,
                                    f"gradients of {self.what}")
        return np.concatenate(got).reshape(-1, self.width)

    def pooled(self, ids, keep=None):
        """The sum over axis 1 of the rows of `ids` (batch, bag) where `keep` (same
        shape, bool; None: every id), shape (batch, dim): each rank pools the rows
        it owns (a sum per sample, on the owner) and sends one vector per sample.
        Its backward gives each owner the pooled gradient of the samples, which
        the segment sum's gradient hands to each of their rows: the (row, value)
        pairs of the global batch, in its order, as the per-id lookup gives."""
        ids = tf.cast(ids, tf.int64)
        keep = tf.zeros((0,), tf.bool) if keep is None else tf.cast(keep, tf.bool)
        requested, segments, count, theirs, mine, samples = _order.py_function(
            self.pooled_route, [ids, keep], [tf.int64] * 6)
        requested.set_shape([None])
        segments.set_shape([None])
        count.set_shape([])
        table = self.part.variable.value
        pooled = tf.math.unsorted_segment_sum(tf.gather(table, requested), segments, count)
        dim, width, dtype = self.dim, self.width, pooled.dtype
        batch = tf.shape(ids, out_type=tf.int64)[0]

        @_order.custom_gradient
        def exchange(pooled, theirs, mine, samples, batch):
            out = _order.py_function(self.pooled_back, [pooled, theirs, mine, samples, batch],
                                 dtype)
            out.set_shape([None, dim])

            def grad(dy):
                g = _order.py_function(self.pooled_grads,
                                   [tf.convert_to_tensor(dy), theirs, mine, samples], dtype)
                g.set_shape([None, width])
                return g, None, None, None, None

            return out, grad

        out = exchange(pooled, theirs, mine, samples, batch)
        return tf.reshape(out, tf.stack([batch, dim]))


class ColumnLookup(Lookup):
    """The lookup of a table sharded by columns: every id goes to every rank, each
    looks its columns of the rows up (all rows are on every rank), the slices come
    back and are put side by side in rank order; the backward sends each rank the
    gradient's columns it owns. The owner's `requested` is every rank's ids in rank
    order, as for rows: its pairs are in the global batch's order."""

    def __init__(self, part, router, site):
        super().__init__(part, router, site)
        p = part.placement
        self.widths = list(p.widths)
        self.firsts = p.columns

    def route(self, ids):
        shape = tuple(ids.shape)
        ids = ids.numpy().astype(np.int64, copy=False).reshape(-1)
        size = self.router.comm.size
        counts = np.full(size, ids.size, np.int64)
        recv = self._heads(ids, shape, counts)
        requested = self._ids([ids] * size, recv)
        return requested, counts, recv, np.arange(ids.size, dtype=np.int64)

    def rows_back(self, rows, sent, recv, order):
        rows, sent, recv = rows.numpy(), sent.numpy(), recv.numpy()
        size = self.router.comm.size
        off = _offsets(recv)
        blocks = [rows[off[p]:off[p + 1]] for p in range(size)]
        got = self.router.alltoall(blocks, sent, [(w,) for w in self.widths], rows.dtype,
                                   self.tag + ROWS, self.what, self.router.wire)
        return np.concatenate(got, axis=1)

    def _blocks(self, ids):
        every = np.arange(len(ids))
        return [every] * self.router.comm.size, [ids] * self.router.comm.size

    def _put(self, out, p, samples, block):
        out[samples, self.firsts[p]:self.firsts[p] + self.widths[p]] = block

    def _take(self, dy, p, samples):
        return dy[samples, self.firsts[p]:self.firsts[p] + self.widths[p]]

    def _tails(self, size):
        return [(w,) for w in self.widths]

    def grads_back(self, dy, sent, recv, order):
        dy, recv = dy.numpy(), recv.numpy()
        size = self.router.comm.size
        blocks = [dy[:, self.firsts[p]:self.firsts[p] + self.widths[p]] for p in range(size)]
        got = self.router.gradients(blocks, recv, (self.width,), dy.dtype, self.tag + GRADS,
                                    f"gradients of {self.what}")
        return np.concatenate(got).reshape(-1, self.width)
