"""The readers: every input form `model.fit` takes, turned into global batches that
the loop asks for once per step.

  columns  an input read by the rows a batch needs, cast then (memmaps, h5py)
  arrays   arrays: checked, in the model's input order, cut into global batches
  streams  tf.data, keras.utils.PyDataset, generators: read on one rank, broadcast
"""

from .._compat.adapters import is_stream
from .arrays import (ArraySource, Data, check_finite, fit_order, prepare_data,
                     validation_split)
from .streams import StreamSource

__all__ = ["ArraySource", "Data", "StreamSource", "check_finite", "fit_order", "prepare_data",
           "validation_split", "is_stream", "open_source", "source"]


def open_source(comm, x, y, *, batch_size, sample_weight=None, class_weight=None,
                shuffle=False, seed=0, steps_per_epoch=None, need_y=True):
    """The reader of `x` before the model's graph is read: a StreamSource (its
    `first_x` builds the model), or None for arrays (read once the graph is known)."""
    if not is_stream(x):
        return None
    if y is not None or sample_weight is not None:
        kind = type(x).__name__
        raise ValueError(
            f"When `x` is a {kind} (read batch by batch), `y` and `sample_weight` must be "
            f"None: each element it gives is (x, y) or (x, y, sample_weight). Received: "
            f"y={'None' if y is None else type(y).__name__}, "
            f"sample_weight={'None' if sample_weight is None else type(sample_weight).__name__}")
    return StreamSource(comm, x, steps_per_epoch=steps_per_epoch, class_weight=class_weight,
                        shuffle=shuffle, need_y=need_y)


def source(graph, x, y, *, batch_size, sample_weight=None, class_weight=None, shuffle=False,
           seed=0, steps_per_epoch=None, need_y=True, stream=None):
    """The data source for `x`/`y`, and one prepared batch to size the stages from."""
    if stream is not None:
        return stream, stream.bind(graph)
    data = prepare_data(graph, x, y, sample_weight, class_weight, need_y=need_y)
    return ArraySource(data, batch_size, shuffle, seed, steps_per_epoch), data
