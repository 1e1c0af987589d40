"""Embedding, split by rows: each rank owns a range of ids; the lookups are summed."""

import keras
import tensorflow as tf

from .collectives import SUM
from .split import SplitKind, common_why_not

__all__ = ["Rows"]


class Rows(SplitKind):
    name = "rows"
    what = "Embedding"

    def claims(self, op):
        return isinstance(op, keras.layers.Embedding)

    def why_not(self, op, num_tensor):
        reason = common_why_not(op, [op])
        if reason is not None:
            return reason
        if op.mask_zero:
            return "it has mask_zero=True"
        if op.input_dim < num_tensor:
            return f"it has fewer rows ({op.input_dim}) than tensor ranks"
        return None

    def size(self, op):
        return op.input_dim

    def cuts(self, shard):
        return [(shard.op.embeddings, 0)]

    def call(self, shard, ids):
        op = shard.op
        if ids.dtype not in (tf.int32, tf.int64):
            ids = tf.cast(ids, tf.int32)
        table = shard.cuts[0][1].value
        local = tf.reshape(ids - tf.cast(shard.start, ids.dtype), [-1])
        mine = tf.logical_and(local >= 0, local < shard.sizes[shard.rank])
        # Only this rank's ids are looked up, in the batch's order: the part's gradient
        # holds the (row, value) pairs one process gives these rows and no zero pairs
        # for other ranks' ids, so the pairs gathered over replicas (hyparflow.sparse)
        # shrink with T. Other ranks' ids give zero rows to the sum.
        where = tf.where(mine)
        rows = tf.gather(table, tf.gather_nd(local, where))
        rows = tf.scatter_nd(where, rows, tf.stack([tf.size(local, out_type=tf.int64),
                                                    tf.cast(table.shape[-1], tf.int64)]))
        rows = tf.reshape(rows, tf.concat([tf.shape(ids), [table.shape[-1]]], 0))
        return tf.cast(shard.coll.sum(rows, shard.what, tag=shard.tag(SUM)), op.compute_dtype)

    def exchange(self, split, out_bytes, in_bytes, num_tensor, network):
        return network.exchange(out_bytes, num_tensor), 0.0  # the lookups summed
