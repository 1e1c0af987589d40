"""Keras's compiled loss, taken apart: how each loss of a microbatch adds up to the
global batch's (`SHARE`, `SUM`, `GLOBAL`), and the loss's terms computed as Keras
computes them."""

import keras
from keras.src import backend as _backend
from keras.src import tree


# How a microbatch's value of each compiled loss adds up to the global batch's:
# "share": Keras's value times the microbatch's share of the batch (a mean over a
# fixed number of elements per sample); "sum": Keras's value as it is (a sum over
# the batch); "global": a sum over the microbatch divided by a normaliser that
# depends on the whole batch (a mask's valid entries, a sum of sample weights),
# so the microbatch returns the sum and its part of the normaliser instead.
SHARE, SUM, GLOBAL = "share", "sum", "global"


def _resolve(path, obj):
    for p in path:
        obj = obj[p]
    return obj


def _conform(structure, value):
    if structure is None:
        return value
    try:
        tree.assert_same_structure(structure, value)
        return value
    except ValueError:
        return tree.pack_sequence_as(structure, tree.flatten(value))


def loss_kinds(loss, masked_outputs, weighted):
    """The kind (SHARE, SUM or GLOBAL) of each of a built `CompileLoss`'s losses.

    `masked_outputs`: per model output (flat order), whether a Keras mask may reach
    it; `weighted`: whether sample weights are given. A loss that replaces
    `Loss.__call__` is opaque: its value is taken as a mean (SHARE)."""
    if loss is None or loss._flat_losses is None:
        return []
    positions = _conform(loss._y_pred_build_structure, list(range(len(masked_outputs)))) \
        if len(masked_outputs) > 1 else 0
    kinds = []
    for path, fn, _, _ in loss._flat_losses:
        output = _resolve(path, positions) if len(masked_outputs) > 1 else 0
        masked = bool(masked_outputs[output]) if masked_outputs else False
        reduction = getattr(fn, "reduction", "sum_over_batch_size")
        if type(fn).__call__ is not keras.losses.Loss.__call__:
            kinds.append(SHARE)
        elif reduction in (None, "none", "sum"):
            kinds.append(SUM)
        elif masked or (reduction == "mean_with_sample_weight" and weighted):
            kinds.append(GLOBAL)
        else:
            kinds.append(SHARE)
    return kinds


def loss_weights(loss):
    """Each compiled loss's weight (`loss_weights` in `compile`; 1 when none)."""
    return [1.0 if w is None else float(w) for _, _, w, _ in (loss._flat_losses or [])]


def _global_sums(fn, y_true, y_pred, sample_weight):
    """`Loss.__call__` of `fn` split in two: (the weighted sum of the microbatch's
    values, the microbatch's part of the normaliser) such that Keras's value over
    a batch is the sum of the first over the batch divided by the sum of the second.
    Follows `keras.losses.Loss.__call__` and `reduce_weighted_values` step by step."""
    from keras import ops
    from keras.src.losses import loss as _loss

    in_mask = _backend.get_keras_mask(y_pred)
    dtype = fn.dtype
    y_pred = tree.map_structure(lambda x: ops.convert_to_tensor(x, dtype=dtype), y_pred)
    y_true = tree.map_structure(lambda x: ops.convert_to_tensor(x, dtype=dtype), y_true)
    values = fn.call(y_true, y_pred)
    out_mask = _backend.get_keras_mask(values)
    masks = [m for m in (in_mask, out_mask) if m is not None]
    mask = masks[0] if len(masks) == 1 else (masks[0] & masks[1] if masks else None)
    values = ops.convert_to_tensor(values, dtype=dtype)
    if sample_weight is not None:
        sample_weight = ops.convert_to_tensor(sample_weight, dtype=dtype)
    size = ops.cast(ops.prod(ops.convert_to_tensor(ops.shape(values), dtype="int32")), dtype)
    # The mask as 0/1 weights (Keras's total/valid factor is the normaliser's part).
    weights = _loss.apply_mask(sample_weight, mask, dtype=values.dtype, reduction="sum")
    if weights is not None:
        values, weights = _loss.squeeze_or_expand_to_same_rank(values, ops.cast(weights, dtype))
        values = values * weights
    total = ops.sum(values)
    if fn.reduction == "mean_with_sample_weight":
        count = size if weights is None else ops.sum(weights)
    elif mask is not None:
        # Keras: sum(values * w * total / valid) / size, total the mask's elements.
        elements = ops.cast(ops.prod(ops.convert_to_tensor(ops.shape(mask), dtype="int32")),
                            dtype)
        count = ops.sum(ops.cast(mask, dtype)) * size / elements
    else:
        count = size
    return ops.cast(total, "float32"), ops.cast(count, "float32")


def split_loss(fn, y_pred):
    """The loss to take on `y_pred`: `fn`, or, when `y_pred` is a split layer's part of
    the output (the mesh's vocabulary-split logits, kinds/mesh/logits.py), the loss
    that part gives for `fn` (Keras's reduction around a per-token call made with the
    other ranks)."""
    make = getattr(y_pred, "_hyparflow_split_loss", None)
    return fn if make is None else make(fn)


def compile_loss_terms(loss, y_true, y_pred, sample_weight, share, kinds):
    """The compiled loss of one microbatch that is `share` of the global batch, as
    (the part whose sum over microbatches and replicas is the batch's: SHARE and SUM
    losses, weighted; [sum, normaliser part] of each GLOBAL loss, unweighted), and
    the per-output loss trackers ("out_loss" in the logs) of the SHARE and SUM
    losses updated (the GLOBAL ones' wait for the normaliser: `track_global`).

    Keras weights each per-output loss tracker by the batch's *static* size, which
    is None in its traced train function, so `model.fit` reports the plain mean over
    steps of each batch's per-output loss. Weighting a microbatch's update by its
    share of the global batch adds up, over microbatches and replicas, to exactly
    one update per step with the global batch's per-output loss: the same numbers as
    `model.fit`. `y_true` must have the structure of `y_pred` (the trainer packs it
    so); `sample_weight` one array for all outputs or the outputs' structure."""
    from keras import ops

    y_pred = _conform(loss._y_pred_build_structure, y_pred)
    y_true = _conform(loss._y_true_build_structure, y_true)
    metrics = list(loss.metrics) or [None] * len(loss._flat_losses)
    static, sums = [], []
    for (path, fn, weight, _), metric, kind in zip(loss._flat_losses, metrics, kinds):
        y_t, y_p = _resolve(path, y_true), _resolve(path, y_pred)
        sw = _resolve(path, sample_weight) if tree.is_nested(sample_weight) else sample_weight
        fn = split_loss(fn, y_p)
        if kind == GLOBAL:
            sums.append(_global_sums(fn, y_t, y_p, sw))
            continue
        if kind == SHARE and _backend.get_keras_mask(y_p) is not None and \
                type(fn).__call__ is keras.losses.Loss.__call__ and \
                fn.reduction in ("sum_over_batch_size", "mean", "mean_with_sample_weight"):
            raise ValueError(
                f"A Keras mask reaches the loss {fn.name!r} at run time, though the model's "
                "symbolic outputs carry none, so its normaliser (the batch's unmasked "
                "entries) was not planned for. Attach the mask in the model's graph (a layer "
                "with compute_mask), or pass the padding as a per-token sample_weight.")
        value = ops.cast(fn(y_t, y_p, sw), dtype=loss.dtype)
        if metric is not None:
            metric.update_state(value if kind == SHARE else value / share, sample_weight=share)
        if weight is not None:
            value = ops.multiply(value, weight)
        value = ops.cast(value, "float32")
        static.append(value * share if kind == SHARE else value)
    return (sum(static) if static else ops.zeros((), "float32")), sums


def call_compile_loss(loss, y_true, y_pred, sample_weight, share):
    """`CompileLoss.__call__` on a whole batch's rows (a fused sweep's member), its
    per-output loss trackers updated with weight `share`: the value `model.fit`
    computes for the batch. (The pipeline splits batches: `compile_loss_terms`.)"""
    from keras import ops

    y_pred = _conform(loss._y_pred_build_structure, y_pred)
    y_true = _conform(loss._y_true_build_structure, y_true)
    metrics = list(loss.metrics) or [None] * len(loss._flat_losses)
    values = []
    for (path, fn, weight, _), metric in zip(loss._flat_losses, metrics):
        y_t, y_p = _resolve(path, y_true), _resolve(path, y_pred)
        sw = _resolve(path, sample_weight) if tree.is_nested(sample_weight) else sample_weight
        value = ops.cast(fn(y_t, y_p, sw), dtype=loss.dtype)
        if metric is not None:
            metric.update_state(value, sample_weight=share)
        if weight is not None:
            value = ops.multiply(value, weight)
        values.append(value)
    return sum(values) if values else ops.zeros(())


def track_global(loss, kinds, sums, normalisers, share):
    """Update the per-output loss trackers of the GLOBAL losses with this rank's part
    of the step's value (`sums`: this rank's sums, `normalisers`: the global batch's,
    `share`: this rank's part of the batch), so that, summed over the ranks, each
    gets one update with the global batch's value per step (as in
    `compile_loss_terms`)."""
    metrics = list(loss.metrics)
    if not metrics or share <= 0:
        return
    k = 0
    for metric, kind in zip(metrics, kinds):
        if kind != GLOBAL:
            continue
        value = sums[k] / normalisers[k] if normalisers[k] else 0.0
        metric.update_state(value / share, sample_weight=share)
        k += 1
