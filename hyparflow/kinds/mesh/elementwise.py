"""Layers that act on each entry alone (activations, residual adds, products) run on
the blocks as they are: a mesh region stays partitioned through them. An input that
arrives whole (a residual from before the region) is cut to this rank's block first
(its gradient gathered back whole)."""

from typing import Any, List

import keras
import tensorflow as tf

from ... import _compat
from .base import ENTER, GATHER, MeshKind, elementwise
from .grid import is_block, mark, whole_of

__all__ = ["MeshMap"]

_MERGES = (keras.layers.Add, keras.layers.Subtract, keras.layers.Multiply,
           keras.layers.Average, keras.layers.Maximum, keras.layers.Minimum)
_ACTIVATIONS = (keras.layers.ReLU, keras.layers.LeakyReLU, keras.layers.ELU)


class MeshMap(MeshKind):
    name = "mesh-map"
    what = None  # chosen only inside a mesh region (`registry.choose`)

    def claims(self, op: Any) -> bool:
        if isinstance(op, keras.layers.Activation):
            return elementwise(op.activation)
        return isinstance(op, _MERGES + _ACTIVATIONS + (keras.layers.Identity,))

    def run(self, part: Any, args: Any, kwargs: Any, training: Any) -> Any:
        mesh: Any = part.coll
        entered: List[int] = [0]

        def block(x: Any) -> Any:
            if not tf.is_tensor(x) or is_block(x):
                return x
            entered[0] += 1
            return mesh.to_block(x, part.what, part.tag(ENTER + entered[0]))

        args = _compat.tree.map_structure(block, args)
        batch, features = whole_of(next(x for x in tf.nest.flatten(args) if is_block(x)))
        out = mark(_compat.call_operation(part.op, args, kwargs, training), batch, features)
        return mesh.to_whole(out, part.what, part.tag(GATHER)) if part.split.gather else out
