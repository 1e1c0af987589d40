"""Before a `Runtime`: arguments checked, an error agreed by every rank (and a failed
run ended cleanly), the model read as a layer graph, built as `model.fit` builds it."""

import sys

import keras
import numpy as np

from .. import _compat
from .. import graph as _graph
from . import errors as errors_

__all__ = ["check_positive", "agree_on_error", "fail", "x_shapes", "is_dataset", "read_graph",
           "build_like_fit"]


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


def x_shapes(x):
    """Shapes of the input arrays (or a dataset's first batch), for reading a
    subclassed model."""
    if is_dataset(x):
        import keras as _keras

        x = _keras.utils.unpack_x_y_sample_weight(next(iter(x)))[0]
    if isinstance(x, dict):
        leaves = list(x.values())
    elif isinstance(x, (list, tuple)):
        leaves = list(x)
    else:
        leaves = [x]
    return [np.shape(a) for a in leaves]


def _first_batch(x, batch_size):
    """The inputs of the first batch, in x's structure (what model.fit builds from)."""
    if is_dataset(x):
        return keras.utils.unpack_x_y_sample_weight(next(iter(x)))[0]
    return _compat.tree.map_structure(lambda a: np.asarray(a)[:batch_size], x)


def build_like_fit(model, x, batch_size):
    """Build an unbuilt model as `model.fit` does: symbolically, from the shapes and
    dtypes of the first batch. Every rank does it (before rank 0's weights are
    broadcast), so every rank has the same variables."""
    batch = _compat.tree.map_structure(
        lambda a: None if a is None else _compat.symbolic(np.shape(a),
                                                          getattr(a, "dtype", "float32")),
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
    graph = _graph.from_model(model, x_shapes(x))
    if graph.functional is None and num_stages > 1:
        raise ValueError(
            f"Model {model.name!r} is a subclassed keras.Model whose `call` hyparflow cannot "
            f"read, so it cannot be cut into stages (num_stages={num_stages}). Train it with "
            "num_stages=1 (data parallel, any num_replicas), or build it with the Functional "
            "API (keras.Model(inputs, outputs)) or keras.Sequential to pipeline it."
        )
    return graph
