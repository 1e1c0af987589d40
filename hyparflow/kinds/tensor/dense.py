"""Dense, split by columns (each rank computes some output units, gathered), or as a
pair: a Dense whose output only the next Dense reads is split by columns and that
next one by rows (each rank multiplies its own slice of the hidden units and the
partial sums are added), so one sum serves both layers, as Megatron-LM pairs them."""

import keras
import tensorflow as tf

from .collectives import SUM
from .split import ByOutputs, Split, SplitKind, common_why_not, weights_of

__all__ = ["Column", "Row"]


class Column(ByOutputs):
    name = "column"
    what = "Dense"

    def claims(self, op):
        return isinstance(op, keras.layers.Dense)

    def why_not(self, op, num_tensor):
        reason = common_why_not(op, [op])
        if reason is None and op.units < num_tensor:
            return f"it has fewer units ({op.units}) than tensor ranks"
        return reason

    def splits(self, graph, i, context):
        """Columns, gathered; or columns and rows with the one Dense that alone reads
        this one's output (both chosen, in this stage)."""
        node = graph.nodes[i]
        out = node.outputs[0]
        users = context.consumers.get(out, [])
        partner = users[0] if len(users) == 1 else None
        if (partner is not None and partner in context.chosen and partner not in context.splits
                and out not in graph.outputs and partner in context.nodes
                and isinstance(graph.nodes[partner].op, keras.layers.Dense)
                and graph.nodes[partner].inputs == [out]):
            return {i: Split(i, "column", gather=False), partner: Split(partner, "row")}
        return {i: Split(i, "column")}

    def product(self, op):
        return keras.ops.matmul


class Row(SplitKind):
    """The second Dense of a pair (chosen by `Column.splits` only): its input arrives
    split (the partner's columns); the partial products are summed."""
    name = "row"

    def size(self, op):
        return int(op.kernel.shape[0])

    def cuts(self, shard):
        op = shard.op
        return [(op.kernel, 0)] + ([(op.bias, None)] if op.use_bias else [])

    def call(self, shard, x):
        op = shard.op
        x = tf.cast(x, op.compute_dtype) if x.dtype.is_floating else x
        weights = weights_of(shard)
        y = keras.ops.matmul(x, weights[0])
        y = shard.coll.sum(y, shard.what, tag=shard.tag(SUM))
        if op.use_bias:
            y = keras.ops.add(y, weights[1])
        return op.activation(y) if op.activation is not None else y

    def exchange(self, split, out_bytes, in_bytes, num_tensor, network):
        return network.exchange(out_bytes, num_tensor), 0.0  # a sum of whole outputs
