"""Data Keras reads batch by batch: a tf.data.Dataset, a keras.utils.PyDataset, a
Python generator or iterator (and a torch DataLoader or grain dataset).

One rank reads: rank 0 runs Keras's own adapter and EpochIterator, so epochs,
`steps_per_epoch` (an epoch goes on where the last one stopped), a PyDataset's
`workers`, `use_multiprocessing`, `max_queue_size` and `on_epoch_end`, and a
generator's end are what `model.fit` makes of them. Each element is one global
batch, broadcast to every rank; a generator, or a pipeline whose shuffle is not
seeded, cannot be read by two readers and give the same batches.
"""

import numpy as np

from .. import _compat
from .._compat import adapters
from .arrays import prepare_data

__all__ = ["StreamSource", "broadcast", "replay", "Failed"]


class _End:
    """The stream has no more batches this epoch."""


class Failed:
    """Reading failed on a reader: what it said (sent to the ranks it feeds)."""

    def __init__(self, message):
        self.message = message


def replay(elements, count, what, say=True):
    """Resuming mid-epoch: `count` elements read and dropped on a reader (a stream
    has no index to start from), said once."""
    if say:
            print(f"hyparflow: resuming mid-epoch, {what} is read again up to step {count} "
              f"(its {count} earlier batches decoded and dropped): a stream cannot start "
              "mid-way. A PyDataset of known length or arrays start there by index.",
              flush=True)
    for _ in range(count):
        if next(elements, None) is None:
            return


def broadcast(comm, elements):
    """Each of rank 0's `elements` (None on the other ranks), broadcast to every rank,
    until they end (collective). A failure to read ends every rank: rank 0 with its
    error, the others naming it."""
    while True:
        element = None
        if elements is not None:
            try:
                element = next(elements, _End())
            except Exception as error:  # noqa: BLE001 - every rank must hear of it
                comm.bcast_obj(Failed(f"{type(error).__name__}: {error}"), 0)
                raise
        element = comm.bcast_obj(element, 0)
        if isinstance(element, _End):
            return
        if isinstance(element, Failed):
            raise RuntimeError(f"Reading the data on rank 0 failed: {element.message}")
        yield element


class StreamSource:
    """Global batches of a stream, read on rank 0 and broadcast. `first_x` is the
    first batch's inputs (to read and build the model from), `bind(graph)` makes
    `sample`, the first batch prepared, and then `epoch(e)` yields (Data, indices)."""

    relative = True   # batch indices count from each batch's start

    def __init__(self, comm, x, *, steps_per_epoch=None, class_weight=None, shuffle=False,
                 need_y=True, bounded=None):
        import keras

        self.comm, self.class_weight, self.need_y = comm, class_weight, need_y
        self.kind = type(x).__name__
        # bounded(iterator): an iterator whose every wait is bounded (a data service's).
        self.bounded = bounded or (lambda batches: batches)
        self.reader, self.graph, self.sample = None, None, None
        found, self._held = None, None
        if comm.rank == 0:
            try:
                self.reader = adapters.epoch_iterator(
                    x, steps_per_epoch=steps_per_epoch, class_weight=class_weight,
                    shuffle=shuffle)
                self.reader.reset()   # as model.fit, once before the first epoch
                # The first epoch's pass, begun: its first batch sizes the stages and is
                # its first step's, so that nothing is decoded twice.
                elements = self._elements()
                first = next(elements)
                self._held = (first, elements)
                found = (_compat.tree.map_structure(np.asarray, first),
                         self.reader.num_batches)
            except StopIteration:
                found = ValueError(f"The {type(x).__name__} gave no batch.")
            except (ValueError, TypeError) as error:
                found = error
            except TimeoutError as error:   # a data service's worker that never answers
                found = ValueError(str(error))
        found = comm.bcast_obj(found, 0)
        if isinstance(found, BaseException):
            raise found
        self.first, self.steps = found
        self.first_x = keras.utils.unpack_x_y_sample_weight(self.first)[0]

    def _prepare(self, element, class_weight=None):
        import keras

        x, y, sw = keras.utils.unpack_x_y_sample_weight(element)
        return prepare_data(self.graph, x, y, sw, class_weight, need_y=self.need_y)

    def bind(self, graph):
        """Read the batches for `graph`; the first one prepared, to size the stages.
        Class weights are the adapter's on the read batches; here they only say that
        the sample has sample weights."""
        self.graph = graph
        self.sample = self._prepare(self.first, self.class_weight)
        return self.sample

    def _elements(self):
        for _, _, buffer in self.bounded(iter(self.reader)):
            yield from buffer

    def _begun(self):
        """The first epoch's pass with its first element put back, then new passes."""
        if self._held is not None:
            (first, rest), self._held = self._held, None
            yield first
            yield from rest
        else:
            yield from self._elements()

    def epoch(self, epoch, start=0):
        elements = self._begun() if self.reader is not None else None
        if elements is not None and start:
            replay(elements, start, f"the {self.kind}")
        for element in broadcast(self.comm, elements):
            data = self._prepare(element)
            yield data, np.arange(len(data))
