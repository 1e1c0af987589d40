"""Forwards whose samples interact: a row's output that depends on the other rows of
the batch (docs/models.md, "Samples that interact").

With several replicas or microbatches (R x M > 1) each slice of the batch runs the
forward on its own, so a model that sums over the batch axis (`ops.tensordot(user,
movie, 2)` of two (batch, d) tensors), normalises over it, or mixes rows computes
per slice what `model.fit` computes on the whole batch, and trains differently. At
set-up (`coupled`) the model runs in inference mode on the first rows of the data,
whole and in two unequal parts (the sample of `customised.probe`); outputs that differ
beyond round-off are reported with the layer where the rows first interact, as a
`BatchCouplingWarning` (a warning, and a ValueError when warnings are made errors).

Inference mode, so that Dropout and noise layers draw nothing; a model that still
draws random numbers there is run whole twice, and a layer whose output differs from
itself is left out (it cannot be told apart). BatchNormalization's batch statistics
and `hf.layers.ClassBalancedMix`'s mixing act only in training: they are documented
per-microbatch behaviour and are not flagged, and nor is any coupling that acts only
in training (the check does not see it).
"""

import warnings

import numpy as np

from .. import _compat
from . import customised

__all__ = ["BatchCouplingWarning", "coupled", "message", "check"]

# Round-off between batch sizes (another kernel blocking) is a few units of the last
# place; a tolerance of 1e-4 of the values' scale, or 8 units of a 16-bit float's
# last place, leaves it out and keeps any real interaction of rows.
_EPS = {"bfloat16": 2.0 ** -7, "float16": 2.0 ** -10}


class BatchCouplingWarning(UserWarning, ValueError):
    """A model's forward couples the samples of a batch, and R x M > 1 splits it.
    Also a ValueError, so that `warnings.simplefilter("error", BatchCouplingWarning)`
    makes it a refusal agreed by every rank."""


def _numpy(value):
    value = np.asarray(value)
    return value.astype(np.float64) if value.dtype.kind == "f" or value.dtype.name == \
        "bfloat16" else value


def _tolerance(value, dtype):
    scale = max(1.0, float(np.max(np.abs(value)))) if value.size else 1.0
    return max(1e-4, 8 * _EPS.get(str(dtype), 0.0)) * scale


def _same(a, b, dtype):
    """Whether two arrays agree to round-off (NaNs where both have them)."""
    if a.shape != b.shape:
        return False
    if a.dtype.kind not in "fc":
        return bool(np.array_equal(a, b))
    both = np.isnan(a) & np.isnan(b)
    return bool(np.all(both | (np.abs(a - b) <= _tolerance(a, dtype))))


def _split_differs(whole, parts, rows):
    """Whether outputs on `rows` rows (`whole`, flat) differ from the same outputs
    computed on the parts (`parts`, one flat list per part)."""
    for k, w in enumerate(whole):
        dtype = getattr(w, "dtype", None)
        w = _numpy(w)
        pieces = [_numpy(p[k]) for p in parts]
        if w.ndim and w.shape[0] == rows and all(
                p.ndim == w.ndim and p.shape[1:] == w.shape[1:] for p in pieces) and \
                sum(p.shape[0] for p in pieces) == rows:
            if not _same(w, np.concatenate(pieces), dtype):
                return True
        elif not all(_same(w, p, dtype) for p in pieces):  # a value of no rows: the same
            return True
    return False


def _flat(value):
    return _compat.tree.flatten(value)


def _model_outputs(model, graph, data, n):
    """Flat outputs on rows 0:n, and on each of the probe's two parts of them."""
    outs = {}

    def keep(lo, hi, x, y, sw, y_pred):
        outs[(lo, hi)] = _flat(y_pred)

    customised.forward_parts(model, graph, data, n, keep)
    (whole, *parts) = [outs[p] for p in customised.parts(n)]
    return whole, parts


def _slice(value, lo, hi, rows):
    """Rows lo:hi of every tensor of `value` (a call's arguments) with `rows` rows."""
    def cut(v):
        shape = getattr(v, "shape", None)
        return v[lo:hi] if shape is not None and len(shape) and shape[0] == rows else v

    return _compat.tree.map_structure(cut, value)


def _first_layer(graph, data, n):
    """The name of the first layer call (in Keras's order) whose output on rows split
    in two differs from its output on them whole, given the same inputs; None when
    every call agrees (or draws random numbers in inference mode)."""
    x, _, _ = customised.rows(data, graph, 0, n)
    inputs = [graph.tensors[t].keras_tensor for t in graph.inputs]
    values = {id(kt): v for kt, v in zip(inputs, _flat(x))}
    names = {id(node.keras_node): node.name for node in graph.nodes}
    for keras_node in _compat.call_order(graph.functional):
        args, kwargs = _compat.fill_in(keras_node, values)
        op = keras_node.operation

        def call(a, k):
            return _flat(_compat.call_operation(op, a, k, False))

        whole = call(args, kwargs)
        parts = [call(*_slice((args, kwargs), lo, hi, n)) for lo, hi in customised.parts(n)[1:]]
        if _split_differs(whole, parts, n) and not _split_differs(
                whole, [call(args, kwargs)], n):  # not a random draw
            return names.get(id(keras_node), op.name)
        for kt, v in zip(keras_node.outputs, whole):
            values[id(kt)] = v
    return None


def coupled(model, graph, data):
    """The name of the layer (or, for a subclassed model, of the model) where the rows
    of a batch first interact in inference mode; None when they do not."""
    n = min(len(data), customised.ROWS)
    if n < 2:
        return None
    try:
        whole, parts = _model_outputs(model, graph, data, n)
        if not _split_differs(whole, parts, n):
            return None
        if graph.functional is not None:
            return _first_layer(graph, data, n)
        again, _ = _model_outputs(model, graph, data, n)
        return None if _split_differs(whole, [again], n) else model.name
    except Exception:  # noqa: BLE001 - a model that cannot run on a few rows fails in fit, named
        return None


def message(model, layer, layout):
    """What a BatchCouplingWarning says."""
    where = (f"the model {model.name!r} (subclassed: its layers cannot be told apart)"
             if layer == model.name and _compat.functional_of(model) is None
             else f"layer {layer!r}")
    return (
        f"The outputs of {where} for a sample depend on the other samples of the batch: "
        "computed on rows of the data whole and in two parts, in inference mode, they differ "
        "(a sum or mean over the batch axis, a normalisation over the batch, a layer mixing "
        f"samples). With num_replicas={layout.num_replicas} and "
        f"num_microbatches={layout.num_microbatches} each of the R x M = "
        f"{layout.num_replicas * layout.num_microbatches} slices of a batch runs the forward "
        "on its own, so training differs from model.fit (it trains as model.fit on batches "
        "of B / (R x M) with their gradients averaged, one step per batch, would), and "
        "predict and evaluate from Keras's. To train it as model.fit does, use "
        "num_replicas=1 and num_microbatches=1 (any num_stages); if the "
        "per-slice interaction is what you want, silence this with warnings.filterwarnings("
        "'ignore', category=hyparflow.BatchCouplingWarning).")


def check(model, graph, sample, layout, rank):
    """Rows that interact in the forward train differently when the batch is split:
    named once, by rank 0, when it is (a warnings filter may make it an error, a
    ValueError every rank agrees on)."""
    if layout.num_replicas * layout.num_microbatches > 1 and rank == 0:
        layer = coupled(model, graph, sample)
        if layer is not None:
            warnings.warn(message(model, layer, layout), BatchCouplingWarning, stacklevel=3)
