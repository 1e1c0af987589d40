"""The lookups of a microbatch this replica does not have. A short last batch is cut
as for plain replicas (`engine.executor.split_batch`: `np.array_split` gives the
first replicas one sample more, and a replica may get fewer microbatches, or none),
but a replica's rows are every replica's to look up: a replica that lacks microbatch
i must still serve the others' lookups of it, and take their gradients for its rows.

`Idle` does that in the executor's place of the missing microbatch (`pad` gives the
replica as many microbatches as replica 0, the missing ones empty):

- `forward(i)`: every table's exchanges in graph order (the order the others' stage
  calls them in), with no ids of its own: empty messages out, the rows the others
  ask of it looked up from its part and sent back;
- `backward(i)`: the gradients of those rows from every rank, for every table at
  once (each rank's tape reaches the tables in an order of its own: posting all of
  them first means none waits on another), kept as microbatch i's (row, value)
  pairs of the part, as the gather of a microbatch of its own would have made them.

The owner's pairs are then those a replica with the microbatch would have had, so
the step is the one `model.fit` takes on the short batch."""

import numpy as np
import tensorflow as tf

from ...engine.comm import timeout_seconds, wait_all
from ...engine.wire import scaled
from .lookup import GRADS, packed_rows, unpack
from .rs import LayerTables

__all__ = ["Idle"]


class Idle:
    """Serves the lookups of the microbatches this rank lacks, for the parts of
    `tables` (a `Tables`) trained by `stage`, in a run of `replicas` x
    `microbatches`."""

    def __init__(self, tables, stage, replicas, microbatches, served=True):
        # `served`: with one stage and one tensor rank (tested so); in a pipeline or
        # with tensor ranks a short batch that leaves a replica short is refused.
        # A keras_rs DistributedEmbedding looks its tables up in an order of its own
        # (its features'), which this replica could not follow without its ids.
        self.served = served and not any(isinstance(s, LayerTables)
                                         for s in tables.shards.values())
        self.parts = list(tables.parts)  # graph order, as the stage calls them
        self.stage, self.replicas, self.microbatches = stage, replicas, microbatches
        where = {id(v): k for k, v in enumerate(stage.trainable)}
        self.positions = [where[id(part.variable)] for part in self.parts]
        self._served = {}  # microbatch -> [(requested rows, counts received)] per part

    def pad(self, micro, batch_size):
        """This replica's microbatches (index arrays), with empty ones up to replica
        0's count (`split_batch`: its slice has ceil(n / R) samples, cut in up to M)."""
        most = min(self.microbatches, -(-batch_size // self.replicas))
        least = min(self.microbatches, batch_size // self.replicas)
        if least < most and not self.served:
            # Every rank sees the same batch size: every rank raises.
            raise NotImplementedError(
                f"A batch of {batch_size} samples leaves some replica fewer than "
                f"{most} microbatches; with embedding_sharding in a pipeline, with tensor "
                "ranks or with a keras_rs DistributedEmbedding such a short batch is not "
                "supported yet (one stage and one tensor rank train it). Drop the last samples (a dataset: drop_remainder=True), or "
                "pick a batch_size whose batches give every replica as many microbatches.")
        return list(micro) + [np.zeros(0, np.int64)] * (most - len(micro))

    def serving(self, i):
        return i in self._served

    def forward(self, i, keep=True):
        """Microbatch i's lookups with no ids of this rank's (`keep`: its backward
        comes, with `backward(i)`)."""
        served = []
        for part in self.parts:
            lookup = part.lookup
            if part.pooling is not None:
                # A pooled lookup: the others' bags summed per sample here, one vector
                # each sent back; its gradient pairs are each row's sample's vector.
                bag = max(int(part.pooling.bag or 1), 1)
                requested, segments, count, theirs, mine, samples = lookup.pooled_route(
                    tf.zeros([0, bag], tf.int64), tf.zeros([0], tf.bool))
                pooled = tf.math.unsorted_segment_sum(
                    tf.gather(part.variable.value, requested), segments, count)
                lookup.pooled_back(pooled, tf.constant(theirs), tf.constant(mine),
                                   tf.constant(samples), tf.constant(0, tf.int64))
                served.append((requested, theirs, segments))
                continue
            requested, sent, recv, order = lookup.route(tf.zeros([0], tf.int64))
            rows = tf.gather(part.variable.value, requested)
            lookup.rows_back(rows, tf.constant(sent), tf.constant(recv), tf.constant(order))
            served.append((requested, recv, None))
        if keep:
            self._served[i] = served
        return served

    def backward(self, i):
        """The gradients of the rows microbatch i's lookups took from this rank."""
        served = self._served.pop(i)
        if self.stage.recompute:
            # The others' backward runs their forward again first, lookups included.
            served = self.forward(i, keep=False)
        router = self.parts[0].router
        comm = router.comm
        reqs, got = [], []
        for part, (_, recv, _) in zip(self.parts, served):
            lookup, dtype = part.lookup, np.dtype(part.variable.dtype)
            wire = router.wire or dtype
            blocks = []
            for p in range(comm.size):
                if p == comm.rank:  # no ids of its own: nothing from itself
                    blocks.append(np.zeros((0, lookup.width), wire))
                    continue
                rows = packed_rows(int(recv[p])) if scaled(router.wire) else int(recv[p])
                block = np.empty((rows, lookup.width), wire)
                reqs.append(comm.irecv(block, p, lookup.tag + GRADS))
                reqs.append(comm.isend(np.zeros((0, lookup.width), wire), p, lookup.tag + GRADS))
                blocks.append(block)
            got.append(blocks)
        wait_all(reqs, timeout_seconds(),
                 "the other ranks' gradients of the lookups of a microbatch this replica "
                 "has no sample of", comm.spin)
        stage = self.stage
        into, where = stage.sink if stage.sink is not None else (
            stage, range(len(stage.trainable)))
        for k, (requested, _, segments), blocks in zip(self.positions, served, got):
            if scaled(router.wire):  # float16 gradients come with their scale (`pack`)
                blocks = [unpack(b, np.float32) for b in blocks]
            values = np.concatenate(blocks).astype(np.float32)
            if segments is not None:  # pooled: a row's gradient is its sample's vector's
                values = values[np.asarray(segments, np.int64)]
            into.grads.keep(where[k], i, np.asarray(requested, np.int64), values)
