"""`fit` and `evaluate` for a model that overrides `train_step` (or `test_step`): at
S = 1, T = 1, M = 1 each replica runs the model's own step on its rows of every
global batch, and `engine.steps.ReplicaSums` makes the R steps one (docs/models.md,
"Customised training"). The loop is Keras's own: epochs, callbacks, History,
validation, as `model.fit` runs them."""

import itertools

import keras
import numpy as np
import tensorflow as tf

from .. import _compat
from .._compat import adapters as _adapters
from .. import sync as _sync
from ..engine import node as _node
from ..engine import weights as _weights
from ..engine.prepare import agree_on_error, check_positive, fail
from ..engine.steps import ReplicaSums, seed_generators_of
from .. import readers as _data
from ..readers.streams import broadcast
from .progress import callback_list, resolve_verbose

__all__ = ["overrides", "check_layout", "fit", "evaluate"]

# The seeds of replica r's random draws are its SeedGenerators' moved by r times this
# (replica 0 draws what one process would): each replica draws its own noise.
SEED_STRIDE = 1_000_003


def overrides(model, method):
    return _compat.overrider(model, method) is not None


def check_layout(model, layout, method):
    """Refuse a layout a model's own `method` cannot run on, naming the one it can."""
    counts = {"num_stages": layout.num_stages, "num_tensor": layout.num_tensor,
              "num_microbatches": layout.num_microbatches}
    wrong = {k: v for k, v in counts.items() if v != 1}
    if wrong:
        cls = _compat.overrider(model, method).__qualname__
        said = ", ".join(f"{k}={v}" for k, v in wrong.items())
        raise NotImplementedError(
            f"Model {model.name!r} overrides {method} (in {cls}), which hyparflow runs only "
            f"whole: each replica runs it on its rows of the global batch, at num_stages=1, "
            f"num_tensor=1, num_microbatches=1 and any num_replicas. Received {said}. Train "
            "it with num_stages=1, num_tensor=1, num_microbatches=1 (data parallel over "
            "the ranks), or move the custom loss into compute_loss(x, y, y_pred, "
            "sample_weight, training), which every layout runs.")


def _refuse_options(options):
    """fit's options the own-step loop does not take, each with its error."""
    given = {
        "checkpoint_dir": options.checkpoint_dir, "resume": options.resume or None,
        "replica_sync": _sync.resolve(options.replica_sync),
        "embedding_sharding": options.embedding_sharding, "class_weight": options.class_weight,
        "trace": options.trace, "recompute": options.recompute or None,
        "speeds": options.speeds, "memory_limit": options.memory_limit,
        "communication_dtype": options.communication_dtype}
    bad = sorted(k for k, v in given.items() if v is not None)
    if bad:
        raise NotImplementedError(
            f"{', '.join(bad)} with a model that overrides train_step: hyparflow runs the "
            "model's own step on each replica, with the gradients summed in its optimizers "
            "and nothing else of its own step. Leave them out, or move the custom loss into "
            "compute_loss(...) to train with hyparflow's step.")


class Batches:
    """numpy data (x, y, sample_weight in the structures `model.fit` takes) or a stream
    of global batches (a tf.data.Dataset, a keras.utils.PyDataset, a generator: read on
    rank 0 through Keras's own epoch iterator and broadcast), as each replica's rows of
    every global batch, packed as Keras hands them to `train_step`
    (`keras.utils.pack_x_y_sample_weight`)."""

    def __init__(self, x, y, sample_weight, *, batch_size, replicas, shuffle=False,
                 seed=None, steps=None):
        self.replicas, self.shuffle, self.seed = replicas, shuffle, seed
        self.stream = x if _data.is_stream(x) else None
        if self.stream is not None:
            if y is not None or sample_weight is not None:
                raise ValueError(
                    f"When `x` is a {type(x).__name__} (read batch by batch), `y` and "
                    "`sample_weight` must be None: each element it gives is (x, y) or "
                    "(x, y, sample_weight).")
            self.steps, self._asked = steps, steps
            self.reader, self._pending = None, None
            return
        self.data = keras.tree.map_structure(_numpy, (x, y, sample_weight))
        leaves = [a for a in keras.tree.flatten(self.data) if a is not None]
        if not leaves:
            raise ValueError("`x` is required. Received: x=None")
        self.n = len(leaves[0])
        lengths = {len(a) for a in leaves}
        if len(lengths) != 1:
            raise ValueError("`x`, `y` (and `sample_weight`) must have the same number of "
                             f"samples. Received lengths: {sorted(lengths)}")
        full = -(-self.n // batch_size)
        self.batch_size, self.steps = batch_size, min(full, steps) if steps else full
        last = self.n - (full - 1) * batch_size
        if min(batch_size, last) < replicas:
            raise ValueError(
                f"A global batch of {min(batch_size, last)} rows (batch_size={batch_size}, "
                f"{self.n} samples) leaves some of the {replicas} replicas without rows, and "
                "a train_step's mean over no rows is NaN. Use a batch_size whose last batch "
                f"holds at least {replicas} rows, or drop the last samples.")

    def _elements(self):
        """Rank 0's pass over the stream (Keras's epoch iterator: `steps_per_epoch`
        goes on across epochs, as in model.fit), made at its first element so that a
        failure to make it reaches every rank."""
        if self.reader is None:
            self.reader = _adapters.epoch_iterator(
                self.stream, steps_per_epoch=self._asked, shuffle=self.shuffle)
            self.reader.reset()   # as model.fit, once before the first epoch
        for _, _, buffer in self.reader:
            yield from buffer

    def _read(self, comm):
        """One epoch's global batches of the stream, read on rank 0 and broadcast
        (collective)."""
        for element in broadcast(comm, self._elements() if comm.rank == 0 else None):
            yield keras.tree.map_structure(_numpy, element)

    def first(self, comm):
        """This replica's rows of the first batch in the data's own order (to build the
        model from, drawing no shuffling from Keras's generator); a stream's is kept
        for the first step."""
        if self.stream is not None:
            elements = self._read(comm)
            head = next(elements, None)
            if head is None:
                raise ValueError(f"The {type(self.stream).__name__} gave no batch.")
            self._pending = itertools.chain([head], elements)
            self.steps = comm.bcast_obj(self.reader.num_batches if comm.rank == 0 else None, 0)
            return self._rows(head, comm.rank)[0]
        keep, self.shuffle = self.shuffle, False
        try:
            return next(iter(self.epoch(0, comm)))[0]
        finally:
            self.shuffle = keep

    def epoch(self, epoch, comm):
        """(this replica's rows, every replica's row count) of each step of `epoch`
        (the replica: `comm.rank`)."""
        r = comm.rank
        if self.stream is not None:
            pending, self._pending = self._pending, None
            for element in pending if pending is not None else self._read(comm):
                yield self._rows(element, r)
            return
        order = np.arange(self.n)
        if self.shuffle:
            order = (_data.fit_order(comm, self.n) if self.seed is None
                     else np.random.default_rng([self.seed, epoch]).permutation(self.n))
        for step in range(self.steps):
            batch = order[step * self.batch_size:(step + 1) * self.batch_size]
            parts = np.array_split(batch, self.replicas)   # as `executor.split_batch`
            x, y, sw = keras.tree.map_structure(
                lambda a: None if a is None else a[parts[r]], self.data)
            yield (_tensors(keras.utils.pack_x_y_sample_weight(x, y, sw)),
                   [len(p) for p in parts])

    def _rows(self, element, r):
        """Replica r's rows of a global batch, and every replica's row count."""
        total = len(keras.tree.flatten(element)[0])
        if total < self.replicas:
            raise ValueError(
                f"A batch of {total} rows from the {type(self.stream).__name__} leaves some "
                f"of the {self.replicas} replicas without rows. Batch it by at least "
                f"{self.replicas} (drop_remainder=True for the last batch).")
        sizes = [len(p) for p in np.array_split(np.arange(total), self.replicas)]
        lo, hi = sum(sizes[:r]), sum(sizes[:r + 1])
        mine = keras.tree.map_structure(lambda a: None if a is None else a[lo:hi], element)
        return _tensors(mine), sizes


def _numpy(value):
    """A leaf as numpy, floats in Keras's floatx as `model.fit`'s data adapter casts them."""
    if value is None:
        return None
    a = value.numpy() if hasattr(value, "numpy") else np.asarray(value)
    if a.dtype.kind == "f" and a.dtype != np.dtype(keras.config.floatx()):
        a = a.astype(keras.config.floatx())
    return a


def _tensors(data):
    return keras.tree.map_structure(
        lambda a: None if a is None else tf.convert_to_tensor(a), data)


def _python(logs):
    """The step's logs as Python numbers (as Keras hands them to callbacks)."""
    out = {}
    for k, v in (logs or {}).items():
        a = np.asarray(v)
        out[k] = float(a) if a.ndim == 0 else a
    return out


def _function(model, method, run_eagerly):
    step = getattr(model, method)
    eager = run_eagerly if run_eagerly is not None else bool(model.run_eagerly)
    # Never XLA: the replicas' sums are py_functions inside the step.
    return step if eager else tf.function(step, reduce_retracing=True)


def _epoch_logs(sums, model, last):
    """As Keras's `_get_metrics_result_or_logs`: the metrics' results (global) where
    their names are the step's, else the last step's logs."""
    metric_logs = _python(sums.global_results())
    return metric_logs if set(metric_logs) == set(last) else last


class _Seeds:
    """Replica r's SeedGenerators moved by r * SEED_STRIDE, and replica 0's states on
    every rank at the end (the model `fit` returns is the same everywhere)."""

    def __init__(self, model, comm):
        self.comm = comm
        self.gens = seed_generators_of(model) + [_compat.global_seed_generator()]
        for gen in self.gens:
            state = gen.state.numpy()
            moved = state.astype(np.int64)
            moved[0] = (moved[0] + comm.rank * SEED_STRIDE) % (2 ** 31)
            gen.state.assign(moved.astype(state.dtype))

    def close(self):
        _weights.broadcast(self.comm, [g.state for g in self.gens], 0)


def _build(model, method, data):
    """Trace the step once (creating the variables a subclassed model, and each
    optimizer, make at their first call; a traced function's variables outlive it), so
    that rank 0's weights can start every replica before the first update. Eager runs
    too: their first call would make the variables only inside the first step."""
    tf.function(getattr(model, method)).get_concrete_function(data)


def evaluate_rows(model, comm, sums, batches, fn, callbacks=None, per_step=False):
    """The own-step evaluation loop over `batches`; global logs."""
    model.reset_metrics()
    last = {}
    sums.active = True
    for step, (data, sizes) in enumerate(batches.epoch(0, comm)):
        if callbacks is not None:
            callbacks.on_test_batch_begin(step)
        sums.rows(sizes)
        last = _python(fn(data))
        if callbacks is not None and per_step:
            callbacks.on_test_batch_end(step, last)
    sums.active = False
    return _epoch_logs(sums, model, last)


def fit(model, x, y, *, comm, layout, options):
    """`hf.fit` of a model with its own `train_step`, for one rank (one replica)."""
    error, state = None, {}
    try:
        check_layout(model, layout, "train_step")
        _refuse_options(options)
        check_positive(batch_size=options.batch_size, epochs=options.epochs)
        if not _compat.is_compiled(model):
            raise ValueError(f"Model {model.name!r} is not compiled: call model.compile(...) "
                             "before hyparflow.fit, as before model.fit.")
        state["verbose"] = resolve_verbose(options.verbose)
        validation = options.validation_data
        if options.validation_split and validation is None:
            if _data.is_stream(x):
                raise ValueError(f"`validation_split` needs numpy inputs; with a "
                                 f"{type(x).__name__} pass `validation_data`.")
            (x, y, sw), validation = _data.validation_split(
                x, y, options.sample_weight, options.validation_split)
        else:
            sw = options.sample_weight
        state["batches"] = Batches(x, y, sw, batch_size=options.batch_size,
                                   replicas=comm.size, shuffle=options.shuffle,
                                   seed=options.seed, steps=options.steps_per_epoch)
        if validation is not None:
            vx, vy, vsw = keras.utils.unpack_x_y_sample_weight(validation) if isinstance(
                validation, (list, tuple)) else (validation, None, None)
            state["validation"] = Batches(
                vx, vy, vsw, batch_size=options.validation_batch_size or options.batch_size,
                replicas=comm.size, steps=options.validation_steps)
        freq = options.validation_freq
        state["val_epochs"] = ({e for e in range(options.epochs) if (e + 1) % freq == 0}
                               if isinstance(freq, int) else {int(e) - 1 for e in freq})
    except (ValueError, TypeError, NotImplementedError) as exc:
        error = exc
    agree_on_error(comm, error)
    _, line = _node.settle(comm, options.threads_per_rank)
    if state["verbose"] and comm.rank == 0:
        print(line, flush=True)
    with ReplicaSums(comm, model) as sums:
        try:
            return _train(model, comm, sums, state, options)
        except BaseException as exc:
            fail(comm, None, exc)
            raise


def _train(model, comm, sums, state, options):
    batches = state["batches"]
    train_fn = _function(model, "train_step", options.run_eagerly)
    test_fn = _function(model, "test_step", options.run_eagerly) if "validation" in state \
        else None
    sums.active = True
    _build(model, "train_step", batches.first(comm))
    sums.active = False
    _weights.broadcast(comm, model.weights, 0)
    seeds = _Seeds(model, comm)
    cbs, per_step = callback_list(model, comm, options.callbacks, state["verbose"],
                                  epochs=options.epochs, steps=batches.steps, add_history=True)
    model.stop_training = False
    cbs.on_train_begin()
    epoch_logs = {}
    for epoch in range(options.initial_epoch, options.epochs):
        model.reset_metrics()
        cbs.on_epoch_begin(epoch)
        last = {}
        for step, (data, sizes) in enumerate(batches.epoch(epoch, comm)):
            cbs.on_train_batch_begin(step)
            sums.rows(sizes)
            sums.active = True
            last = _python(train_fn(data))
            sums.active = False
            if per_step:
                cbs.on_train_batch_end(step, last)
                if comm.bcast_obj(bool(model.stop_training), 0):
                    model.stop_training = True
                    break
        epoch_logs = _epoch_logs(sums, model, last)
        if test_fn is not None and epoch in state["val_epochs"]:
            val = evaluate_rows(model, comm, sums, state["validation"], test_fn)
            epoch_logs.update({f"val_{k}": v for k, v in val.items()})
        cbs.on_epoch_end(epoch, epoch_logs)
        model.stop_training = comm.bcast_obj(bool(model.stop_training), 0)
        if model.stop_training:
            break
    if options.epochs > options.initial_epoch:
        model.optimizer.finalize_variable_values(model.trainable_weights)
    # Collective: never in a `finally` (a rank that failed mid-step must not wait in it).
    seeds.close()
    cbs.on_train_end(epoch_logs)
    return model.history


def evaluate(model, x, y, *, comm, layout, batch_size, sample_weight, steps, verbose,
             callbacks):
    """`hf.evaluate` of a model with its own `test_step`, for one rank (one replica):
    the global logs dict."""
    error, batches = None, None
    try:
        check_layout(model, layout, "test_step")
        check_positive(batch_size=batch_size)
        batches = Batches(x, y, sample_weight, batch_size=batch_size, replicas=comm.size,
                          steps=steps)
    except (ValueError, TypeError, NotImplementedError) as exc:
        error = exc
    agree_on_error(comm, error)
    verbose = resolve_verbose(verbose)
    with ReplicaSums(comm, model) as sums:
        try:
            fn = _function(model, "test_step", None)
            sums.active = True
            _build(model, "test_step", batches.first(comm))
            sums.active = False
            _weights.broadcast(comm, model.weights, 0)
            cbs, per_step = callback_list(model, comm, callbacks, verbose, epochs=1,
                                          steps=batches.steps)
            cbs.on_test_begin()
            logs = evaluate_rows(model, comm, sums, batches, fn, cbs, per_step)
            cbs.on_test_end(logs)
            return logs
        except BaseException as exc:
            fail(comm, None, exc)
            raise
