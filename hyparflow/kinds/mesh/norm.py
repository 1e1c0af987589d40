"""LayerNormalization on the mesh: a block holds 1/q of each row's features, so the
mean and variance are sums over the row group (the ranks holding the row's other
feature blocks), made in one order on every rank; scale and offset are cut by
feature block like a bias (one copy per rank of a column, gradients summed over it)."""

from typing import Any, List, Optional, Tuple

import keras
import tensorflow as tf

from ..tensor.split import common_why_not, weights_of
from .base import ENTER, GATHER, MeshKind
from .grid import is_block, mark, whole_of
from .part import COLUMN, MeshPart

__all__ = ["MeshNorm"]

_MEAN, _MEAN_B, _VAR, _VAR_B, _GAMMA, _BETA = range(8, 14)


class MeshNorm(MeshKind):
    name = "mesh-norm"
    what = None  # chosen only inside a mesh region (`choose`)
    share = 1  # its scale and offset: cut over the columns, alike down a column

    def sums(self, rows: float, out_bytes: float, q: int) -> Tuple[List[float], List[float]]:
        # The mean's and the variance's row sums, a value per token of the rank's rows,
        # and their gradients back.
        return [4 * rows / q] * 2, [4 * rows / q] * 2

    def claims(self, op: Any) -> bool:
        return isinstance(op, keras.layers.LayerNormalization)

    def why_not(self, op: Any, q: int) -> Optional[str]:
        axis = list(op.axis) if isinstance(op.axis, (list, tuple)) else [op.axis]
        try:
            last = len(op.input.shape) - 1
        except (AttributeError, ValueError):  # called more than once: refused anyway
            last = -1
        if axis not in ([-1], [last]):
            return f"it normalises over axis {op.axis}, not the last (features) alone"
        if getattr(op, "rms_scaling", False):
            return "rms_scaling is not on the mesh yet"
        return common_why_not(op, [op])

    def cuts(self, op: Any) -> List[Tuple[Any, str]]:
        return [(v, COLUMN) for v in (op.gamma if op.scale else None,
                                       op.beta if op.center else None) if v is not None]

    def run(self, part: MeshPart, args: Any, kwargs: Any, training: Any) -> Any:
        op, mesh = part.op, part.coll
        x = args[0] if args else kwargs["inputs"]
        if not is_block(x):
            x = mesh.to_block(x, part.what, part.tag(ENTER))
        batch, features = whole_of(x)
        dtype = x.dtype
        x32 = tf.cast(x, tf.float32)  # as Keras: statistics in float32 at least
        total = mesh.group_sum(tf.reduce_sum(x32, -1, keepdims=True), mesh.row, part.what,
                               (part.tag(_MEAN), part.tag(_MEAN_B)))
        centred = x32 - total / features
        square = mesh.group_sum(tf.reduce_sum(centred * centred, -1, keepdims=True), mesh.row,
                                part.what, (part.tag(_VAR), part.tag(_VAR_B)))
        y = centred * tf.math.rsqrt(square / features + op.epsilon)
        weights = iter(weights_of(part))
        if op.scale:
            y = y * tf.cast(mesh.shared(next(weights), mesh.column, part.what,
                                        part.tag(_GAMMA)), tf.float32)
        if op.center:
            y = y + tf.cast(mesh.shared(next(weights), mesh.column, part.what,
                                        part.tag(_BETA)), tf.float32)
        y = mark(tf.cast(y, dtype), batch, features)
        return mesh.to_whole(y, part.what, part.tag(GATHER)) if part.split.gather else y
