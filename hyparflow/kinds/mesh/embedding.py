"""Embedding on the mesh: the table [vocabulary, hidden] in blocks, vocabulary over the
mesh rows and hidden over the columns (rank (i, j) holds ids block i, features block
j). Its output is the mesh's block (batch rows i, features j), so the layers after it
take blocks with no gather.

The ids come whole (from the model's inputs or replicated layers). Rank (k, j) looks up
the ids of every batch row that fall in its vocabulary block k (the others give zero
rows), as the 1D split by rows does; the column's ranks then sum these partial lookups
and each keeps its batch rows (a reduce-scatter in the column group: of the q terms of
an entry, one is the row and the others are zeros, so the sum is exact). Backward: the
column's ranks put their blocks of the output's gradient together over the batch (an
all-gather in the column group), and each rank's lookup turns it into (row, value)
pairs of its ids only, in the batch's order: the pairs `model.fit` gives, restricted to
the rank's block, so Adam steps a repeated id once per occurrence as Keras does
(docs/models.md, "Embeddings: sparse gradients"). With `mask_zero` its output carries
the padding mask of the whole ids (`part.MeshPart`), as every mesh value's mask is
whole."""

from typing import Any, List, Optional, Tuple

import keras
import numpy as np
import tensorflow as tf

from ...engine import order as _order
from ..tensor.split import common_why_not, qualified
from .base import GATHER, MeshKind
from .grid import is_block, mark, rows_of, sizes_of
from .part import BLOCK, MeshPart

__all__ = ["MeshEmbedding"]

_SUM, _BACK = 8, 9  # roles (`grid.mesh_tag`) of the column's sum and of its backward
_CALL = "keras.src.layers.core.embedding.Embedding.call"


class MeshEmbedding(MeshKind):
    name = "mesh-embedding"
    what = "Embedding"

    def sums(self, rows, out_bytes, q):
        # Forward, the column's partial lookups summed and scattered by batch rows;
        # backward, the output's gradient blocks gathered over the column.
        return [out_bytes / q], [out_bytes / q]

    def claims(self, op: Any) -> bool:
        return isinstance(op, keras.layers.Embedding)

    def why_not(self, op: Any, q: int) -> Optional[str]:
        if qualified(type(op).call) != _CALL:
            return (f"its class {type(op).__name__} overrides Embedding.call, which the mesh "
                    "cannot follow")
        reason = common_why_not(op, [op])
        if reason is not None:
            return reason
        if op.input_dim < q or op.output_dim < q:
            return (f"it has fewer rows ({op.input_dim}) or features ({op.output_dim}) than "
                    f"the mesh's {q} rows and columns")
        return None

    def cuts(self, op: Any) -> List[Tuple[Any, str]]:
        return [(op.embeddings, BLOCK)]

    def run(self, part: MeshPart, args: Any, kwargs: Any, training: Any) -> Any:
        op, mesh = part.op, part.coll
        ids = args[0] if args else kwargs["inputs"]
        if is_block(ids):
            raise ValueError(f"Embedding {op.name!r} on the tensor mesh is given its ids as "
                             "mesh blocks; its ids must come whole (from the inputs).")
        if ids.dtype not in (tf.int32, tf.int64):
            ids = tf.cast(ids, tf.int32)
        table = part.cuts[0][1].value
        starts = sizes_of(op.input_dim, mesh.q)
        start = sum(starts[:part.i])
        local = tf.reshape(ids - tf.cast(start, ids.dtype), [-1])
        mine = tf.logical_and(local >= 0, local < starts[part.i])
        # Only this rank's ids are looked up, in the batch's order (the 1D `Rows` kind's
        # way): its part's gradient holds no zero pairs for the other rows' ids.
        where = tf.where(mine)
        rows = tf.gather(table, tf.gather_nd(local, where))
        width = tf.cast(table.shape[-1], tf.int64)
        rows = tf.scatter_nd(where, rows, tf.stack([tf.size(local, out_type=tf.int64), width]))
        rows = tf.reshape(rows, tf.concat([tf.shape(ids), [table.shape[-1]]], 0))
        y = _column_scatter_sum(mesh, rows, part)
        y = mark(tf.cast(y, op.compute_dtype), tf.shape(ids)[0], op.output_dim)
        return mesh.to_whole(y, part.what, part.tag(GATHER)) if part.split.gather else y


def _column_scatter_sum(mesh: Any, x: Any, part: MeshPart) -> Any:
    """Forward: batch rows i of the sum over column j's ranks of `x` [batch, ..., f] (on
    rank (i, j)); backward: the column's gradient blocks put together over the batch."""
    q, what = mesh.q, part.what

    def forward(value):
        value = value.numpy()
        batch, me = value.shape[0], mesh.comm.rank
        column = mesh.column()
        i, _ = mesh.coords
        lo, hi = rows_of(batch, q, i)
        parts, reqs = {}, []
        for r, p in enumerate(column):
            if p == me:
                parts[p] = value[lo:hi]
                continue
            a, b = rows_of(batch, q, r)
            reqs.append(mesh.comm.isend(np.ascontiguousarray(value[a:b]), p, part.tag(_SUM)))
            parts[p] = np.empty((hi - lo,) + value.shape[1:], value.dtype)
            reqs.append(mesh.comm.irecv(parts[p], p, part.tag(_SUM)))
        mesh.wait(reqs, what)
        total = parts[column[0]].copy()
        for p in column[1:]:  # in column order, the same on every rank
            total += parts[p]
        return total

    def backward(dy, batch):
        dy, batch = dy.numpy(), int(batch)
        shapes = [(b - a,) + dy.shape[1:] for a, b in (rows_of(batch, q, r) for r in range(q))]
        blocks = mesh.exchange(dy, shapes, what, part.tag(_BACK), mesh.column())
        return np.concatenate(blocks, axis=0)

    @_order.custom_gradient
    def op(x):
        batch = tf.shape(x)[0]
        y = _order.py_function(forward, [x], x.dtype)
        y.set_shape(tf.TensorShape([None]).concatenate(x.shape[1:]))

        def grad(dy):
            dx = _order.py_function(backward, [dy, batch], dy.dtype)
            dx.set_shape(x.shape)
            return dx

        return y, grad

    return op(x)
