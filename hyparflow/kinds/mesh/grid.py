"""The q x q mesh of a stage's tensor ranks (2D tensor parallelism, Optimus/SUMMA).

Tensor rank t sits at (i, j) = divmod(t, q). A value of the mesh region is held in
blocks: rank (i, j) holds batch rows block i and feature block j. Its **row group**
(the ranks (i, 0..q-1)) shares its batch rows and holds the other feature blocks, so
reductions over features (a LayerNormalization's mean) go over the row group; its
**column group** (the ranks (0..q-1, j)) holds the same feature block of the other
rows, so reductions over the batch (a bias's gradient) go over the column group.

A Keras mask (padding) is never cut: a block carries the whole value's mask, as every
rank holds it (masks come from whole values: the inputs, an Embedding's whole ids), and
a kind that reads it (attention) takes its rows.

`Mesh` does the group collectives on numpy arrays (inside `tf.py_function`s: each
layer's whole forward or backward exchange runs in one, in a fixed order, so no two
ranks can pair different messages), and the TensorFlow operations with gradients
that move values into and out of the mesh (`to_block`, `to_whole`, `group_sum`)."""

from typing import Any, List, Tuple

import numpy as np
import tensorflow as tf

from ... import _compat
from ...engine import order as _order
from ...engine.comm import sum_in_order
from ..tensor.collectives import Collectives, site_tag
from ..tensor.split import split_sizes

__all__ = ["Mesh", "rows_of", "sizes_of", "mesh_tag", "is_block", "whole_of", "mark"]

_ATTR = "_hyparflow_mesh_block"  # on a block tensor: (the whole's rows, its features)


def mesh_tag(node: int, role: int) -> int:
    """Role `role` (0..63) of the mesh layer at graph node `node`: the tensor kinds'
    tags (`site_tag`) of the node's first 8 sub-sites (of `SUBS`, 64), 8 roles each."""
    from ..tensor.collectives import SUBS

    return int(site_tag(node * SUBS + role // 8, role % 8))


def sizes_of(n: int, q: int) -> List[int]:
    """`n` features in q even blocks (largest remainder)."""
    return list(split_sizes(n, [1.0 / q] * q))


def rows_of(batch: Any, q: int, i: int) -> Tuple[Any, Any]:
    """(start, stop) of batch rows block i of `batch` rows (any int or int tensor)."""
    return (i * batch) // q, ((i + 1) * batch) // q


def mark(block: Any, batch: Any, features: int) -> Any:
    """Note on `block` that it is a mesh block of a value of `batch` rows (an int
    tensor) and `features` features."""
    setattr(block, _ATTR, (batch, int(features)))
    return block


def is_block(value: Any) -> bool:
    return getattr(value, _ATTR, None) is not None


def whole_of(block: Any) -> Tuple[Any, int]:
    """(rows, features) of the whole value `block` is a block of."""
    batch, features = getattr(block, _ATTR)
    return batch, int(features)


class Mesh(Collectives):
    """The collectives of a q x q mesh over the stage's T = q * q tensor ranks (`comm`,
    set when the ranks connect, as for the 1D kinds)."""

    peers = "mesh ranks"

    def __init__(self, q, comm=None):
        super().__init__(comm)
        self.q = q

    @property
    def coords(self):
        return divmod(self.comm.rank, self.q)

    def row(self):
        i, _ = self.coords
        return [i * self.q + k for k in range(self.q)]

    def column(self):
        _, j = self.coords
        return [k * self.q + j for k in range(self.q)]

    def everyone(self):
        return list(range(self.q * self.q))

    def post_bcast(self, value, root, members, shape, dtype, tag):
        """Start broadcasting `value` (on `root`) to `members`: (array, requests); the
        array is valid once the requests are waited for."""
        me, reqs = self.comm.rank, []
        if me == root:
            value = np.ascontiguousarray(value)
            reqs = [self.comm.isend(value, p, tag) for p in members if p != me]
            return value, reqs
        out = np.empty(shape, dtype)
        return out, [self.comm.irecv(out, root, tag)]

    def reduce(self, value, root, members, what, tag):
        """The sum of every member's `value` in member order, on `root` (None elsewhere)."""
        me = self.comm.rank
        value = np.ascontiguousarray(value)
        if me != root:
            self.wait([self.comm.isend(value, root, tag)], what)
            return None
        parts, reqs = {me: value}, []
        for p in members:
            if p != me:
                parts[p] = np.empty(value.shape, value.dtype)
                reqs.append(self.comm.irecv(parts[p], p, tag))
        self.wait(reqs, what)
        return sum_in_order([parts[p] for p in members])

    def allsum(self, value, members, what, tag):
        """The sum over `members` in member order, on every member (the same bits)."""
        return sum_in_order(self.exchange(value, [value.shape] * len(members), what, tag,
                                          members))

    # -- whole values <-> blocks ------------------------------------------

    def assemble(self, blocks):
        """The whole value from its q * q blocks, in grid order."""
        q = self.q
        rows = [np.concatenate(blocks[i * q:(i + 1) * q], axis=-1) for i in range(q)]
        return np.concatenate(rows, axis=0)

    def block_shapes(self, batch, middle, features):
        """The q * q blocks' shapes (grid order) of a [batch, *middle, features] value."""
        q, cols = self.q, sizes_of(features, self.q)
        out = []
        for i in range(q):
            lo, hi = rows_of(batch, q, i)
            out += [(hi - lo, *middle, n) for n in cols]
        return out

    def slice_block(self, value, i, j):
        """Block (i, j) of a whole value (a tensor or an array)."""
        q = self.q
        features = int(value.shape[-1])
        cols = sizes_of(features, q)
        batch = tf.shape(value)[0] if tf.is_tensor(value) else value.shape[0]
        lo, hi = rows_of(batch, q, i)
        start = sum(cols[:j])
        return value[lo:hi, ..., start:start + cols[j]]

    def to_block(self, x, what, tag):
        """This rank's block of a whole (replicated) value. Backward: the whole gradient
        from every rank's block of it (the layers before the mesh are replicated, so
        each rank needs all of it)."""
        i, j = self.coords
        features = int(x.shape[-1])

        def whole(dy, batch):
            batch, dy = int(batch), dy.numpy()
            middle = dy.shape[1:-1]  # as it runs: a sequence may be of any length
            blocks = self.exchange(dy, self.block_shapes(batch, middle, features),
                                   what, tag, self.everyone())
            return self.assemble(blocks)

        @_order.custom_gradient
        def op(x):
            batch = tf.shape(x)[0]

            def grad(dy):
                out = _order.py_function(whole, [dy, batch], dy.dtype)
                out.set_shape(x.shape)
                return out

            return self.slice_block(x, i, j), grad

        block = mark(op(x), tf.shape(x)[0], features)
        _compat.set_mask(block, _compat.get_mask(x))  # masks stay whole (`MeshPart`)
        return block

    def to_whole(self, block, what, tag):
        """The whole value from every rank's block (each rank gets the same). Backward:
        this rank's block of the (replicated) gradient."""
        i, j = self.coords
        batch, features = whole_of(block)

        def gather(value, rows):
            rows, value = int(rows), value.numpy()
            blocks = self.exchange(value, self.block_shapes(rows, value.shape[1:-1], features),
                                   what, tag, self.everyone())
            return self.assemble(blocks)

        @_order.custom_gradient
        def op(value):
            out = _order.py_function(gather, [value, batch], value.dtype)
            out.set_shape(tf.TensorShape([None]).concatenate(block.shape[1:-1])
                          .concatenate([features]))
            return out, lambda dy: self.slice_block(dy, i, j)

        return op(block)

    def group_sum(self, x, members, what, tags):
        """Forward: the sum of `x` over `members` (every member gets it); backward: the
        sum of the gradients over `members` (each member's output used all inputs).
        `tags`: (forward's, backward's)."""

        def summed(value, t):
            out = _order.py_function(lambda v: self.allsum(v.numpy(), members(), what, t),
                                 [value], value.dtype)
            out.set_shape(value.shape)
            return out

        @_order.custom_gradient
        def op(x):
            return summed(x, tags[0]), lambda dy: summed(dy, tags[1])

        return op(x)

    def shared(self, x, members, what, tag):
        """Forward: `x` as it is (a copy every member holds); backward: the gradient
        summed over `members`, so every copy steps alike (a bias over batch rows)."""

        @_order.custom_gradient
        def op(x):
            def grad(dy):
                out = _order.py_function(lambda v: self.allsum(v.numpy(), members(), what, tag),
                                     [dy], dy.dtype)
                out.set_shape(dy.shape)
                return out

            return tf.identity(x), grad

        return op(x)
