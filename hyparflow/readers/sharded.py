"""Each replica reads its own part of the data, once: a dataset function
`fn(ctx) -> tf.data.Dataset` (tf.distribute's `distribute_datasets_from_function`
idiom), or a whole `tf.data.Dataset` that reads files, whose files are dealt out to
the replicas (tf.data's FILE auto-shard) and whose global batches are cut to each
replica's share (`Dataset.rebatch`).

In each replica one rank reads (its first stage's first tensor rank) and hands each
batch to the replica's other ranks (the last stage's targets and weights, the tensor
ranks' inputs); middle stages decode nothing. Every step the replicas say how many
rows they read (one small allgather): a step's global batch is their batches put
together, in replica order; a replica whose part ended sits the step out (no rows),
and the epoch ends when every part has.
"""


from .._compat import adapters
from .arrays import prepare_data
from .context import InputContext, per_replica
from .streams import Failed, replay

__all__ = ["ShardedSource", "file_shards", "unseeded_order", "within_budget"]


def within_budget(dataset):
    """`dataset` decoding on a pool of this rank's threads: by default tf.data's pool
    has a thread per core in every rank, and the ranks of a node would oversubscribe
    its cores. A pool the user sized is kept."""
    import tensorflow as tf

    from .. import _env

    if dataset.options().threading.private_threadpool_size:
        return dataset
    options = tf.data.Options()
    options.threading.private_threadpool_size = _env.threads_per_rank()
    return dataset.with_options(options)


# The datasets that read files, which tf.data's FILE auto-shard deals out.
READERS = {"TFRecordDataset", "TFRecordDatasetV2", "TextLineDataset",
           "FixedLengthRecordDataset", "FixedLengthRecordDatasetV2", "ArrayRecordDataset"}


def reads_files(dataset):
    """Whether `dataset`'s graph has a file reader for FILE sharding to deal out."""
    graph = _graph(dataset)
    ops = {node.op for node in graph.node}
    ops |= {node.op for function in graph.library.function for node in function.node_def}
    return bool(ops & READERS)


def _graph(dataset):
    from tensorflow.core.framework import graph_pb2

    graph = graph_pb2.GraphDef()
    graph.ParseFromString(dataset._as_serialized_graph().numpy())
    return graph


def unseeded_order(dataset, before):
    """Whether a shuffle without a seed comes before a node of `before` ("read": a
    file reader, or a function that holds one; "shard"): each process would draw its
    own order there, and the replicas' parts would overlap and miss records."""
    graph = _graph(dataset)
    nodes = {n.name: n for n in graph.node}
    reading, grew = set(), True
    while grew:   # the functions that read, through the functions they call
        known = len(reading)
        reading |= {f.signature.name for f in graph.library.function if any(
            n.op in READERS or any(a.func.name in reading for a in n.attr.values())
            for n in f.node_def)}
        grew = len(reading) > known

    def inputs(node):
        names = (i.lstrip("^").split(":")[0] for i in node.input)
        return [nodes[n] for n in names if n in nodes]

    def target(node):
        if before == "shard":
            return node.op == "ShardDataset"
        return node.op in READERS or any(a.func.name in reading for a in node.attr.values())

    def unseeded(node):
        if not node.op.startswith("ShuffleDataset") and not node.op.startswith(
                "ShuffleAndRepeatDataset"):
            return False
        seeds = inputs(node)[2:4]
        return all(s.op == "Const" and list(s.attr["value"].tensor.int64_val) in ([], [0])
                   for s in seeds)

    for start in (n for n in graph.node if target(n)):
        seen, todo = set(), inputs(start)
        while todo:
            node = todo.pop()
            if node.name in seen:
                continue
            seen.add(node.name)
            if unseeded(node):
                return True
            todo += inputs(node)
    return False


UNSEEDED = ("shuffles its {what} without a seed (tf.data.Dataset.list_files shuffles by "
            "default) before {where}: each replica's reader would draw its own order, and "
            "the replicas' parts would overlap and miss records. Give the shuffle a seed "
            "(list_files(pattern, seed=...), shuffle(n, seed=...) or tf.random.set_seed), "
            "or list the files with shuffle=False and shuffle the records after reading.")


def file_shards(dataset, num_replicas):
    """(ctx -> replica r's dataset, the global batch): replica r's files of `dataset`,
    each batch cut to its share (as tf.distribute deals a dataset out); None where the
    dataset turned auto-sharding off (its options' auto_shard_policy OFF or DATA), or
    its batch size cannot be read off its batching (as tf.distribute needs it)."""
    import tensorflow as tf
    from tensorflow.python.data.experimental.ops import distribute
    from tensorflow.python.distribute import input_ops

    policy = dataset.options().experimental_distribute.auto_shard_policy
    if num_replicas == 1 or policy in (tf.data.experimental.AutoShardPolicy.OFF,
                                       tf.data.experimental.AutoShardPolicy.DATA):
        return None
    batch_size = int(distribute.compute_batch_size(dataset))
    if batch_size < num_replicas or not reads_files(dataset):
        return None
    if unseeded_order(dataset, "read"):
        raise ValueError("The dataset " + UNSEEDED.format(
            what="files", where=f"they are dealt to the {num_replicas} replicas"))
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.FILE

    def make(ctx):
        mine = input_ops.auto_shard_dataset(dataset.with_options(options), num_replicas,
                                            ctx.input_pipeline_id, num_replicas)
        return mine.rebatch(ctx.per_replica_batch_size)

    return make, batch_size


class ShardedSource:
    """Batches read per replica. `first_x`, `bind(graph)` and `sample` as a
    StreamSource's; `epoch(e)` yields (this replica's Data, its rows, the global rows)."""

    relative = True   # batch indices count from each batch's start
    local = True      # a rank holds its replica's rows only

    def __init__(self, comm, make, *, stages_x_tensor, batch_size, steps_per_epoch=None,
                 class_weight=None, need_y=True, seed=0, what="the dataset function",
                 service=None):
        import keras

        self.comm, self.make, self.what, self.service = comm, make, what, service
        self.batch_size, self.steps = batch_size, steps_per_epoch
        self.class_weight, self.need_y, self.seed = class_weight, need_y, seed
        rank = comm.rank
        self.num_replicas = comm.size // stages_x_tensor
        self.replica = rank // stages_x_tensor
        self.reader = rank % stages_x_tensor == 0
        self.group = comm.split(self.replica, rank)   # the reader is its rank 0
        self.graph, self.sample, self._pass, self._first = None, None, None, None
        self._ended = False
        self.global_rows = batch_size
        found = None
        if self.reader:
            try:
                # The first pass, kept: its first batch is the first step's too, so
                # that nothing is decoded twice.
                self._pass = self._batches(0)
                found = self._first = next(self._pass)
            except StopIteration:
                found = Failed(f"{what} gave replica {self.replica} no batch")
            except Exception as error:  # noqa: BLE001 - every rank must hear of it
                found = Failed(f"{type(error).__name__}: {error}")
        found = self.group.bcast_obj(found, 0)
        failures = [f for f in comm.allgather_obj(found if isinstance(found, Failed) else None)
                    if f is not None]
        if failures:
            self.close()
            raise ValueError(f"Reading the first batch of {what} failed: {failures[0].message}")
        self.first = found
        self.first_x = keras.utils.unpack_x_y_sample_weight(found)[0]

    def context(self, epoch):
        return InputContext(self.replica, self.num_replicas, self.batch_size, epoch, self.seed)

    def _dataset(self, epoch):
        import tensorflow as tf

        dataset = self.make(self.context(epoch))
        if not isinstance(dataset, tf.data.Dataset):
            raise TypeError(f"{self.what} must return a tf.data.Dataset. Received: "
                            f"{type(dataset).__name__}")
        if epoch == 0 and self.num_replicas > 1 and unseeded_order(dataset, "shard"):
            raise ValueError("The dataset function's dataset " + UNSEEDED.format(
                what="input", where="its shard(ctx.num_input_pipelines, ...)"))
        if self.service is not None:   # decoded by the service's workers, read here
            dataset = self.service.distribute(dataset, self.replica, epoch)
        return within_budget(dataset)

    def _batches(self, epoch):
        """A pass's numpy batches (a service's, each awaited a bounded time)."""
        batches = adapters.numpy_batches(self._dataset(epoch), self.class_weight)
        if self.service is None:
            return batches
        return self.service.bounded(batches, f"replica {self.replica}'s part of {self.what}")

    def _prepare(self, element, class_weight=None):
        import keras

        x, y, sw = keras.utils.unpack_x_y_sample_weight(element)
        data = prepare_data(self.graph, x, y, sw, class_weight, need_y=self.need_y)
        share = per_replica(self.batch_size, self.num_replicas, self.replica)
        if len(data) > share:
            raise ValueError(
                f"Replica {self.replica}'s batch from {self.what} holds {len(data)} samples, "
                f"more than its share of the global batch, {share} (batch_size="
                f"{self.batch_size} over {self.num_replicas} replicas). Batch the dataset by "
                "ctx.per_replica_batch_size.")
        return data

    def bind(self, graph):
        self.graph = graph
        self.sample = self._prepare(self.first, self.class_weight)
        return self.sample

    def _read(self, epoch):
        """The reader's next element, None at the end of a pass (an epoch, without
        `steps_per_epoch`; with it a pass goes on across epochs, as in model.fit)."""
        if self._first is not None:
            found, self._first = self._first, None
            return found
        if self._ended:
            return None   # this replica's part ended this epoch; the others go on
        if self._pass is None:
            self._pass = self._batches(epoch)
        try:
            return next(self._pass)
        except StopIteration:
            self._pass, self._ended = None, True
            return None

    def epoch(self, epoch, start=0):
        self._ended = False
        step = start
        if self.reader and start:
            replay(iter(lambda: self._read(epoch), None), start, self.what,
                   say=self.comm.rank == 0)
        while self.steps is None or step < self.steps:
            element = None
            if self.reader:
                try:
                    element = self._read(epoch)
                except Exception as error:  # noqa: BLE001 - every rank must hear of it
                    element = Failed(f"{type(error).__name__}: {error}")
            element = self.group.bcast_obj(element, 0)
            data, failed = None, None
            if isinstance(element, Failed):
                failed = element.message
            elif element is not None:
                try:
                    data = self._prepare(element)
                except (ValueError, TypeError) as error:
                    failed = str(error)
            rows = len(data) if data is not None else 0
            # Rows counted once per replica (by its reader); a failure by any rank.
            counts = self.comm.allgather_obj(failed or (rows if self.reader else 0))
            for r, c in enumerate(counts):
                if isinstance(c, str):
                    raise RuntimeError(f"Reading {self.what} failed on rank {r}: {c}")
            if not sum(counts):
                return
            step += 1
            yield (data if data is not None else self.sample), rows, sum(counts)

    def close(self):
        if self.group is not None:
            self.group.free()
            self.group = None
