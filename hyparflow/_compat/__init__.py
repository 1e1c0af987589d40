"""The one place that touches Keras internals; every version branch lives here (the
compiled loss's in `loss`)."""

import re
from typing import Any, Set  # Keras objects are untyped: Any

import keras
from keras.src import backend as _backend
from keras.src import tree

from .loss import (  # noqa: F401  (callers reach the loss's parts as _compat.*)
    GLOBAL, SHARE, SUM, call_compile_loss, compile_loss_terms, loss_kinds, loss_weights,
    split_loss, track_global)

__all__ = [
    "functional_of", "graph_nodes", "producer_node", "call_order", "fill_in", "call_operation",
    "pack_outputs", "output_structure", "input_structure", "symbolic", "dtype_name", "compile_loss",
    "compile_metrics", "loss_tracker", "is_compiled", "tree", "fit_shuffle_order",
    "dropout_rows", "own_loss_count", "learning_rate", "optimizer_slot", "auto_named",
]


def auto_named(op: Any) -> bool:
    """Whether `op`'s name is one Keras made up (`keras.src.utils.naming.auto_name`:
    the class in snake case, then `_N` for the N-th before it in this process), not
    one the user gave. Keras keeps no record of which it was, so the name's form
    decides: a user who names a Dense "dense_3" is taken as unnamed."""
    from keras.src.utils import naming

    base = naming.to_snake_case(type(op).__name__)
    return re.fullmatch(re.escape(base) + r"(_[0-9]+)?", str(op.name)) is not None


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


def dtype_name(dtype: Any) -> str:
    """Keras's name of a dtype; numpy's text dtypes (str, bytes, object) are "string"."""
    kind = getattr(dtype, "kind", None)
    return "string" if kind in ("O", "S", "U") else _backend.standardize_dtype(dtype)


def symbolic(shape, dtype):
    return _backend.KerasTensor(tuple(shape), dtype_name(dtype))


def get_mask(value: Any) -> Any:
    """The Keras mask (padding) a layer attached to a value, or None."""
    return _backend.get_keras_mask(value)


def set_mask(value: Any, mask: Any) -> None:
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


def flatten_logs(model, logs):
    """What `model.evaluate(return_dict=False)` returns for a logs dict."""
    return model._flatten_metrics_in_order(logs)


def global_seed_generator():
    """Keras's generator for random draws given no seed (made if there is none yet)."""
    from keras.src.random import seed_generator

    return seed_generator.global_seed_generator()


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


def onednn():
    """Whether TensorFlow runs its oneDNN CPU kernels (TF_ENABLE_ONEDNN_OPTS, read as
    TensorFlow is imported)."""
    try:
        from tensorflow.python.util import _pywrap_util_port
    except ImportError:
        return False
    return bool(getattr(_pywrap_util_port, "IsMklEnabled", lambda: False)())


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
