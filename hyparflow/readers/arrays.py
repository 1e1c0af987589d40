"""Arrays in memory or read by rows (memmaps, h5py datasets): checked, put in the
model's input order, and cut into global batches of indices."""

import math

import numpy as np

from .columns import as_array, chunks, column

__all__ = ["Data", "prepare_data", "fit_order", "ArraySource", "validation_split",
           "check_finite"]


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


def prepare_data(graph, x, y, sample_weight=None, class_weight=None, need_y=True):
    """Check and normalise user data (numpy arrays, lists or dicts of them)."""
    if x is None:
        raise ValueError("`x` is required. Received: x=None")
    xs = [as_array(a) for a in _leaves(x, graph.input_names, "x")]
    if graph.functional is not None and len(xs) != len(graph.inputs):
        raise ValueError(
            f"The model has {len(graph.inputs)} inputs {graph.input_names} but `x` holds "
            f"{len(xs)} arrays. Pass one array per input (a list, or a dict by input name)."
        )
    if len(xs) == len(graph.inputs):
        xs = [column(a, graph.tensors[t].dtype, name)
              for a, t, name in zip(xs, graph.inputs, graph.input_names)]
    lengths = {f"x[{i}]": len(a) for i, a in enumerate(xs)}
    ys = None
    if y is None and need_y:
        raise ValueError("`y` is required (targets for the compiled loss). Received: y=None")
    if y is not None:
        ys = [as_array(a) for a in _leaves(y, graph.output_names, "y")]
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
        labels = np.asarray(ys[0])
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
            return [np.asarray(as_array(leaves[0]), np.float32)], False
        return [np.asarray(as_array(a), np.float32) for a in leaves], True
    array = np.asarray(as_array(sample_weight), np.float32)
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
        if np.dtype(getattr(a, "array", a).dtype).kind != "f":
            continue   # whole numbers (cast to floats or not) are always finite
        seen = 0
        for piece in chunks(a):   # an array read by rows is scanned in pieces
            piece = np.asarray(piece)
            bad = ~np.isfinite(piece.reshape(len(piece), -1))
            if bad.any():
                raise ValueError(
                    f"{name} has NaN or infinite values (first at sample "
                    f"{seen + int(np.argwhere(bad)[0][0])}). Clean the data, or pass "
                    "check_finite=False to train anyway (keras.callbacks.TerminateOnNaN then "
                    "stops when the loss turns NaN).")
            seen += len(piece)


def validation_split(x, y, sample_weight, fraction):
    """The last `fraction` of the samples, before any shuffling, as Keras takes it."""
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"`validation_split` must be in (0, 1). Received: validation_split={fraction}")

    def cut(value, lo, hi):
        if value is None:
            return None
        if isinstance(value, dict):
            return {k: as_array(v)[lo:hi] for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [as_array(v)[lo:hi] for v in value]
        return as_array(value)[lo:hi]

    first = x if not isinstance(x, (dict, list, tuple)) else (
        next(iter(x.values())) if isinstance(x, dict) else x[0])
    n = len(as_array(first))
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

    relative = False   # batch indices are positions in the whole data

    def __init__(self, data, batch_size, shuffle=False, seed=0, steps_per_epoch=None):
        self.data, self.batch_size, self.shuffle, self.seed = data, batch_size, shuffle, seed
        self.order = None
        full = math.ceil(len(data) / batch_size)
        self.steps = min(full, steps_per_epoch) if steps_per_epoch else full

    def epoch(self, epoch, start=0):
        n = len(self.data)
        if not self.shuffle:
            order = np.arange(n)
        elif self.order is not None:
            order = self.order(epoch)
        else:
            order = np.random.default_rng([self.seed, epoch]).permutation(n)
        for step in range(start, self.steps):   # resuming: by index, nothing read again
            yield self.data, order[step * self.batch_size:(step + 1) * self.batch_size]
