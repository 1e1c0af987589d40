"""A keras.utils.PyDataset of known length, read by index by the replicas' readers.

Step s of an epoch takes the PyDataset's batch `order[s]`, as `model.fit` does (the
order shuffled by Python's `random.shuffle` on rank 0 when `shuffle=True`). Replica
(s mod R)'s reader (its stage 0, tensor rank 0) reads it and broadcasts it, so each
batch is read and decoded once in the job and the decoding is spread over the R
readers. Each reader reads its own steps ahead: through the PyDataset's `workers`
(threads or processes, Keras's own enqueuer) or, with one worker, on a thread.

Every reader holds its own copy of the PyDataset (one per process) and calls its
`on_epoch_begin` / `on_epoch_end` as `model.fit` calls them, so a PyDataset that
reorders itself there must do so the same way in every process (a seeded generator).
Index arithmetic also resumes an epoch mid-way without reading its earlier batches.
"""

import queue
import random
import threading
import uuid

import numpy as np

from .. import _compat
from .arrays import prepare_data
from .streams import Failed

__all__ = ["IndexedSource", "indexable"]

_hooks_lock = threading.Lock()
_hooks_done: dict = {}   # a source's token -> the hook calls made in this process


def indexable(x):
    """A PyDataset whose batches can be read by index: a known number of them."""
    import keras

    if not isinstance(x, keras.utils.PyDataset):
        return False
    try:
        return x.num_batches is not None
    except NotImplementedError:
        return False


def _once(token, key, hook):
    """Call `hook` once per process for (`token`, `key`): ranks as threads of one
    process share one PyDataset, and each process's copy must see each hook once."""
    with _hooks_lock:
        done = _hooks_done.setdefault(token, set())
        if key not in done:
            done.add(key)
            hook()


class _View:
    """Batches `indices` of a PyDataset, as a PyDataset (for Keras's enqueuer)."""

    def __new__(cls, base, indices):
        import keras

        class View(keras.utils.PyDataset):
            def __init__(self):
                super().__init__(workers=base.workers,
                                 use_multiprocessing=base.use_multiprocessing,
                                 max_queue_size=base.max_queue_size)

            def __len__(self):
                return len(indices)

            def __getitem__(self, k):
                return base[int(indices[k])]

        return View()


def _ahead(iterator, depth=2):
    """`iterator`'s items read on a thread, up to `depth` ahead of the consumer."""
    items, stop = queue.Queue(depth), threading.Event()

    def fill():
        try:
            for item in iterator:
                while not stop.is_set():
                    try:
                        items.put((True, item), timeout=0.5)
                        break
                    except queue.Full:
                        pass
                if stop.is_set():
                    return
            items.put((False, None))
        except BaseException as error:  # noqa: BLE001 - raised again on the consumer
            items.put((False, error))

    thread = threading.Thread(target=fill, daemon=True, name="hyparflow-reader")
    thread.start()
    try:
        while True:
            more, item = items.get()
            if not more:
                if item is not None:
                    raise item
                return
            yield item
    finally:
        stop.set()


class IndexedSource:
    """A PyDataset read by index. `first_x`, `bind(graph)`, `sample` and `steps` as a
    StreamSource's; `epoch(e, start)` yields (Data, indices) for steps start.. ."""

    relative = True   # batch indices count from each batch's start

    def __init__(self, comm, dataset, *, stages_x_tensor, class_weight=None, shuffle=False,
                 need_y=True, resets=False, epoch=0):
        import keras
        from keras.src.trainers.data_adapters.py_dataset_adapter import PyDatasetAdapter

        self.comm, self.dataset = comm, dataset
        self.class_weight, self.shuffle, self.need_y = class_weight, shuffle, need_y
        self.steps = dataset.num_batches
        self.replicas = comm.size // stages_x_tensor
        self.roots = [r * stages_x_tensor for r in range(self.replicas)]
        self.mine = self.roots.index(comm.rank) if comm.rank in self.roots else None
        self.graph, self.sample, self._order, self._random = None, None, None, None
        self._adapter = PyDatasetAdapter(dataset, class_weight=class_weight)
        self._hooks = {"begin": 0, "end": 0}   # the passes whose hook this reader called
        self._open = False                       # a pass begun and not ended
        # Validation data: Keras's evaluate resets its epoch iterator (on_epoch_end)
        # before each run, and fit's validation reuses one.
        self._resets = resets
        # The same for the ranks of this read (and new for each fit, evaluate, predict);
        # gathered, so that every rank has come this far (built its model) before rank 0
        # draws from Python's random, which ranks as threads of one process share.
        self._token = comm.allgather_obj(uuid.uuid4().hex)[0]
        if self.mine is not None:
            _once(self._token, "reset", dataset.on_epoch_end)   # model.fit's reset()
        found = None
        try:
            # The first epoch's first batch, read by rank 0: it builds the model and is
            # the first step's, so nothing is decoded twice.
            order = self._draw(epoch)
            if comm.rank == 0:
                self._hook("begin")
                found = self._read(order[0])
        except Exception as error:  # noqa: BLE001 - every rank must hear of it
            found = Failed(f"{type(error).__name__}: {error}")
        found = comm.bcast_obj(found, 0)
        if isinstance(found, Failed):
            raise ValueError(f"Reading the first batch of the {type(dataset).__name__} "
                             f"failed: {found.message}")
        self.first = self._held = found
        self.first_x = keras.utils.unpack_x_y_sample_weight(found)[0]

    def _draw(self, epoch):
        """The epoch's order, drawn on rank 0 (as model.fit: Python's global random)."""
        if self._order is not None and self._order[0] == epoch:
            return self._order[1]
        order, state = None, None
        if self.comm.rank == 0:
            state = random.getstate()
            order = list(range(self.steps))
            if self.shuffle:
                random.shuffle(order)
        order, self._random = self.comm.bcast_obj((order, state), 0)
        self._order = (epoch, order)
        self._held = None   # the set-up's batch was the first of another draw
        return order

    def _hook(self, which):
        """The PyDataset's on_epoch_begin or on_epoch_end for this reader's next pass
        (an epoch, or a validation run), as Keras's epoch iterator calls them."""
        count = self._hooks[which]
        self._hooks[which] += 1
        self._open = which == "begin"
        _once(self._token, (which, count), getattr(self.dataset, f"on_epoch_{which}"))

    def _read(self, index):
        batch = self._adapter._standardize_batch(self.dataset[int(index)])
        return _compat.tree.map_structure(np.asarray, batch)

    def _mine(self, order, start):
        """This reader's batches of the epoch from step `start`, read ahead."""
        from keras.src.trainers.data_adapters.py_dataset_adapter import PyDatasetAdapter

        steps = [s for s in range(start, self.steps) if s % self.replicas == self.mine]
        if self._held is not None and steps and steps[0] == 0 and self.mine == 0:
            steps = steps[1:]   # the first batch, held since the set-up
        adapter = PyDatasetAdapter(_View(self.dataset, [order[s] for s in steps]),
                                   class_weight=self.class_weight)
        adapter.on_epoch_begin()
        try:
            batches = adapter.get_numpy_iterator()
            yield from (batches if adapter.enqueuer is not None else _ahead(batches))
        finally:
            adapter.on_epoch_end()

    def _prepare(self, element, class_weight=None):
        import keras

        x, y, sw = keras.utils.unpack_x_y_sample_weight(element)
        return prepare_data(self.graph, x, y, sw, class_weight, need_y=self.need_y)

    def bind(self, graph):
        self.graph = graph
        self.sample = self._prepare(self.first, self.class_weight)
        return self.sample

    def state(self, epoch_end=False):
        """What resuming needs (on rank 0): its random state before this epoch's order
        was drawn, or at an epoch's end, now (before the next one's)."""
        return {"random": random.getstate() if epoch_end else self._random}

    def restore(self, epoch, state):
        """Resume at `epoch`: the hooks of the epochs before it called again (their
        reads not), the order drawn from the recorded random state."""
        saved = (state or {}).get("random")
        if saved is not None and self.comm.rank == 0:
            version, internal, gauss = saved
            random.setstate((version, tuple(internal), gauss))
        self._order, self._held = None, None
        if epoch > 0 or saved is not None:
            self._draw(epoch)
        if self.mine is not None and epoch > 0:
            if self._open:
                self._hook("end")
            while self._hooks["begin"] < epoch:
                self._hook("begin")
                self._hook("end")

    def epoch(self, epoch, start=0):
        order = self._draw(epoch)
        mine = None
        if self.mine is not None:
            if not self._open:
                if self._resets and self._hooks["begin"]:
                    self._hook("end")
                self._hook("begin")
            mine = self._mine(order, start)
        try:
            for s in range(start, self.steps):
                root = self.roots[s % self.replicas]
                element = None
                if self.comm.rank == root:
                    try:
                        if s == 0 and self._held is not None:
                            element = self._held
                        else:
                            element = next(mine)
                    except Exception as error:  # noqa: BLE001 - every rank must hear of it
                        element = Failed(f"{type(error).__name__}: {error}")
                element = self.comm.bcast_obj(element, root)
                if isinstance(element, Failed):
                    raise RuntimeError(f"Reading batch {order[s]} of the "
                                       f"{type(self.dataset).__name__} failed on rank "
                                       f"{root}: {element.message}")
                data = self._prepare(element)
                yield data, np.arange(len(data))
            self._held = None
            if self.mine is not None:
                self._hook("end")
        finally:
            if mine is not None:
                mine.close()
        self._order = None

    def close(self):
        with _hooks_lock:
            _hooks_done.pop(self._token, None)
