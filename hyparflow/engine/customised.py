"""Customised training: what of a model's own training code hyparflow honours, and
what it refuses (docs/models.md, "Customised training").

hyparflow runs its own step: the forward cut into stages and microbatches, the
backward, the gradient sums over replicas and one optimizer step. So:

- a `train_step` (or `test_step`) override cannot run inside that step: it runs
  whole, on each replica's rows, at S = T = M = 1 (`loop.steps`, `engine.steps`), and
  is refused elsewhere with the reason;
- a `compute_loss` override is run on the last stage, once per microbatch, with
  the microbatch's `x`, `y`, `y_pred` and `sample_weight`; hyparflow adds the
  layers' own losses (`self.losses`) on the stages that hold those layers;
- a loss a layer adds (`self.add_loss`) is computed per microbatch, on its stage.

Both are exact only if a microbatch's value adds up to the batch's: as a mean (the
batch's value is the microbatches' values weighted by their share of the batch) or
as a sum (their plain sum). Which one is measured once, at the start, on the
user's model in this process (`probe`): the loss of the first rows of the data,
and of two unequal parts of them. A value that is neither (a masked mean, a
product of means) is refused with the numbers, rather than trained differently.
"""

import numpy as np

from .. import _compat

__all__ = ["refuse_steps", "Custom", "probe", "parts", "rows", "forward_parts", "SHARE", "SUM"]

SHARE, SUM = _compat.SHARE, _compat.SUM
ROWS = 6  # rows of the sample the probe runs, cut 2 + 4


def refuse_steps(model, methods=("test_step",)):
    """Raise when the model overrides one of `methods` where hyparflow's own step runs
    (a `train_step` override trains through `loop.steps` instead, at S = T = M = 1)."""
    for method in methods:
        cls = _compat.overrider(model, method)
        if cls is None:
            continue
        what = "training" if method == "train_step" else "evaluation"
        raise NotImplementedError(
            f"Model {model.name!r} overrides {method} (in {cls.__qualname__}), but hyparflow "
            f"runs its own {what} step here (the forward cut into stages and microbatches, "
            "sums over replicas), so the custom step would not run and the results would "
            "differ from Keras's. hyparflow runs a model's own train_step and test_step at "
            "num_stages=1, num_tensor=1, num_microbatches=1 (any num_replicas): each "
            "replica runs it on its rows. Use that layout (a model that overrides "
            "train_step gets it in fit, validation included; hf.evaluate runs test_step), "
            "or put the custom loss in compute_loss(x, y, y_pred, sample_weight, training) "
            "and the metrics in compile(metrics=...).")


class Custom:
    """What the probe found. `loss`: the kind (SHARE or SUM) of a `compute_loss`
    override, None without one; `layer_losses`: whether the layers' own losses are
    part of the loss (an override may leave `self.losses` out); `kinds`:
    {id(layer): [kind of each of its `losses`]} for the layers probed."""

    def __init__(self, loss=None, layer_losses=True, kinds=None):
        self.loss, self.layer_losses, self.kinds = loss, layer_losses, dict(kinds or {})

    def kind_of(self, op, j):
        """The kind of loss j of layer `op` (SHARE for a layer not probed)."""
        kinds = self.kinds.get(id(op))
        if kinds is None:
            return SHARE
        if j >= len(kinds):
            raise ValueError(
                f"Layer {op.name!r} adds a loss in training that it did not add in inference "
                "mode, where hyparflow's start-up check looked, so whether it is a mean or a "
                "sum over the batch is unknown. Add the loss in both modes (it is then checked), "
                "or train with num_microbatches=1 and num_replicas=1.")
        return kinds[j]



def _kind(full, first, rest, n_first, n_rest, what):
    """SHARE or SUM, from a value on all rows and on two unequal parts of them."""
    scale = max(1.0, abs(full))
    mean = (n_first * first + n_rest * rest) / (n_first + n_rest)
    if abs(full - mean) <= 1e-4 * scale:
        return SHARE
    if abs(full - (first + rest)) <= 1e-4 * scale:
        return SUM
    raise ValueError(
        f"{what} is neither a mean nor a sum over the batch's samples: {full:.6g} on "
        f"{n_first + n_rest} rows, {first:.6g} and {rest:.6g} on {n_first} and {n_rest} of "
        f"them (a mean would give {mean:.6g}, a sum {first + rest:.6g}). hyparflow computes it "
        "per microbatch and adds the microbatches up, which would train differently from "
        "model.fit. Make it a mean or a sum over the samples (a masked mean divides by a count "
        "of the whole batch: use a compiled loss, whose normaliser hyparflow carries over "
        "microbatches), or train with num_microbatches=1 and num_replicas=1.")


def rows(data, graph, lo, hi):
    """(x, y, sample_weight) of rows lo:hi of `data`, in the model's structures."""
    xs = [a[lo:hi] for a in data.x]
    x = _compat.tree.pack_sequence_as(_compat.input_structure(graph.functional), xs) \
        if graph.functional is not None else (xs[0] if len(xs) == 1 else xs)
    y = None
    if data.y is not None:
        ys = [a[lo:hi] for a in data.y]
        y = _compat.pack_outputs(graph.functional, ys)
    sw = None
    if data.sample_weight is not None:
        leaves = [a[lo:hi] for a in data.sample_weight]
        sw = _compat.pack_outputs(graph.functional, leaves) if data.per_output else leaves[0]
    return x, y, sw


def parts(n):
    """The probe's rows: all n, and two unequal parts of them (a third, the rest)."""
    cut = n // 3 or 1
    return [(0, n), (0, cut), (cut, n)]


def forward_parts(model, graph, data, n, each):
    """Run `model` in inference mode on rows 0:n of `data` and on each of their two
    parts, calling `each(lo, hi, x, y, sample_weight, y_pred)` after each forward; the
    metrics' states are left as they were."""
    saved = [(v, v.numpy()) for m in model.metrics for v in m.variables]
    try:
        for lo, hi in parts(n):
            x, y, sw = rows(data, graph, lo, hi)
            each(lo, hi, x, y, sw, model(x, training=False))
    finally:
        for v, value in saved:
            v.assign(value)


def probe(model, graph, data):
    """The `Custom` for `model` on `data` (a `hyparflow.data.Data`): runs the model in
    this process on its first rows when it overrides `compute_loss` or has layers
    that add losses of their own; else the plain Custom(), without running anything."""
    import tensorflow as tf

    override = _compat.overrider(model, "compute_loss") is not None
    layers = {id(n.op): n.op for n in graph.nodes} if graph.functional is not None else {
        id(model): model}
    adding = [op for op in layers.values() if _compat.calls_add_loss(op)]
    if not override and not adding:
        return Custom()
    n = min(len(data), ROWS)
    if n < 2:
        return Custom(loss=SHARE if override else None)
    losses, values = [], []

    def measure(lo, hi, x, y, sw, y_pred):
        losses.append({i: [float(np.sum(l)) for l in op.losses] for i, op in
                       ((id(op), op) for op in adding)})
        if override:
            with _compat.model_losses_replaced(model, [tf.zeros(())]):
                v0 = float(_compat.run_compute_loss(model, x, y, y_pred, sw, True))
            with _compat.model_losses_replaced(model, [tf.ones(())]):
                v1 = float(_compat.run_compute_loss(model, x, y, y_pred, sw, True))
            values.append((v0, v1))

    forward_parts(model, graph, data, n, measure)
    cut = parts(n)[1][1]
    sizes = (cut, n - cut)
    kinds = {}
    for op in adding:
        full, first, rest = (l[id(op)] for l in losses)
        kinds[id(op)] = [_kind(f, a, b, *sizes, f"The loss {j} that layer {op.name!r} adds")
                         for j, (f, a, b) in enumerate(zip(full, first, rest))]
    if not override:
        return Custom(kinds=kinds)
    name = _compat.overrider(model, "compute_loss").__qualname__
    kind = _kind(values[0][0], values[1][0], values[2][0], *sizes,
                 f"The loss {name}.compute_loss returns")
    added = [v1 - v0 for v0, v1 in values]
    if all(abs(d - 1.0) <= 1e-5 for d in added):
        layer_losses = True
    elif all(abs(d) <= 1e-5 for d in added):
        layer_losses = False
    else:
        raise ValueError(
            f"{name}.compute_loss uses the layers' own losses (self.losses) other than by "
            f"adding them (adding 1 to them changed the loss by {added[0]:.6g}), so hyparflow, "
            "which adds each stage's layer losses where they are computed, cannot reproduce it. "
            "Add ops.sum(self.losses) to the loss, or leave them out.")
    return Custom(loss=kind, layer_losses=layer_losses, kinds=kinds)
