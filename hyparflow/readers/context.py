"""What a dataset function is told: which replica's reader it builds, and how big a
batch that reader gives (tf.distribute's InputContext, with the epoch and seed)."""

import dataclasses

__all__ = ["InputContext", "per_replica"]


def per_replica(global_batch_size, num_replicas, replica):
    """Replica `replica`'s share of a global batch: the sizes np.array_split gives,
    the first replicas one more when the batch does not divide evenly."""
    base, extra = divmod(int(global_batch_size), num_replicas)
    return base + (1 if replica < extra else 0)


@dataclasses.dataclass(frozen=True)
class InputContext:
    """Passed to a dataset function `fn(ctx) -> tf.data.Dataset`, called once per epoch
    on the one rank of each replica that reads its data. The dataset it returns gives
    this replica's batches: `ctx.per_replica_batch_size` samples each (fewer in a last
    batch), for example by reading only this replica's files,
    `files[ctx.input_pipeline_id::ctx.num_input_pipelines]`. A global batch is the
    replicas' batches of one step put together, in replica order."""

    input_pipeline_id: int          # this replica's index, 0 .. num_input_pipelines - 1
    num_input_pipelines: int        # the number of replicas (of readers)
    global_batch_size: int
    epoch: int = 0
    seed: int = 0

    @property
    def replica(self):
        return self.input_pipeline_id

    @property
    def num_replicas(self):
        return self.num_input_pipelines

    @property
    def num_replicas_in_sync(self):
        return self.num_input_pipelines

    @property
    def per_replica_batch_size(self):
        return per_replica(self.global_batch_size, self.num_input_pipelines,
                           self.input_pipeline_id)

    def get_per_replica_batch_size(self, global_batch_size):
        """As tf.distribute.InputContext's: this replica's share of `global_batch_size`."""
        return per_replica(global_batch_size, self.num_input_pipelines,
                           self.input_pipeline_id)
