"""Training data: numpy arrays or a batched tf.data.Dataset, as global batches of indices."""

import math

import numpy as np

from ..engine.prepare import is_dataset

__all__ = ["Data", "prepare_data", "fit_order", "ArraySource", "DatasetSource", "source", "validation_split",
           "check_finite", "is_dataset"]


class Data:
    """Inputs as a flat list in the model's input order, targets (or None) as a flat
    list in its output order, sample weights (or None) as a list of arrays of any
    shape `model.fit` takes (per sample, per token, ...): one for every output, or
    with `per_output` one per output in its order; numpy, sliced by index."""

    def __init__(self, x, y, sample_weight, per_output=False):
        self.x, self.y, self.sample_weight = x, y, sample_weight
        self.per_output = per_output

    def __len__(self):
        return len(self.x[0])


def _leaves(value, names, what):
    if isinstance(value, dict):
        missing = [n for n in names if n not in value]
        if missing:
            kind = "input" if what == "x" else "output"
            raise ValueError(
                f"`{what}` is a dict but has no entry for {missing}; its keys must be the "
                f"model's {kind} names {names}. Received keys: {sorted(value)}"
            )
        return [value[n] for n in names]
    if isinstance(value, (list, tuple)):
        return list(value)
    return [value]


def _numpy(value):
    return value.numpy() if hasattr(value, "numpy") else np.asarray(value)


def prepare_data(graph, x, y, sample_weight=None, class_weight=None, need_y=True):
    """Check and normalise user data (numpy arrays, lists or dicts of them)."""
    if x is None:
        raise ValueError("`x` is required. Received: x=None")
    xs = [_numpy(a) for a in _leaves(x, graph.input_names, "x")]
    if graph.functional is not None and len(xs) != len(graph.inputs):
        raise ValueError(
            f"The model has {len(graph.inputs)} inputs {graph.input_names} but `x` holds "
            f"{len(xs)} arrays. Pass one array per input (a list, or a dict by input name)."
        )
    if graph.functional is not None:
        xs = [a.astype(graph.tensors[t].dtype, copy=False) if graph.tensors[t].dtype != "bfloat16" else a
              for a, t in zip(xs, graph.inputs)]
    lengths = {f"x[{i}]": len(a) for i, a in enumerate(xs)}
    ys = None
    if y is None and need_y:
        raise ValueError("`y` is required (targets for the compiled loss). Received: y=None")
    if y is not None:
        ys = [_numpy(a) for a in _leaves(y, graph.output_names, "y")]
        if graph.functional is not None and len(ys) != len(graph.outputs):
            raise ValueError(
                f"The model has {len(graph.outputs)} outputs {graph.output_names} but `y` holds "
                f"{len(ys)} arrays. Pass one target array per output (a list, or a dict by output name)."
            )
        lengths.update({f"y[{i}]": len(a) for i, a in enumerate(ys)})
    sw, per_output = None, False
    if class_weight is not None:
        if ys is None or len(ys) != 1:
            raise ValueError("`class_weight` is only supported for models with one output; "
                             "use `sample_weight` for several outputs.")
        labels = ys[0]
        labels = labels.argmax(-1) if labels.ndim > 1 and labels.shape[-1] > 1 else labels.reshape(len(labels), -1)[:, 0]
        sw = [np.array([class_weight.get(int(c), 1.0) for c in labels], np.float32)]
    if sample_weight is not None:
        given, per_output = _sample_weights(graph, sample_weight, ys)
        lengths.update({("sample_weight" if len(given) == 1 and not per_output
                         else f"sample_weight[{k}]"): len(a) for k, a in enumerate(given)})
        # With class weights too (one output): each sample's class weight times its
        # weights, whatever their shape.
        sw = given if sw is None else [given[0] * sw[0].reshape(
            (-1,) + (1,) * (given[0].ndim - 1))]
    if len(set(lengths.values())) != 1:
        raise ValueError(
            "`x`, `y` (and `sample_weight`) must have the same number of samples. "
            f"Received lengths: {lengths}"
        )
    if len(xs[0]) == 0:
        raise ValueError("No samples: `x` is empty.")
    return Data(xs, ys, sw, per_output)


def _sample_weights(graph, sample_weight, ys):
    """(arrays, per_output): one array for every output, or a list or dict (by output
    name) of one per output, as `model.fit` takes them. An array keeps its shape: a
    weight per sample ([batch]) or per token ([batch, sequence]) reaches the loss as
    given, and the loss broadcasts it as in `model.fit`."""
    if isinstance(sample_weight, (list, tuple, dict)):
        leaves = _leaves(sample_weight, graph.output_names, "sample_weight")
        if ys is not None and len(leaves) != len(ys):
            raise ValueError(
                f"`sample_weight` holds {len(leaves)} arrays but the model has {len(ys)} "
                f"outputs {graph.output_names}: pass one array for all outputs, or one per "
                "output (a list, or a dict by output name).")
        if len(leaves) == 1:
            return [_numpy(leaves[0]).astype(np.float32)], False
        return [_numpy(a).astype(np.float32) for a in leaves], True
    array = _numpy(sample_weight).astype(np.float32)
    if array.ndim == 0:
        raise ValueError(f"`sample_weight` must have one value per sample (an array whose "
                         f"first dimension is the samples). Received a scalar: {array!r}")
    return [array], False


def check_finite(data):
    """Refuse inputs or targets with NaN or infinity: they would silently poison
    the weights. Names the array and the first bad sample."""
    arrays = [(f"x[{i}]", a) for i, a in enumerate(data.x)]
    arrays += [(f"y[{i}]", a) for i, a in enumerate(data.y or [])]
    arrays += [(f"sample_weight[{k}]" if len(data.sample_weight) > 1 else "sample_weight", a)
               for k, a in enumerate(data.sample_weight or [])]
    for name, a in arrays:
        if a.dtype.kind == "f" and not np.isfinite(a).all():
            bad = np.argwhere(~np.isfinite(a.reshape(len(a), -1)))[0][0]
            raise ValueError(
                f"{name} has NaN or infinite values (first at sample {bad}). Clean the data, or "
                "pass check_finite=False to train anyway (keras.callbacks.TerminateOnNaN then "
                "stops when the loss turns NaN).")


def validation_split(x, y, sample_weight, fraction):
    """The last `fraction` of the samples, before any shuffling, as Keras takes it."""
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"`validation_split` must be in (0, 1). Received: validation_split={fraction}")

    def cut(value, lo, hi):
        if value is None:
            return None
        if isinstance(value, dict):
            return {k: np.asarray(v)[lo:hi] for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [np.asarray(v)[lo:hi] for v in value]
        return np.asarray(value)[lo:hi]

    first = x if not isinstance(x, (dict, list, tuple)) else (
        next(iter(x.values())) if isinstance(x, dict) else x[0])
    n = len(first)
    split = int(n * (1.0 - fraction))
    train = (cut(x, 0, split), cut(y, 0, split), cut(sample_weight, 0, split))
    val = (cut(x, split, n), cut(y, split, n), cut(sample_weight, split, n))
    return train, val


def fit_order(comm, num_samples):
    """The order `model.fit(shuffle=True)` would take `num_samples` samples in this
    epoch (Keras's own shuffling, which `keras.utils.set_random_seed` makes repeatable),
    drawn on rank 0 and broadcast (collective), so the ranks agree even unseeded."""
    from .. import _compat

    order = _compat.fit_shuffle_order(num_samples) if comm.rank == 0 else \
        np.empty(num_samples, np.int64)
    return comm.bcast(order, 0)


class ArraySource:
    """Numpy data: each epoch a permutation (or the natural order), cut into global batches.
    The permutation is `order(epoch)` when set (model.fit's, `fit_order`), else drawn
    from `seed` and the epoch."""

    def __init__(self, data, batch_size, shuffle=False, seed=0, steps_per_epoch=None):
        self.data, self.batch_size, self.shuffle, self.seed = data, batch_size, shuffle, seed
        self.order = None
        full = math.ceil(len(data) / batch_size)
        self.steps = min(full, steps_per_epoch) if steps_per_epoch else full

    def epoch(self, epoch):
        n = len(self.data)
        if not self.shuffle:
            order = np.arange(n)
        elif self.order is not None:
            order = self.order(epoch)
        else:
            order = np.random.default_rng([self.seed, epoch]).permutation(n)
        for step in range(self.steps):
            yield self.data, order[step * self.batch_size:(step + 1) * self.batch_size]


class DatasetSource:
    """A batched tf.data.Dataset: each element is one global batch.

    Every rank iterates the same dataset (so its shuffling must be seeded) and
    keeps only the current batch; each stage then takes just the slices its
    replica needs. `steps_per_epoch` limits an epoch; without it an epoch ends
    when the dataset does."""

    def __init__(self, dataset, graph, steps_per_epoch=None, class_weight=None, need_y=True):
        self.dataset, self.graph, self.class_weight, self.need_y = dataset, graph, class_weight, need_y
        cardinality = int(dataset.cardinality())
        known = cardinality if cardinality >= 0 else None
        self.steps = steps_per_epoch or known
        if steps_per_epoch and known is not None:
            self.steps = min(steps_per_epoch, known)

    def first(self):
        return self._prepare(next(iter(self.dataset)))

    def _prepare(self, element):
        import keras

        x, y, sw = keras.utils.unpack_x_y_sample_weight(element)
        return prepare_data(self.graph, x, y, sw, self.class_weight, need_y=self.need_y)

    def epoch(self, epoch):
        dataset = self.dataset.take(self.steps) if self.steps else self.dataset
        for element in dataset:
            data = self._prepare(element)
            yield data, np.arange(len(data))


def source(graph, x, y, *, batch_size, sample_weight=None, class_weight=None, shuffle=False,
           seed=0, steps_per_epoch=None, need_y=True):
    """The data source for `x`/`y`, and one prepared batch to size the stages from."""
    if is_dataset(x):
        if y is not None:
            raise ValueError("When `x` is a tf.data.Dataset, `y` must be None: the dataset "
                             "yields (x, y) or (x, y, sample_weight).")
        src = DatasetSource(x, graph, steps_per_epoch, class_weight, need_y)
        return src, src.first()
    data = prepare_data(graph, x, y, sample_weight, class_weight, need_y=need_y)
    return ArraySource(data, batch_size, shuffle, seed, steps_per_epoch), data
