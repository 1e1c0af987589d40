"""Per-layer-call profiles on this machine: forward+backward time, parameter, optimizer
and activation bytes; and a rank's speed, for heterogeneous balancing."""

import statistics
import time
from dataclasses import asdict, dataclass

import numpy as np
import tensorflow as tf

from . import _compat
from . import settings
from .clock import timed
from .planner import Row

__all__ = ["LayerProfile", "profile", "optimizer_slots", "calibrate", "slowdown", "fit_model",
           "model_step", "optimizer_step", "timed", "load_model"]


@dataclass
class LayerProfile:
    name: str
    seconds: float          # forward + backward of one call on `batch` samples
    batch: int
    param_bytes: int        # weights first used by this call (a shared layer counts once)
    optimizer_bytes: int    # optimizer state for those weights
    activation_bytes: int   # output bytes per sample (kept for the backward)

    def to_dict(self):
        return asdict(self)


def slowdown():
    """HYPARFLOW_SLOWDOWN=f makes this rank f times slower (a test stand-in for a slower
    CPU: every stage computation and the calibration sleep (f-1) times their duration)."""
    return settings.slowdown()


def optimizer_slots(optimizer):
    """How many per-weight state tensors `optimizer` keeps (SGD 0, momentum 1, Adam 2)."""
    import keras

    probe = optimizer.__class__.from_config(optimizer.get_config())
    weight = keras.Variable(np.zeros((3,), "float32"), name="probe")
    probe.build([weight])
    return sum(1 for v in probe.variables if tuple(v.shape) == (3,))


def _dummy(tensor, batch):
    shape = (batch,) + tuple(d if d is not None else 8 for d in tensor.shape[1:])
    if tensor.floating:
        return tf.random.normal(shape, dtype=tf.as_dtype(tensor.dtype))
    return tf.zeros(shape, dtype=tf.as_dtype(tensor.dtype))


def profile(graph, model, batch=32, repeats=3):
    """Measure every layer call of `graph` alone, eagerly, on random inputs of `batch`
    samples (median of `repeats` after one warm-up)."""
    slots = optimizer_slots(model.optimizer) if getattr(model, "optimizer", None) else 0
    seen, out = set(), []
    factor = slowdown()
    for node in graph.nodes:
        op = node.op
        if graph.functional is None:
            inputs = [_dummy(graph.tensors[t], batch) for t in node.inputs]
            args, kwargs = ([inputs[0] if len(inputs) == 1 else inputs], {})
            floats = inputs
        else:
            values = {id(graph.tensors[t].keras_tensor): _dummy(graph.tensors[t], batch)
                      for t in node.inputs}
            args, kwargs = _compat.fill_in(node.keras_node, values)
            floats = [v for v in values.values() if v.dtype.is_floating]
        variables = list(getattr(op, "trainable_weights", ()))

        def run():
            with tf.GradientTape() as tape:
                tape.watch(floats)
                out_ = _compat.call_operation(op, args, kwargs, True)
                flat = [o for o in _compat.tree.flatten(out_) if o.dtype.is_floating]
                target = tf.add_n([tf.reduce_sum(tf.cast(o, tf.float32)) for o in flat]) if flat else None
            if target is not None and (variables or floats):
                tape.gradient(target, variables + floats)

        run()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            run()
            times.append((time.perf_counter() - start) * factor)
        weights = [v for v in getattr(op, "weights", ()) if id(v) not in seen]
        seen.update(id(v) for v in weights)
        params = sum(int(np.prod(v.shape)) * np.dtype(str(v.dtype) if v.dtype != "bfloat16" else "float16").itemsize
                     for v in weights)
        trainable = sum(int(np.prod(v.shape)) * 4 for v in weights if v.trainable)
        acts = sum(int(np.prod([d or 1 for d in graph.tensors[t].shape[1:]])) *
                   (2 if graph.tensors[t].dtype in ("bfloat16", "float16") else 4) for t in node.outputs)
        out.append(LayerProfile(node.name, statistics.median(times), batch, params,
                                trainable * slots, acts))
    return out


def calibrate(seconds=0.2):
    """This rank's speed: matrix multiplies per second on its threads (relative units)."""
    a = tf.random.normal((256, 256))
    fn = tf.function(lambda x: tf.matmul(x, x))
    fn(a).numpy()
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        fn(a).numpy()
        count += 1
    elapsed = time.perf_counter() - start
    factor = slowdown()
    if factor > 1:
        time.sleep((factor - 1) * elapsed)
        elapsed *= factor
    return count / elapsed


def model_step(graph, model, batch):
    """The whole model's forward and backward on `batch` random samples, compiled as a
    stage compiles its own (traced and run once here): a callable."""
    xs = [_dummy(graph.tensors[t], batch) for t in graph.inputs]
    variables = model.trainable_weights

    @tf.function
    def step(xs):
        with tf.GradientTape() as tape:
            out = model(xs[0] if len(xs) == 1 else xs, training=True)
            flat = [o for o in tf.nest.flatten(out) if o.dtype.is_floating]
            target = tf.add_n([tf.reduce_sum(tf.cast(o, tf.float32)) for o in flat])
        return tape.gradient(target, variables)

    step(xs)
    return lambda: step(xs)


def optimizer_step(model):
    """A copy of the model's optimizer applying gradients to copies of its weights,
    compiled and run once: (callable, bytes of trainable weights it updates)."""
    probe = model.optimizer.__class__.from_config(model.optimizer.get_config())
    variables = model.trainable_weights
    copies = [tf.Variable(v.numpy()) for v in variables]
    # Arguments, not captured constants: TensorFlow folds a step by constant zeros
    # down to almost nothing (SGD timed 1.75x fast).
    grads = [tf.random.normal(v.shape, stddev=1e-6, dtype=v.dtype) for v in copies]
    apply = tf.function(lambda gs: probe.apply(gs, copies))
    apply(grads)
    return (lambda: apply(grads)), sum(int(np.prod(v.shape)) * 4 for v in variables) or 1


def fit_model(graph, model, batches=(8, 32), repeats=5):
    """Per layer call a `planner.Row` (fixed s, s per sample, param bytes, optimizer
    bytes, activation bytes per sample); and the optimizer step's seconds per
    parameter byte.

    The calls are profiled one at a time, eagerly, at both batch sizes; at each size
    they are scaled to add up to the whole model's compiled step (what the stages
    run, with far less overhead per call), then fitted affine in the batch. The
    compiled whole is steady where one eager call is not, so the sum is right and
    the profiles only share it out."""
    rows = []
    scaled = []
    for b in batches:
        layers = profile(graph, model, batch=b, repeats=3)
        whole = timed(model_step(graph, model, b), repeats) * slowdown()
        total = sum(p.seconds for p in layers)
        scaled.append([p.seconds * whole / total if total > 0 else whole / len(layers)
                       for p in layers])
    lo, size = batches[0], batches[1] - batches[0]
    for p, t_lo, t_hi in zip(layers, *scaled):
        slope = max(0.0, (t_hi - t_lo) / size)
        rows.append(Row(max(0.0, t_lo - slope * lo), slope, p.param_bytes, p.optimizer_bytes,
                        p.activation_bytes))
    step, nbytes = optimizer_step(model)
    return rows, timed(step, 3) / nbytes


def load_model(source, function="build_model"):
    """A model from a `.keras` file, or from calling `function` in a Python file."""
    import keras

    if source.endswith(".keras"):
        return keras.saving.load_model(source)
    namespace = {"__name__": "hyparflow_plan_model", "__file__": source}
    with open(source) as f:
        exec(compile(f.read(), source, "exec"), namespace)  # the user's own model file
    if function not in namespace:
        raise ValueError(f"{source} defines no function {function!r} (use --function NAME).")
    return namespace[function]()
