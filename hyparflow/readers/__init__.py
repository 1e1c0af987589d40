"""The readers: every input form `model.fit` takes, turned into global batches that
the loop asks for once per step.

  columns  an input read by the rows a batch needs, cast then (memmaps, h5py)
  arrays   arrays: checked, in the model's input order, cut into global batches
  streams  tf.data, keras.utils.PyDataset, generators: read on one rank, broadcast
  indexed  a PyDataset of known length, read by index, each batch by one replica's
           reader in turn
  context  InputContext: what a dataset function is told
  sharded  each replica reads its own part: a dataset function, or a tf.data.Dataset's
           files dealt out to the replicas
  wait     the time each step waits for its batch: History, the trace, a warning
  service  a tf.data service's workers decode each replica's part (or a whole dataset)
"""


import numpy as np

from .._compat.adapters import is_stream
from ..engine.executor import split_batch
from . import service
from .arrays import (ArraySource, Data, check_finite, fit_order, prepare_data,
                     validation_split)
from .context import InputContext
from .indexed import IndexedSource, indexable
from .sharded import ShardedSource, file_shards
from .streams import StreamSource
from .wait import Waits

__all__ = ["ArraySource", "Data", "StreamSource", "IndexedSource", "ShardedSource", "InputContext",
           "check_finite", "fit_order", "prepare_data", "validation_split", "is_stream",
           "is_function", "open_source", "source", "steps", "Waits", "service"]


def is_function(x):
    """A dataset function `fn(ctx) -> tf.data.Dataset`."""
    return callable(x) and not any(hasattr(x, a) for a in (
        "__iter__", "__next__", "__getitem__", "__array__"))


def open_source(comm, x, y, *, batch_size, sample_weight=None, class_weight=None,
                shuffle=False, seed=0, steps_per_epoch=None, need_y=True, layout=None,
                shard=True, service=None, validation=False, epoch=0):
    """The reader of `x` before the model's graph is read (collective): a ShardedSource
    for a dataset function, or a dataset whose files can be dealt to the replicas; a
    StreamSource for other streams; None for arrays (read once the graph is known).
    A source's `first_x` builds the model. `shard=False`: one rank reads a dataset
    whole (what hf.predict needs, to give the predictions in order). `service`: a
    readers.service.Service whose workers decode the datasets' parts, or None.
    `validation`: fit's validation data, read again for each run. `epoch`: the first
    to run."""
    function = is_function(x)
    if service is not None and not (function or _is_dataset(x)) and comm.rank == 0:
        print(f"hyparflow: data_service={service.address} decodes tf.data datasets and "
              f"dataset functions; the {type(x).__name__} is read in place.", flush=True)
    if not function and not is_stream(x):
        return None
    if service is not None and (function or _is_dataset(x)):
        service = service.bound(comm)   # collective: the run id, shared by every rank
    else:
        service = None
    if function and not shard:
        raise ValueError(
            "hf.predict gives the predictions in the order of `x`, and a dataset function "
            "reads per replica: pass the dataset itself (one rank reads it) or arrays.")
    if y is not None or sample_weight is not None:
        kind = "dataset function" if function else type(x).__name__
        raise ValueError(
            f"When `x` is a {kind} (read batch by batch), `y` and `sample_weight` must be "
            f"None: each element it gives is (x, y) or (x, y, sample_weight). Received: "
            f"y={'None' if y is None else type(y).__name__}, "
            f"sample_weight={'None' if sample_weight is None else type(sample_weight).__name__}")
    ranks = 1 if layout is None else layout.num_stages * layout.num_tensor
    replicas = comm.size // ranks
    dealt = (x, batch_size) if function else (
        file_shards(x, replicas) if shard and _is_dataset(x) else None)
    if dealt is not None:
        try:
            return ShardedSource(comm, dealt[0], stages_x_tensor=ranks, batch_size=dealt[1],
                                 steps_per_epoch=steps_per_epoch, class_weight=class_weight,
                                 need_y=need_y, seed=seed, service=service,
                                 what="the dataset function" if function else "the dataset")
        except ValueError as error:
            if function:
                raise
            if comm.rank == 0:
                print(f"hyparflow: the dataset's files cannot be dealt to the {replicas} "
                      f"replicas ({str(error).split(': ', 1)[-1][:160]}); rank 0 reads and "
                      "decodes every global batch and sends each replica its rows. For each "
                      "replica to read its own part, write at least as many files as "
                      "replicas, or pass a dataset function (hf.InputContext).", flush=True)
    elif function is False and shard and _is_dataset(x) and replicas > 1 and comm.rank == 0:
        print(f"hyparflow: the dataset reads no files to deal to the {replicas} replicas "
              "(or turned auto-sharding off): rank 0 reads and decodes every global batch "
              "and sends each replica its rows. For each replica to decode its own part, "
              "pass a dataset function (hf.InputContext).", flush=True)
    if steps_per_epoch is None and indexable(x):
        return IndexedSource(comm, x, stages_x_tensor=ranks, class_weight=class_weight,
                             shuffle=shuffle, need_y=need_y, resets=validation,
                             epoch=epoch)
    bounded = None
    if service is not None and comm.rank == 0:
        x = service.distribute(x)   # rank 0 reads it whole, from the service's workers
        bounded = lambda batches: service.bounded(batches, "the dataset")  # noqa: E731
    return StreamSource(comm, x, steps_per_epoch=steps_per_epoch, class_weight=class_weight,
                        shuffle=shuffle, need_y=need_y, bounded=bounded)


def _is_dataset(x):
    import tensorflow as tf

    return isinstance(x, tf.data.Dataset)


def steps(source, epoch, runtime, start=0):
    """(Data, this replica's microbatches, the global batch's rows) for each step of
    `epoch` from step `start`."""
    if getattr(source, "local", False):   # this replica's own rows, cut into microbatches
        for data, rows, total in source.epoch(epoch, start):
            yield data, split_batch(np.arange(rows), 1, runtime.layout.num_microbatches)[0], total
        return
    for data, batch in source.epoch(epoch, start):
        yield data, runtime.microbatches(batch), len(batch)


def source(graph, x, y, *, batch_size, sample_weight=None, class_weight=None, shuffle=False,
           seed=0, steps_per_epoch=None, need_y=True, stream=None):
    """The data source for `x`/`y`, and one prepared batch to size the stages from."""
    if stream is not None:
        return stream, stream.bind(graph)
    data = prepare_data(graph, x, y, sample_weight, class_weight, need_y=need_y)
    return ArraySource(data, batch_size, shuffle, seed, steps_per_epoch), data
