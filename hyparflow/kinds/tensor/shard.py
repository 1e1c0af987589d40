"""One rank's part of a split layer (`Shard`): its own variables, sliced from the
layer's on the axes its kind cuts, and the layer's call with the kind's computation in
place. Generic over the kinds (`split.SplitKind`)."""

import contextlib
from typing import Any

import keras
import numpy as np

from ... import _compat
from .collectives import WEIGHTS, site_tag
from .split import split_sizes

__all__ = ["Shard", "part_variable"]


def _axis(cut):
    """(axis, entries per unit) of a cut: an int axis holds one entry per unit of the
    kind's `size`; (axis, n) holds n (grouped-query attention's query heads, cut by
    key/value groups)."""
    return cut if isinstance(cut, tuple) else (cut, 1)


def part_variable(var: Any, value: Any) -> Any:
    """A rank's part of layer variable `var` holding `value`, named as `var` (its
    optimizer slots then carry the names a checkpoint knows)."""
    prefix = var.path.rsplit("/", 1)[0] if "/" in var.path else ""
    with contextlib.ExitStack() as scopes:
        for name in prefix.split("/") if prefix else ():  # one scope per level
            scopes.enter_context(keras.name_scope(name))
        part = keras.Variable(value, dtype=var.dtype, trainable=True, name=var.name)
    if part.path != var.path:  # its optimizer state would not be found by name
        raise RuntimeError(
            f"hyparflow could not name this rank's part of {var.path!r} as the "
            f"variable (it got {part.path!r}); call hyparflow.fit outside any "
            "keras.name_scope.")
    return part


class Shard:
    """One rank's part of a split layer: its own variables (sliced from the layer's,
    named as the layer's so optimizer slots carry the same names) and the call.
    What is cut and how the part computes are its kind's (`SplitKind`); "inner" has a
    part of its own (`attention.Nested`)."""

    # Kind name -> SplitKind, filled in by `registry` (which imports this module): a
    # part made without a kind takes its split's.
    kinds: dict = {}

    def __init__(self, op, split, rank, shares, collectives, site=0, kind=None):
        """`site`: a number of this part's own among the model's split layers, the
        same on every rank (its collectives' tags, `site_tag`); `kind`: the split's
        `SplitKind` (the registry's)."""
        self.op, self.split, self.rank, self.site = op, split, rank, site
        self.coll = collectives
        self.kind = kind = kind if kind is not None else Shard.kinds[split.kind]
        self.sizes = split_sizes(kind.size(op), shares)
        self.start = sum(self.sizes[:rank])
        # (layer variable, axis it is cut on, or None when every rank keeps all of it;
        # an axis may be (axis, entries per unit): see `_axis`)
        cuts = kind.cuts(self)
        self.cuts = []
        for var, axis in cuts:
            if axis is None:
                self.cuts.append((var, var, None))
                continue
            self.cuts.append((var, part_variable(var, self._slice(var.numpy(), axis)), axis))
        self.what = f"layer {op.name!r}"
        self.part_of = {id(var): part for var, part, _ in self.cuts}

    def _slice(self, value, axis):
        axis, per = _axis(axis)
        index = [slice(None)] * value.ndim
        index[axis] = slice(self.start * per, (self.start + self.sizes[self.rank]) * per)
        return value[tuple(index)]

    @property
    def replaces(self):
        """{id(layer variable): the variable this rank trains in its place}."""
        return {id(var): shard for var, shard, _ in self.cuts}

    def load(self):
        """Take this rank's part of the layer's current weights."""
        for var, shard, axis in self.cuts:
            if axis is not None:
                shard.assign(self._slice(var.numpy(), axis))

    def slots(self, optimizer):
        """[(optimizer variable, axis)] for the optimizer state of this rank's parts (Keras names a slot after its variable's path, which a part shares
        with its layer variable)."""
        out = []
        for var, part, axis in self.cuts:
            if axis is None:
                continue
            prefix = part.path.replace("/", "_") + "_"
            out += [(slot, axis) for slot in optimizer.variables
                    if slot.name.startswith(prefix) and tuple(slot.shape) == tuple(part.shape)]
        return out

    def gathered(self, value, axis):
        """The whole of a variable cut on `axis`, from every rank's part `value`."""
        axis, per = _axis(axis)
        shapes = []
        for n in self.sizes:
            shape = list(value.shape)
            shape[axis] = n * per
            shapes.append(tuple(shape))
        return np.concatenate(self.coll.exchange(value, shapes, self.what,
                                                 self.tag(WEIGHTS)), axis=axis)

    def sliced(self, value, axis):
        """This rank's part of a whole value cut on `axis`."""
        return self._slice(value, axis)

    def gather(self):
        """Put the layer's variables back together from every rank's part, on every
        rank (collective over the tensor ranks)."""
        for var, shard, axis in self.cuts:
            if axis is not None:
                var.assign(self.gathered(shard.numpy(), axis))

    def tag(self, role):
        """The tag of this part's collective `role` (`collectives.site_tag`)."""
        return site_tag(self.site, role)

    def __call__(self, args, kwargs, training=None):
        """The layer's call with this rank's part in place of its `call`, through
        Keras's `Layer.__call__` as `model.fit` calls the whole layer: the Keras
        mask its output gets (or not), input casting and the rest are Keras's."""
        with _compat.calls_replaced(self.calls()):
            return _compat.call_operation(self.op, args, kwargs, training)

    def calls(self):
        """{layer: function run in place of its `call`} while the layer holding this
        part runs: the kind's (`SplitKind.calls`)."""
        return self.kind.calls(self)
