"""Before a `Runtime`: arguments checked, an error agreed by every rank (and a failed
run ended cleanly), the model read as a layer graph, built as `model.fit` builds it;
the model and optimizer checked, the ranks' set-ups compared, the compiled loss and
metrics built, the specs of the last stage's targets, inputs and sample weights."""

import sys

import keras
import numpy as np

from .. import _compat
from .. import graph as _graph
from . import errors as errors_

__all__ = ["check_positive", "agree_on_error", "fail", "x_leaves", "data_dtype", "is_dataset", "read_graph",
           "build_like_fit", "check_model", "check_optimizer", "loss_scale_refusal",
           "check_parted", "check_agreement", "identities",
           "build_compiled", "target_specs", "input_specs", "weight_specs"]


def check_positive(**values):
    for name, value in values.items():
        if not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"`{name}` must be an integer >= 1. Received: {name}={value!r}")


def agree_on_error(comm, error):
    """Raise on every rank if set-up failed on any rank (so none waits for the others);
    the error is printed once, by the first rank that had it (see errors.agreed)."""
    errors = comm.allgather_obj(None if error is None else (type(error).__name__, str(error)))
    if any(e is not None for e in errors):
        raise errors_.agreed(comm, error, errors)


def fail(comm, runtime, exc):
    """End every rank with this rank's error: print it once, here, then abort. The
    user's error comes first, as Python and Keras print it (hyparflow's frames hidden);
    where it happened in the pipeline comes after."""
    if comm.size == 1:
        return
    if runtime is not None:
        topo = runtime.topo
        where = (f"rank {comm.rank} (stage {topo.stage(comm.rank)}, replica "
                 f"{topo.replica(comm.rank)}) failed at {runtime.executor.position}")
    else:
        where = f"rank {comm.rank} failed"
    sys.stderr.write(errors_.format_error(exc)
                     + f"hyparflow: {where} with the error above; aborting all ranks.\n")
    sys.stderr.flush()
    comm.abort(1)


def is_dataset(x):
    """A `tf.data.Dataset` (what the Keras loop reads batch by batch, not as arrays)."""
    import tensorflow as tf

    return isinstance(x, tf.data.Dataset)


def x_leaves(x):
    """The input arrays of `x` (its first batch's where it is a stream), flat."""
    if is_dataset(x):
        x = keras.utils.unpack_x_y_sample_weight(next(iter(x)))[0]
    if isinstance(x, dict):
        return list(x.values())
    if isinstance(x, (list, tuple)):
        return list(x)
    return [x]


def data_dtype(array):
    """The Keras dtype of an input array as Keras feeds it: text as "string", any float
    as floatx, the rest as it is."""
    dtype = getattr(array, "dtype", None)
    if dtype is None:
        return keras.config.floatx()
    name = _compat.dtype_name(dtype)
    return keras.config.floatx() if keras.backend.is_float_dtype(name) else name


def _first_batch(x, batch_size):
    """The inputs of the first batch, in x's structure (what model.fit builds from)."""
    if is_dataset(x):
        return keras.utils.unpack_x_y_sample_weight(next(iter(x)))[0]
    return _compat.tree.map_structure(lambda a: a[:batch_size] if hasattr(a, "shape")
                                      else np.asarray(a)[:batch_size], x)


def build_like_fit(model, x, batch_size):
    """Build an unbuilt model as `model.fit` does: symbolically, from the shapes and
    dtypes of the first batch. Every rank does it (before rank 0's weights are
    broadcast), so every rank has the same variables."""
    batch = _compat.tree.map_structure(
        lambda a: None if a is None else _compat.symbolic(np.shape(a), data_dtype(a)),
        _first_batch(x, batch_size))
    try:
        _compat.compute_output_spec(model, batch, training=False)
    except ValueError:
        raise  # the user's input does not fit the model: Keras's own message
    except Exception as error:  # noqa: BLE001 - as Keras: say what to do instead
        raise ValueError(
            f"Unable to automatically build the model {model.name!r} from the first batch "
            f"(as model.fit would). Build it yourself before hyparflow.fit: call it once on a "
            f"batch, or model.build(input_shape). Exception encountered: {error!r}") from error


def read_graph(model, num_stages, x, batch_size=None):
    """The model's LayerGraph (built from the first batch of `x` if it is not yet); a
    subclassed model only with one stage."""
    if not isinstance(model, keras.Model):
        raise TypeError(f"`model` must be a keras.Model. Received: model={type(model).__name__}")
    check_positive(num_stages=num_stages)
    if not model.built:
        build_like_fit(model, x, batch_size)
    leaves = x_leaves(x)
    graph = _graph.from_model(model, [np.shape(a) for a in leaves],
                              [data_dtype(a) for a in leaves])
    if graph.functional is None and num_stages > 1:
        raise ValueError(
            f"Model {model.name!r} is a subclassed keras.Model whose `call` hyparflow cannot "
            f"read, so it cannot be cut into stages (num_stages={num_stages}). Train it with "
            "num_stages=1 (data parallel, any num_replicas), or build it with the Functional "
            "API (keras.Model(inputs, outputs)) or keras.Sequential to pipeline it."
        )
    return graph


def check_optimizer(optimizer, num_stages, num_tensor=1, num_replicas=1):
    """Optimizer features that would silently train differently when each stage steps
    its own variables (or each tensor rank its part of a layer's) are refused with
    the reason. `global_clipnorm` is not among them: the norm is summed over the
    ranks (`engine.clipping`)."""
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        raise NotImplementedError(loss_scale_refusal(num_stages, num_tensor, num_replicas))
    if num_tensor > 1:
        check_parted(optimizer, f"num_tensor={num_tensor} ranks each hold a part of a "
                     "split layer's variables", "num_tensor=1")


def loss_scale_refusal(num_stages, num_tensor=1, num_replicas=1):
    """Why a LossScaleOptimizer (mixed_float16) is refused, said for the layout."""
    holders = [f"{n} {what}" for n, what in ((num_stages, "stages"),
                                              (num_tensor, "tensor ranks"),
                                              (num_replicas, "replicas")) if n > 1]
    layout = (f"num_stages={num_stages}, num_tensor={num_tensor}, "
              f"num_replicas={num_replicas}")
    why = ("hyparflow runs the backward itself, microbatch by microbatch, without "
           "multiplying the loss by the optimizer's loss scale as Keras's train_step does")
    if holders:
        why += (", and the dynamic loss scale (with the skip of a step whose gradients "
                f"overflow) would have to be agreed each step by the {' and '.join(holders)} "
                "of this layout")
    return (f"A LossScaleOptimizer (mixed_float16) is not supported ({layout}): {why}. Use "
            "the 'mixed_bfloat16' policy, which needs no loss scaling.")


def check_parted(optimizer, holders, fix):
    """Refuse what needs whole variables when `holders` (who holds the parts, a
    phrase) step their parts apart: clipnorm (a whole variable's gradient's norm;
    global_clipnorm's one norm is summed over the ranks, `engine.clipping`), Adafactor
    and Muon (matrix-wise updates). `fix`: the option that avoids it.
    One list for every kind that parts a variable (tensor splits, sharded tables)."""
    if getattr(optimizer, "clipnorm", None):
        raise NotImplementedError(
            f"clipnorm={optimizer.clipnorm} clips each variable's gradient by its own norm, "
            f"but {holders}. Use global_clipnorm (one norm summed over the ranks) or "
            f"clipvalue, or {fix}.")
    name = type(optimizer).__name__
    if name in ("Adafactor", "Muon"):
        raise NotImplementedError(
            f"{name} updates a weight matrix as a whole (not element by element), but "
            f"{holders}, which step them apart. Use an element-wise optimizer (SGD, Adam, "
            f"AdamW, Adagrad, RMSprop, ...), or {fix}.")


def _open_specs(graph, arrays, ids):
    """(shape, dtype) of each of `arrays`: the batch dimension None, and so is every
    dimension the matching model tensor (`ids`) leaves open (a sequence length that
    changes from batch to batch)."""
    specs = []
    for k, a in enumerate(arrays):
        shape = graph.tensors[ids[k]].shape if k < len(ids) else ()
        dims = [None if j < len(shape) and shape[j] is None else a.shape[j]
                for j in range(1, a.ndim)]
        specs.append(((None, *dims), _compat.dtype_name(a.dtype)))
    return specs


def target_specs(graph, sample):
    """The target leaves' specs for the last stage's compiled function (`_open_specs`
    by the model's outputs)."""
    return [] if sample.y is None else _open_specs(graph, sample.y, graph.outputs)


def input_specs(graph, sample):
    """The model inputs' specs, for a `compute_loss` override's `x`."""
    return _open_specs(graph, sample.x, graph.inputs)


def weight_specs(sample):
    """(shape, dtype) of each sample-weight array, the batch dimension None."""
    return [((None,) + a.shape[1:], a.dtype) for a in sample.sample_weight or ()]


def identities(graph, indices):
    """How ranks compare layer calls (`indices`, of `graph`) in the set-up check: by
    position in the graph and class, and by name only where the user gave it. A
    name Keras made up ('add_1') depends on what else the process built before (an
    evaluation copy on rank 0), so it is no part of a call's identity."""
    return [(i, type(graph.nodes[i].op).__name__,
             graph.nodes[i].name if graph.nodes[i].given else None) for i in sorted(indices)]


def check_agreement(comm, facts):
    """All ranks must run the same model on the same data shape with the same
    settings; a mismatch would otherwise hang or silently mix models."""
    everyone = comm.allgather_obj(facts)
    for r, other in enumerate(everyone):
        if other != facts:
            diff = {k: (facts[k], other.get(k)) for k in facts if facts[k] != other.get(k)}
            raise ValueError(
                f"Ranks disagree on the set-up: rank {comm.rank} vs rank {r}: {diff} "
                "(values as (this rank, that rank)). Every rank must build the same model and "
                "pass the same data and arguments to hyparflow."
            )


def build_compiled(model, graph, data, rows=None):
    """Create the compiled loss's and metrics' state on every rank, symbolically
    (as Keras's own fit does, on a batch of `rows` samples, so that a mistake in the
    data is reported in the words of model.fit), without building the optimizer for
    all variables."""
    if data.y is None:
        return
    x_sym = [_compat.symbolic((rows,) + a.shape[1:], a.dtype) for a in data.x]
    y_sym = [_compat.symbolic((rows,) + a.shape[1:], a.dtype) for a in data.y]
    sw_sym = None
    if data.sample_weight is not None:
        leaves = [_compat.symbolic((rows,) + a.shape[1:], "float32") for a in data.sample_weight]
        sw_sym = leaves[0] if not data.per_output else (
            _compat.pack_outputs(graph.functional, leaves) if graph.functional is not None
            else leaves)
    y_pred = _outputs(model, graph.functional, x_sym, rows)
    if y_pred is None:   # traced: the inputs in the structure the model takes
        if graph.functional is not None:
            x_arg = _compat.tree.pack_sequence_as(_compat.input_structure(graph.functional),
                                                  x_sym)
        else:
            x_arg = x_sym[0] if len(x_sym) == 1 else x_sym
        y_pred = _compat.compute_output_spec(model, x_arg, training=False)
    y_true = _compat.pack_outputs(graph.functional, y_sym) if graph.functional is not None else (
        y_sym[0] if len(y_sym) == 1 else y_sym)
    loss = _compat.compile_loss(model)
    if loss is not None and not loss.built:
        _compat.compute_output_spec(lambda a, b, c: loss(a, b, c), y_true, y_pred, sw_sym)
    metrics = _compat.compile_metrics(model)
    if metrics is not None and not metrics.built:
        _compat.compute_output_spec(lambda a, b, c: metrics.update_state(a, b, sample_weight=c),
                                    y_true, y_pred, sw_sym)


def _outputs(model, functional, x_sym, rows):
    """What the model returns on `x_sym`, read off a functional graph whose outputs are
    static past the batch and whose inputs take the data as it is: tracing the whole
    model symbolically on every rank costs seconds on a deep model. None otherwise
    (the trace then gives the shapes the data makes, or Keras's error for data that
    does not fit), and for a model whose own `call` replaces the graph's."""
    if functional is None or _compat.overrider(model, "call") is not None:
        return None
    inputs = _compat.tree.flatten(_compat.input_structure(functional))
    outputs = _compat.tree.flatten(_compat.output_structure(functional))
    if len(inputs) != len(x_sym) or any(
            len(i.shape) != len(x.shape) or any(a is not None and a != b
                                                for a, b in zip(i.shape[1:], x.shape[1:]))
            for i, x in zip(inputs, x_sym)):
        return None
    if any(d is None for o in outputs for d in o.shape[1:]):
        return None
    return _compat.pack_outputs(functional, [_compat.symbolic((rows,) + tuple(o.shape[1:]),
                                                              o.dtype) for o in outputs])


def check_model(model, sample):
    if not isinstance(model, keras.Model):
        raise TypeError(f"`model` must be a keras.Model. Received: model={type(model).__name__}")
    if sample.y is not None and not _compat.is_compiled(model):
        raise ValueError(
            f"Model {model.name!r} is not compiled: call model.compile(optimizer=..., loss=...) "
            "before hyparflow.fit or hyparflow.evaluate, as before model.fit."
        )
