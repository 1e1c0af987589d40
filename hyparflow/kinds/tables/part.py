"""One rank's part of a sharded table (`TablePart`): the rows it owns, as a variable
of their own that the stage trains in the table's place, and the layer's call with
the sharded lookup in place of its `call`. It answers what the engine asks of a
tensor split's part (`kinds.tensor.shard.Shard`): `replaces`, `load`, `gather`,
`slots`, `gathered`, `sliced`, and a call."""

import numpy as np
import tensorflow as tf

from ... import _compat
from ..tensor.shard import part_variable
from .lookup import ColumnLookup, Lookup
from .pooled import reduce_as_embed_reduce

__all__ = ["TablePart"]


class TablePart:
    """Rank `rank`'s rows of Embedding `op` as `placement` (a `plan.Placement`) gives
    them: possibly none (a whole table placed on another rank); for "column", its
    columns of every row."""

    def __init__(self, op, placement, rank, router, site, pooling=None):
        self.op, self.placement, self.rank, self.router = op, placement, rank, router
        self.pooling = pooling  # a `pooled.Pooling`: the owners pool the bag (None: per id)
        self.column = placement.kind == "column"
        # Along the cut axis (rows, or columns for "column"): what each rank owns.
        self.sizes = list(placement.widths if self.column else placement.sizes)
        self.start = (placement.columns if self.column else placement.starts)[rank]
        table = op.embeddings
        # Named as the table, so Keras names its optimizer slots as the table's.
        self.variable = part_variable(table, self._slice(table.numpy(), 0))
        self.cuts = [(table, self.variable, 0)]
        self.what = f"layer {op.name!r}"
        self.lookup = (ColumnLookup if self.column else Lookup)(self, router, site)
        # While fit trains, the whole table's storage is dropped (`whole.empty`).
        self.emptied = False
        # The layer knows its part while it trains (what a rank holds can be asked).
        op.__dict__["_hyparflow_table_part"] = self

    @property
    def replaces(self):
        return {id(self.op.embeddings): self.variable}

    @property
    def nbytes(self):
        """The bytes of the rows this rank trains."""
        return int(np.prod(self.variable.shape)) * np.dtype(self.variable.dtype).itemsize

    def _slice(self, value, axis):
        end = self.start + self.sizes[self.rank]
        return value[:, self.start:end] if self.column else value[self.start:end]

    def sliced(self, value, axis):
        return self._slice(value, axis)

    def load(self):
        """Take this rank's rows of the table's current weights."""
        self.variable.assign(self._slice(self.op.embeddings.numpy(), 0))

    def gathered(self, value, axis):
        """The whole table (or a slot shaped like it) from every rank's rows (or
        columns: sent transposed, so the cut axis is first)."""
        size = self.router.comm.size
        value = np.asarray(value)
        if self.column:
            value = value.T
        blocks = [value] * size
        # The counters are the lookups' bytes: not these.
        counted = self.router.bytes, self.router.payload
        got = self.router.alltoall(blocks, self.sizes, tuple(value.shape[1:]), value.dtype,
                                   _WEIGHTS_TAG, f"rows of {self.what}")
        self.router.bytes, self.router.payload = counted
        whole = np.concatenate(got, axis=0)
        return np.ascontiguousarray(whole.T) if self.column else whole

    def gather(self):
        """Put the table back together on every rank (collective over the ranks); not
        while fit trains with the whole table dropped (`whole.fill` then, at its end)."""
        if self.emptied:
            return
        table = self.op.embeddings
        table.assign(self.gathered(self.variable.numpy(), 0))

    def slots(self, optimizer):
        """[(optimizer variable, axis)] of the optimizer state of this rank's rows."""
        prefix = self.variable.path.replace("/", "_") + "_"
        return [(slot, 0) for slot in optimizer.variables
                if slot.name.startswith(prefix) and tuple(slot.shape) == tuple(self.variable.shape)]

    def replacement(self):
        """What runs in place of the layer's `call`: the sharded lookup (pooled by
        the owners when the layer pools itself: EmbedReduce's combiner)."""
        op, pooling = self.op, self.pooling

        def call(inputs, *_, **__):
            inputs = _ids(inputs)
            if pooling is not None:
                return reduce_as_embed_reduce(self.lookup.pooled(inputs), inputs,
                                              pooling.combiner)
            return tf.cast(self.lookup(inputs), op.compute_dtype)

        return call

    def __call__(self, args, kwargs, training=None):
        """The layer's call through Keras's `Layer.__call__` (its mask, casting and
        errors are Keras's), with the sharded lookup in place of `Embedding.call`.
        Pooled by a later call (`pooling.node`): the owners' sums per sample, for
        that call (`pooled.PoolTaken`) only, without Keras's call (whose mask and
        shape are of the rows, which nobody gets)."""
        pooling = self.pooling
        if pooling is not None and pooling.node is not None:
            ids = _ids(args[0])
            return self.lookup.pooled(ids, tf.not_equal(ids, 0) if pooling.masked else None)
        with _compat.calls_replaced({self.op: self.replacement()}):
            return _compat.call_operation(self.op, args, kwargs, training)


def _ids(inputs):
    inputs = tf.convert_to_tensor(inputs)
    return inputs if inputs.dtype in (tf.int32, tf.int64) else tf.cast(inputs, tf.int32)


_WEIGHTS_TAG = 7  # gathers of whole tables and slots, between steps (never inside one)
