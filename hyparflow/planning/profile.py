"""The planner's profiles: the model's compiled step, the optimizer step, and per layer
call a cost model `Row` fitted at two batch sizes (`fit_model`); the model a plan is
made for, loaded from a file. The per-call profiles and a rank's calibrated speed
that training's balance modes use live in `costs` (the training path must not load
the planning wing); they are re-exported here. Models and tensors are Keras's and
TensorFlow's (untyped: Any)."""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Sequence, Tuple

import numpy as np
import tensorflow as tf

from ..clock import timed
from ..graph import LayerGraph
from .costmodel import Row
from ..loop.costs import LayerProfile, _dummy, calibrate, optimizer_slots, profile, slowdown

__all__ = ["LayerProfile", "profile", "optimizer_slots", "calibrate", "slowdown", "fit_model",
           "model_step", "optimizer_step", "timed", "load_model"]


def model_step(graph: LayerGraph, model: Any, batch: int) -> Callable[[], Any]:
    """The whole model's forward and backward on `batch` random samples, compiled as a
    stage compiles its own (traced and run once here): a callable."""
    xs = [_dummy(graph.tensors[t], batch) for t in graph.inputs]
    variables = model.trainable_weights

    @tf.function
    def step(xs: List[Any]) -> Any:
        with tf.GradientTape() as tape:
            out = model(xs[0] if len(xs) == 1 else xs, training=True)
            flat = [o for o in tf.nest.flatten(out) if o.dtype.is_floating]
            target = tf.add_n([tf.reduce_sum(tf.cast(o, tf.float32)) for o in flat])
        return tape.gradient(target, variables)

    step(xs)
    return lambda: step(xs)


def optimizer_step(model: Any) -> Tuple[Callable[[], Any], int]:
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


def fit_model(graph: LayerGraph, model: Any, batches: Sequence[int] = (8, 32),
              repeats: int = 5) -> Tuple[List[Row], float]:
    """Per layer call a `planner.Row` (fixed s, s per sample, param bytes, optimizer
    bytes, activation bytes per sample); and the optimizer step's seconds per
    parameter byte.

    The calls are profiled one at a time, eagerly, at both batch sizes; at each size
    they are scaled to add up to the whole model's compiled step (what the stages
    run, with far less overhead per call), then fitted affine in the batch. The
    compiled whole is steady where one eager call is not, so the sum is right and
    the profiles only share it out."""
    rows: List[Row] = []
    scaled: List[List[float]] = []
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


def load_model(source: str, function: str = "build_model") -> Any:
    """A model from a `.keras` file, or from calling `function` in a Python file."""
    import keras

    if source.endswith(".keras"):
        _import_modules(source + ".modules.json")
        return keras.saving.load_model(source)
    return load_function(source, function)()


def _import_modules(listed: str) -> None:
    """Import the modules a captured model's own layer classes come from
    (`loop/capture.py` lists them beside the .keras file), each under its name, so that
    Keras finds their classes when it loads the model."""
    import importlib.util
    import json
    import os
    import sys

    if not os.path.exists(listed):
        return
    with open(listed) as f:
        modules: Dict[str, str] = json.load(f)
    for name, path in modules.items():
        if name in sys.modules or not os.path.exists(path):
            continue
        sys.path.insert(0, os.path.dirname(path))
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            continue
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)


def load_function(source: str, function: str, flag: str = "--function") -> Any:
    """The function named `function` of the Python file `source`."""
    namespace: Dict[str, Any] = {"__name__": "hyparflow_plan_model", "__file__": source}
    with open(source) as f:
        exec(compile(f.read(), source, "exec"), namespace)  # the user's own model file
    if function not in namespace:
        raise ValueError(f"{source} defines no function {function!r} (use {flag} NAME).")
    return namespace[function]
