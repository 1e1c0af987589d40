"""A language-model head on the mesh whose logits are never whole: the head (a Dense or
a last-axis EinsumDense, no activation) is a SUMMA product as any mesh Dense, and in
training its output stays the block (batch rows i, vocabulary block j) of the
[batch, sequence, vocabulary] logits; the cross-entropy is taken on the blocks.

Chosen (`choose`) only where it is exact: the head's output is the model's only output,
read by no other layer, and the model is compiled with
`SparseCategoricalCrossentropy(from_logits=True)` (no ignore_class, last axis), no
compiled metrics (they would read whole logits) and no `compute_loss` override.
Evaluation and prediction gather the logits whole, as any mesh region's output.

The loss (`_CrossEntropy`, handed to the engine on the block: `_compat.split_loss`) is
Keras's `Loss.__call__` (reduction, sample weights, the normaliser) around a per-token
call made on the mesh: the row group's maximum of each token's logits, the sum of its
exponentials over the row (in member order), the target's logit from the rank holding
its vocabulary block (the others add zeros), `log(sum) - (target - max)` as TensorFlow
computes it, and the [batch/q, sequence] losses put together over the column, so every
rank holds the [batch, sequence] per-token losses, not the logits. Backward: each rank's
block of `softmax - onehot`, times the per-token gradient of its rows."""

from typing import Any

import keras
import numpy as np
import tensorflow as tf

from ...engine import order as _order
from ... import _compat
from ..tensor.split import weights_of
from .base import ENTER
from .dense import MeshDense, summa
from .grid import is_block, mark, rows_of, sizes_of, whole_of
from .part import BLOCK, COLUMN

__all__ = ["MeshLogits", "eligible"]

_BIAS, _MAX, _SUM, _TARGET, _LOSSES = 15, 16, 17, 18, 19  # roles (`grid.mesh_tag`)


def eligible(model: Any, op: Any) -> bool:
    """Whether the compiled model takes the cross-entropy of `op`'s logits in a way
    the mesh can compute on vocabulary blocks (module docstring)."""
    fn = getattr(model, "loss", None)
    if (not isinstance(fn, keras.losses.SparseCategoricalCrossentropy)
            or type(fn).call is not keras.losses.SparseCategoricalCrossentropy.call
            or type(fn).__call__ is not keras.losses.Loss.__call__):
        return False
    options = getattr(fn, "_fn_kwargs", {})
    activation = getattr(op, "activation", None)
    return (options.get("from_logits") is True and options.get("ignore_class") is None
            and options.get("axis", -1) == -1
            and getattr(model, "_compile_metrics", None) is None
            and _compat.overrider(model, "compute_loss") is None
            and (activation is None or getattr(activation, "__name__", "") == "linear"))


class MeshLogits(MeshDense):
    name = "mesh-logits"
    what = None  # chosen by `choose` for an eligible head only

    def sums(self, rows, out_bytes, q):
        # The cross-entropy on the blocks: each token's maximum and sum of exponentials
        # over the row group, the target's logit, the per-token losses over the column.
        return [4 * rows / q] * 4, []

    def cuts(self, op):
        return [(op.kernel, BLOCK)] + ([(op.bias, COLUMN)] if op.bias is not None else [])

    def run(self, part, args, kwargs, training):
        if not training:  # evaluate, predict: the logits gathered whole
            return super().run(part, args, kwargs, training)
        op, mesh = part.op, part.coll
        x = args[0] if args else kwargs["inputs"]
        if not is_block(x):
            x = mesh.to_block(x, part.what, part.tag(ENTER))
        batch, _ = whole_of(x)
        x = tf.cast(x, op.compute_dtype)
        weights = weights_of(part)
        z = summa(mesh, x, weights[0], sizes_of(int(op.kernel.shape[0]), mesh.q), part)
        if op.bias is not None:
            z = z + mesh.shared(weights[1], mesh.column, part.what, part.tag(_BIAS))
        vocabulary = int(op.kernel.shape[-1])
        z = mark(z, batch, vocabulary)
        z._hyparflow_split_loss = lambda fn: _CrossEntropy(fn, part, z, vocabulary)
        return z


class _CrossEntropy(keras.losses.Loss):
    """`fn` (a SparseCategoricalCrossentropy from logits) on the head's logits block."""

    def __init__(self, fn, part, block, vocabulary):
        super().__init__(name=fn.name, reduction=fn.reduction, dtype=fn.dtype)
        self.part, self.block, self.vocabulary = part, block, vocabulary

    def call(self, y_true, y_pred):
        return per_token(self.part, self.block, tf.cast(y_true, tf.int32), self.vocabulary)


def per_token(part, z, labels, vocabulary):
    """The [batch, ...] cross-entropies of the logits whose block (i, j) is `z` (rows
    i, vocabulary block j) against the whole `labels`, on every rank."""
    mesh, q = part.coll, part.q
    i, j = mesh.coords
    widths = sizes_of(vocabulary, q)
    start = sum(widths[:j])
    batch = tf.shape(labels)[0]
    lo, hi = rows_of(batch, q, i)
    local = labels[lo:hi] - start
    mine = tf.logical_and(local >= 0, local < widths[j])

    def forward(block, target, rows):
        block, target, rows = block.numpy(), target.numpy(), int(rows)
        what = part.what
        highest = np.max(np.stack(mesh.exchange(block.max(-1), [block.shape[:-1]] * q, what,
                                                part.tag(_MAX), mesh.row())), 0)
        exps = np.exp(block - highest[..., None]).sum(-1)
        total = mesh.allsum(exps, mesh.row(), what, part.tag(_SUM))
        target = mesh.allsum(target, mesh.row(), what, part.tag(_TARGET))
        mine = (np.log(total) - (target - highest)).astype(block.dtype)
        shapes = [(b - a,) + mine.shape[1:] for a, b in (rows_of(rows, q, r) for r in range(q))]
        losses = np.concatenate(mesh.exchange(mine, shapes, what, part.tag(_LOSSES),
                                              mesh.column()), 0)
        return losses, highest.astype(block.dtype), total.astype(block.dtype)

    @_order.custom_gradient
    def op(z):
        # The target's logit where this rank holds it, zero elsewhere (the row sums it).
        picked = tf.where(mine, tf.gather(z, tf.clip_by_value(local, 0, widths[j] - 1),
                                          batch_dims=len(labels.shape)),
                          tf.zeros_like(z[..., 0]))
        losses, highest, total = _order.py_function(forward, [z, picked, batch],
                                                [z.dtype, z.dtype, z.dtype])
        losses.set_shape(labels.shape)

        def grad(dy):
            soft = tf.exp(z - highest[..., None]) / total[..., None]
            onehot = tf.one_hot(tf.where(mine, local, -1), widths[j], dtype=z.dtype)
            return (soft - onehot) * tf.cast(dy[lo:hi], z.dtype)[..., None]

        return losses, grad

    return op(z)
