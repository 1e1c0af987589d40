"""A model's own `train_step` (and `test_step`) run by each of R replicas on its rows of
the global batch (docs/models.md, "Customised training"): the sums that make the R
steps one step of the global batch, as Horovod's DistributedOptimizer makes them.

- Every optimizer the step uses (`model.optimizer`, and any other the model holds as an
  attribute: a GAN's two) combines the gradients over the replicas in its `apply`,
  before the update: sum over r of share_r * grads_r, share_r being replica r's rows
  over the global batch's. A step whose loss is a mean over its rows so gets the
  gradient of the global batch's mean, short last batches included, and every replica
  applies the same update.
- Every metric of `model.metrics` (the user's trackers, the compiled ones) computes its
  `result()` from its state summed over the replicas, so the logs the step returns, and
  the epoch's, are the global batch's. The state itself stays the replica's own.

The sums are gathers (every replica's values to every rank) added in rank order in
float64: the same bits on every rank and in every run, whatever the MPI. They run
inside the compiled step as `py_function`s on one token chain (`engine.order`), so
every rank makes them in the step's program order.
"""

from __future__ import annotations

from typing import Any, List, Sequence

import keras
import numpy as np
import tensorflow as tf

from . import order as _order
from .comm import timeout_seconds, wait_all

__all__ = ["ReplicaSums", "optimizers_of", "seed_generators_of"]


def optimizers_of(model: Any) -> List[Any]:
    """The optimizers a model's step may use: `model.optimizer`, then every other
    Keras optimizer it holds as an attribute (a GAN's `d_optimizer`, `g_optimizer`),
    each once, in attribute order (the same on every rank)."""
    found: List[Any] = []
    candidates = [getattr(model, "optimizer", None)] + [
        value for _, value in sorted(vars(model).items()) if not _.startswith("__")]
    for value in candidates:
        if isinstance(value, keras.optimizers.Optimizer) and all(value is not f for f in found):
            found.append(value)
    return found


def seed_generators_of(model: Any) -> List[Any]:
    """The SeedGenerators the model and its layers draw from, each once."""
    found: List[Any] = []
    layers = [model] + list(model._flatten_layers(include_self=False, recursive=True))
    for layer in layers:
        for gen in list(getattr(layer, "_seed_generators", ())) + [
                v for v in vars(layer).values() if isinstance(v, keras.random.SeedGenerator)]:
            if all(gen is not f for f in found):
                found.append(gen)
    return found


class ReplicaSums:
    """The replicas' sums for one `fit` or `evaluate` of a model with its own step over
    `comm` (one rank per replica). `shares`: each replica's rows over the global
    batch's, set before each step (`rows`). Use as a context manager: the model's
    optimizers and metrics are wrapped inside it and as they were after it."""

    def __init__(self, comm: Any, model: Any) -> None:
        self.comm, self.model = comm, model
        self.shares = [1.0 / comm.size] * comm.size
        # While False (outside the step's functions) a metric's result is the
        # replica's own; the loop sets it around the calls that must be global.
        self.active = False
        self._optimizers: List[Any] = []
        self._metrics: List[Any] = []

    def rows(self, sizes: Sequence[int]) -> None:
        """The rows of every replica's slice of this step's global batch (every rank
        knows them all: the same split everywhere)."""
        total = sum(sizes)
        self.shares = [n / total for n in sizes]

    def combine(self, arrays: Sequence[np.ndarray], weighted: bool) -> List[np.ndarray]:
        """sum over replicas of (share_r if `weighted` else 1) * arrays_r, added in rank
        order in float64, each back in its dtype: the same bits on every rank. The
        values travel in their own precision (float32 gradients as float32)."""
        comm = self.comm
        wire = np.result_type(np.float32, *[np.asarray(a).dtype for a in arrays])
        wire = wire if wire.kind == "f" else np.dtype(np.float64)   # integer states
        flat = np.concatenate([np.asarray(a, wire).reshape(-1) for a in arrays])
        everyone = np.empty(flat.size * comm.size, wire)
        wait_all([comm.iallgatherv(flat, everyone, [flat.size] * comm.size)],
                 timeout_seconds(), "the other replicas' gradients or metric states "
                 "(a model's own train_step: every replica must reach the same apply)")
        parts = everyone.reshape(comm.size, flat.size)
        weights = self.shares if weighted else [1.0] * comm.size
        total = parts[0].astype(np.float64) * weights[0]
        for r in range(1, comm.size):
            total += parts[r].astype(np.float64) * weights[r]   # rank order: same bits
        out, at = [], 0
        for a in arrays:
            a = np.asarray(a)
            out.append(total[at:at + a.size].reshape(a.shape).astype(a.dtype))
            at += a.size
        return out

    def _sum_tensors(self, tensors: Sequence[Any], weighted: bool) -> List[Any]:
        """`combine` as one operation of the step (a py_function on the token chain)."""
        tensors = [tf.convert_to_tensor(t) for t in tensors]

        def run(*values: Any) -> List[np.ndarray]:
            return self.combine([v.numpy() for v in values], weighted)

        out = _order.py_function(run, tensors, [t.dtype for t in tensors],
                                 name="hyparflow_replica_sum")
        out = list(out)
        for o, t in zip(out, tensors):
            o.set_shape(t.shape)
        return out

    # -- the wrappers -----------------------------------------------------------------

    def _wrap_apply(self, optimizer: Any) -> None:
        original = optimizer.apply   # the bound method, for Keras's own update

        def apply(grads: Any, trainable_variables: Any = None) -> Any:
            grads = list(grads)
            at = [i for i, g in enumerate(grads) if g is not None]
            if at and self.comm.size > 1:
                summed = self._sum_tensors([grads[i] for i in at], weighted=True)
                for i, s in zip(at, summed):
                    grads[i] = s
            return original(grads, trainable_variables)

        # An instance attribute: `apply_gradients` and Keras's own train_step call
        # `self.apply`, so both come here.
        object.__setattr__(optimizer, "apply", apply)
        self._optimizers.append(optimizer)

    def _wrap_result(self, metric: Any) -> None:
        original = type(metric).result

        def result() -> Any:
            variables = list(metric.variables)
            if not self.active or self.comm.size == 1 or not variables:
                return original(metric)
            summed = self._sum_tensors([v.value for v in variables], weighted=False)
            # Nested results (a wrapper's metrics) compute from the summed values below.
            self.active = False
            try:
                with keras.StatelessScope(state_mapping=list(zip(variables, summed))):
                    return original(metric)
            finally:
                self.active = True

        object.__setattr__(metric, "result", result)
        self._metrics.append(metric)

    def __enter__(self) -> ReplicaSums:
        for optimizer in optimizers_of(self.model):
            self._wrap_apply(optimizer)
        for metric in self.model.metrics:
            self._wrap_result(metric)
        return self

    def __exit__(self, *exc: object) -> None:
        for obj, name in [(o, "apply") for o in self._optimizers] + [
                (m, "result") for m in self._metrics]:
            obj.__dict__.pop(name, None)
        self._optimizers, self._metrics = [], []

    def global_results(self) -> Any:
        """`model.get_metrics_result()` from the states summed over the replicas
        (a collective; eager)."""
        self.active = True
        try:
            return self.model.get_metrics_result()
        finally:
            self.active = False
