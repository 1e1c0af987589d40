"""The one place that touches Keras internals; every version branch lives here."""

import keras
from keras.src import backend as _backend
from keras.src import tree

__all__ = [
    "functional_of", "graph_nodes", "producer_node", "call_order", "fill_in", "call_operation",
    "pack_outputs", "output_structure", "input_structure", "symbolic", "compile_loss",
    "compile_metrics", "loss_tracker", "is_compiled", "tree", "fit_shuffle_order",
]


def functional_of(model):
    """The Functional graph behind `model`, or None for a subclassed model."""
    if isinstance(model, keras.Sequential):
        return getattr(model, "_functional", None)
    if isinstance(model, keras.Model) and hasattr(model, "_nodes_by_depth") and hasattr(
        model, "_inputs_struct"
    ):
        return model
    return None


def graph_nodes(functional):
    """Ids of the keras Nodes that belong to this graph (a layer may sit in several)."""
    return {id(n) for nodes in functional._nodes_by_depth.values() for n in nodes}


def producer_node(tensor):
    """The keras Node that produced a KerasTensor."""
    history = tensor._keras_history
    return history.operation._inbound_nodes[history.node_index]


def call_order(functional):
    """The graph's keras Nodes in the order `Functional.call` runs them (deepest
    first, as its `_run_through_graph`): the order in which a layer that removes
    masks from its inputs (MultiHeadAttention) acts in `model.fit`."""
    return [node for depth in sorted(functional._nodes_by_depth, reverse=True)
            for node in functional._nodes_by_depth[depth]
            if node.operation and not node.is_input]


def fill_in(node, tensor_dict):
    """(args, kwargs) of a node's call with symbolic tensors replaced by values."""
    return node.arguments.fill_in(tensor_dict)


def call_operation(op, args, kwargs, training):
    """Call one layer/operation as Functional.call does, passing `training` where taken."""
    context = getattr(op, "_call_context_args", None)
    if context is None:  # older Keras 3
        takes = getattr(op, "_call_has_training_arg", False)
    else:
        takes = "training" in context
    if takes and training is not None:
        kwargs = dict(kwargs, training=training)
    return op(*args, **kwargs)


def output_structure(functional):
    return functional._outputs_struct


def input_structure(functional):
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


def get_mask(value):
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


def loss_tracker(model):
    return getattr(model, "_loss_tracker", None)


def is_compiled(model):
    return bool(getattr(model, "compiled", False)) and getattr(model, "optimizer", None) is not None


def call_compile_loss(loss, y_true, y_pred, sample_weight, share):
    """`CompileLoss.__call__` for one microbatch that is `share` of the global batch.

    Keras weights each per-output loss tracker ("out_loss" in the logs) by the
    batch's *static* size, which is None in its traced train function, so
    `model.fit` reports the plain mean over steps of each batch's per-output
    loss. Weighting a microbatch's update by its share of the global batch adds
    up, over microbatches and replicas, to exactly one update per step with
    the global batch's per-output loss: the same numbers as `model.fit`.

    `y_true` must have the structure of `y_pred` (the trainer packs it so)."""
    from keras import ops

    def resolve(path, obj):
        for p in path:
            obj = obj[p]
        return obj

    def conform(structure, value):
        if structure is None:
            return value
        try:
            tree.assert_same_structure(structure, value)
            return value
        except ValueError:
            return tree.pack_sequence_as(structure, tree.flatten(value))

    y_pred = conform(loss._y_pred_build_structure, y_pred)
    y_true = conform(loss._y_true_build_structure, y_true)
    metrics = list(loss.metrics) or [None] * len(loss._flat_losses)
    values = []
    for (path, fn, weight, _), metric in zip(loss._flat_losses, metrics):
        y_t, y_p = resolve(path, y_true), resolve(path, y_pred)
        sw = resolve(path, sample_weight) if tree.is_nested(sample_weight) else sample_weight
        value = ops.cast(fn(y_t, y_p, sw), dtype=loss.dtype)
        if metric is not None:
            metric.update_state(value, sample_weight=share)
        if weight is not None:
            value = ops.multiply(value, weight)
        values.append(value)
    return sum(values) if values else ops.zeros(())


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
