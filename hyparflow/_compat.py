"""The one place that touches Keras internals; every version branch lives here."""

from typing import Any, Set  # Keras objects are untyped: Any
import keras
from keras.src import backend as _backend
from keras.src import tree

__all__ = [
    "functional_of", "graph_nodes", "producer_node", "call_order", "fill_in", "call_operation",
    "pack_outputs", "output_structure", "input_structure", "symbolic", "compile_loss",
    "compile_metrics", "loss_tracker", "is_compiled", "tree", "fit_shuffle_order",
    "dropout_rows", "own_loss_count", "learning_rate", "optimizer_slot",
]


def functional_of(model: Any) -> Any:
    """The Functional graph behind `model`, or None for a subclassed model."""
    if isinstance(model, keras.Sequential):
        return getattr(model, "_functional", None)
    if isinstance(model, keras.Model) and hasattr(model, "_nodes_by_depth") and hasattr(
        model, "_inputs_struct"
    ):
        return model
    return None


def graph_nodes(functional: Any) -> Set[int]:
    """Ids of the keras Nodes that belong to this graph (a layer may sit in several)."""
    return {id(n) for nodes in functional._nodes_by_depth.values() for n in nodes}


def producer_node(tensor: Any) -> Any:
    """The keras Node that produced a KerasTensor."""
    history = tensor._keras_history
    return history.operation._inbound_nodes[history.node_index]


def call_order(functional: Any) -> Any:
    """The graph's keras Nodes in the order `Functional.call` runs them (deepest
    first, as its `_run_through_graph`): the order in which a layer that removes
    masks from its inputs (MultiHeadAttention) acts in `model.fit`."""
    return [node for depth in sorted(functional._nodes_by_depth, reverse=True)
            for node in functional._nodes_by_depth[depth]
            if node.operation and not node.is_input]


def fill_in(node: Any, tensor_dict: Any) -> Any:
    """(args, kwargs) of a node's call with symbolic tensors replaced by values."""
    return node.arguments.fill_in(tensor_dict)


def call_operation(op: Any, args: Any, kwargs: Any, training: bool) -> Any:
    """Call one layer/operation as Functional.call does, passing `training` where taken."""
    context = getattr(op, "_call_context_args", None)
    if context is None:  # older Keras 3
        takes = getattr(op, "_call_has_training_arg", False)
    else:
        takes = "training" in context
    if takes and training is not None:
        kwargs = dict(kwargs, training=training)
    return op(*args, **kwargs)


def output_structure(functional: Any) -> Any:
    return functional._outputs_struct


def input_structure(functional: Any) -> Any:
    return functional._inputs_struct


def pack_outputs(functional, flat):
    """Flat output values -> the structure the model's `call` returns."""
    if functional is None:
        return flat[0] if len(flat) == 1 else list(flat)
    packed = tree.pack_sequence_as(functional._outputs_struct, list(flat))
    if isinstance(packed, (list, tuple)) and len(packed) == 1:
        return packed[0]
    return packed


def symbolic(shape, dtype):
    return _backend.KerasTensor(tuple(shape), _backend.standardize_dtype(dtype))


def get_mask(value: Any) -> Any:
    """The Keras mask (padding) a layer attached to a value, or None."""
    return _backend.get_keras_mask(value)


def set_mask(value, mask):
    """Attach a Keras mask to a value, so the layers that take masks read it."""
    _backend.set_keras_mask(value, mask)


def compute_output_spec(fn, *args, **kwargs):
    return _backend.compute_output_spec(fn, *args, **kwargs)


def compile_loss(model):
    return getattr(model, "_compile_loss", None)


def compile_metrics(model):
    return getattr(model, "_compile_metrics", None)


def loss_tracker(model: Any) -> Any:
    return getattr(model, "_loss_tracker", None)


def is_compiled(model):
    return bool(getattr(model, "compiled", False)) and getattr(model, "optimizer", None) is not None


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


def overrider(model, method):
    """The class (not Keras's own) whose `method` the model runs instead of Keras's,
    or None."""
    for cls in type(model).__mro__:
        if method in cls.__dict__:
            return None if cls.__module__.split(".")[0] == "keras" else cls
    return None


def calls_add_loss(layer):
    """Whether `layer` or a layer inside it is of a class whose own `call` adds losses
    (`self.add_loss`), which may grow with the batch. Keras's activity regularizers
    are divided by the batch size by Keras itself: a mean."""
    for sub in [layer] + sublayers(layer):
        for cls in type(sub).__mro__:
            if cls.__module__.split(".")[0] == "keras":
                break
            code = getattr(cls.__dict__.get("call"), "__code__", None)
            if code is not None and "add_loss" in code.co_names:
                return True
    return False


class model_losses_replaced:
    """While active, `model.losses` (what `compute_loss` adds to the compiled loss) is
    `losses` instead of the layers' own: hyparflow adds each stage's layer losses
    where that stage runs."""

    def __init__(self, model, losses):
        self.model, self.losses = model, list(losses)

    def __enter__(self):
        self.saved = self.model.__dict__.get("_losses_override")
        object.__setattr__(self.model, "_losses_override", self.losses)
        return self

    def __exit__(self, *exc):
        object.__setattr__(self.model, "_losses_override", self.saved)
        return False


def run_compute_loss(model, x, y, y_pred, sample_weight, training):
    """The model's own `compute_loss` (an override), as Keras's train step calls it."""
    return model._compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight,
                               training=training)


def variable_handle(variable):
    """The TensorFlow resource handle behind a Keras variable (what a traced function
    captures when it reads the variable)."""
    value = getattr(variable, "value", variable)
    return getattr(value, "handle", None)


def seed_generators(layer):
    """The keras SeedGenerators a layer (and its sublayers) draws randomness from."""
    out = []
    for sub in layer._flatten_layers(include_self=True) if hasattr(layer, "_flatten_layers") else ():
        out.extend(getattr(sub, "_seed_generators", ()))
    return out


def check_optimizer_knows(optimizer, variables):
    """An optimizer built before (by an earlier fit) steps only the variables it was
    built for; the parts of split layers are new to one built with other settings."""
    known = {id(v) for v in getattr(optimizer, "_trainable_variables", variables)}
    if any(id(v) not in known for v in variables):
        raise ValueError(
            "The model's optimizer was built for other variables (an earlier fit with another "
            "num_tensor or tensor_shares). Compile the model again (model.compile(...)) to "
            "start a new optimizer, or keep the earlier settings.")


# -- multi-head attention (tensor parallelism by heads) ------------------------

def attention_parts(op):
    """The parts of a built keras MultiHeadAttention that a split by heads touches:
    {"query", "key", "value", ("gate",) "output": EinsumDense sublayers,
    "dropout": its Dropout on the attention probabilities, "axes": its attention
    axes}."""
    parts = {name: getattr(op, f"_{name}_dense", None) for name in ("query", "key", "value")}
    if getattr(op, "_use_gate", False):
        parts["gate"] = getattr(op, "_gate_dense", None)
    parts["output"] = getattr(op, "_output_dense", None)
    parts["dropout"] = getattr(op, "_dropout_layer", None)
    parts["axes"] = tuple(getattr(op, "_attention_axes", None) or ())
    return parts


def keras_mask(x):
    return _backend.get_keras_mask(x)


def set_keras_mask(x, mask):
    if mask is not None:
        _backend.set_keras_mask(x, mask)
    return x


def original_call(layer):
    """The layer's own `call` (its class's), even while `calls_replaced` stands in."""
    return type(layer).call.__get__(layer)


class calls_replaced:
    """While active, each layer in `mapping` runs `mapping[layer]` in place of its
    `call` (an instance attribute shadows the class's method, which Keras's
    `Layer.__call__` looks up by attribute), with everything around it (masks,
    autocasting, name scopes, training resolution) as Keras does it, except the
    input spec check: a replacement may take a part of the input (a row split)."""

    def __init__(self, mapping):
        self.mapping = mapping
        self.specs = {}

    def __enter__(self):
        for layer, fn in self.mapping.items():
            object.__setattr__(layer, "call", fn)
            self.specs[id(layer)] = layer.__dict__.get("_input_spec")
            if self.specs[id(layer)] is not None:
                object.__setattr__(layer, "_input_spec", None)
        return self

    def __exit__(self, *exc):
        for layer in self.mapping:
            layer.__dict__.pop("call", None)
            if self.specs.get(id(layer)) is not None:
                object.__setattr__(layer, "_input_spec", self.specs[id(layer)])
        return False


def sublayers(layer):
    """Every layer inside `layer` (depth first, each once), not `layer` itself."""
    if not hasattr(layer, "_flatten_layers"):
        return []
    return list(layer._flatten_layers(include_self=False, recursive=True))


def fit_shuffle_order(num_samples):
    """The order in which `model.fit(x, y, shuffle=True)` takes `num_samples` numpy
    samples in its next epoch: its array data adapter's own tf.data permutation (the
    TensorFlow backend's), so it follows `keras.utils.set_random_seed` as `model.fit`
    does. The permutation does not depend on the batch size: one batch holds it all."""
    import numpy as np
    from keras.src.trainers.data_adapters.array_data_adapter import ArrayDataAdapter

    indices = np.arange(num_samples, dtype=np.int64)
    dataset = ArrayDataAdapter(indices, shuffle=True, batch_size=num_samples).get_tf_dataset()
    return np.concatenate([np.asarray(batch) for batch in dataset])


# -- sweeps (hyparflow.sweeps) -----------------------------------------------------------

def dropout_rows(x, rate, noise_shape, seed_generator, start, total):
    """`keras.random.dropout(full, rate, noise_shape, seed_generator)` for the rows
    `start:start + len(x)` of a batch of `total` rows of which `x` is a part: the mask
    the whole batch's call draws (TensorFlow's stateless dropout, as Keras calls it),
    cut to these rows, so that each replica of a member drops what its own fit drops."""
    import tensorflow as tf
    from keras.src.backend.tensorflow.random import _cast_seed
    from keras.src.random.seed_generator import draw_seed

    if rate == 1.0:
        return tf.zeros_like(x)
    if rate == 0.0:
        return x
    seed = _cast_seed(draw_seed(seed_generator))
    shape = tf.shape(x)
    full = tf.concat([[total], shape[1:]], 0)
    if noise_shape is not None:
        full = tf.stack([full[i] if d is None else tf.constant(d, tf.int32)
                         for i, d in enumerate(noise_shape)])
    random = tf.random.stateless_uniform(full, seed=seed, dtype=x.dtype)
    if noise_shape is None or noise_shape[0] is None:
        random = random[start:start + shape[0]]
    scaled = x * tf.constant(1.0 / (1.0 - rate), x.dtype)
    return tf.where(random >= rate, scaled, tf.zeros((), x.dtype))


def own_loss_count(layer):
    """How many losses the layer has added in calls so far (add_loss)."""
    return len(getattr(layer, "_losses", ()))


def learning_rate(optimizer, iterations):
    """`optimizer.learning_rate` as its `apply` reads it, at step `iterations` (a
    schedule's value there, its variable's current value, a callable's result)."""
    from keras.src.optimizers.schedules import learning_rate_schedule

    lr = optimizer._learning_rate
    if isinstance(lr, learning_rate_schedule.LearningRateSchedule):
        return lr(iterations)
    if isinstance(lr, _backend.Variable):
        return lr.value
    if callable(lr):
        return lr()
    return lr


def optimizer_slot(optimizer, attribute, variable):
    """The optimizer's slot variable in its list `attribute` (e.g. "_momentums") for the
    model variable `variable`, or None (e.g. SGD without momentum keeps none)."""
    slots = getattr(optimizer, attribute, None)
    if not slots:
        return None
    return slots[optimizer._get_variable_index(variable)]
