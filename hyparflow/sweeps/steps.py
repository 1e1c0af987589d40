"""The array's compiled functions: a training step (forward, each member's loss and
metrics, backward, the fused optimizer) and a validation step.

Every member's loss is its own compiled loss on its own outputs, plus its
regularization, times its replica's share of the global batch; the step differentiates
their sum, whose gradient with respect to member p's weights is member p's own. With
replicas the gradient step is split in two: the gradients come back, are summed over
the replicas (dense ones added in rank order, an Embedding's pairs gathered in the
global batch's order), and go to the optimizer's step.
"""

import numpy as np
import tensorflow as tf

from .. import _compat
from ..engine.comm import timeout_seconds
from .fuse import Context

__all__ = ["Steps"]


def _tensor(a):
    return None if a is None else tf.convert_to_tensor(a)


class Steps:
    """Compiled steps of `array` (fuse.Array) and its `optimizer` (optimizers.Fused) over
    the numpy `data` (data.Data) and `validation` (or None); `comm`: the group's
    communicator over its replicas (None for one)."""

    def __init__(self, array, optimizer, data, validation, comm):
        self.array, self.optimizer, self.comm = array, optimizer, comm
        self.replicas = comm.size if comm is not None else 1
        self.models = array.models
        self.functionals = [_compat.functional_of(m) for m in self.models]
        self.data = self._tensors(data)
        self.validation = self._tensors(validation) if validation is not None else None
        self.variables = [s.variable for s in array.trainable]
        if optimizer is None:
            pass        # validation only
        elif self.replicas == 1:
            self._train = tf.function(self._train_apply, reduce_retracing=True,
                                         autograph=False)
        else:
            self._gradients = tf.function(self._train_gradients, reduce_retracing=True,
                                         autograph=False)
            self._apply = tf.function(self._apply_step, reduce_retracing=True,
                                         autograph=False)
        self._evaluate = tf.function(self._evaluate_step, reduce_retracing=True,
                                         autograph=False)

    @staticmethod
    def _tensors(data):
        sw = data.sample_weight    # hyparflow.data keeps a list: one for all outputs here
        if sw is not None:
            if len(sw) != 1 or getattr(data, "per_output", False):
                raise ValueError("hf.sweep takes one sample_weight array for all outputs; "
                                 f"received {len(sw)} (one per output). Pass one array.")
            sw = sw[0]
        return ([_tensor(a) for a in data.x], [_tensor(a) for a in data.y], _tensor(sw))

    # inside the compiled functions -------------------------------------------------------
    def _contributions(self, data, idx, training, share, context):
        xs, ys, sw = data
        inputs = [tf.gather(a, idx) for a in xs]                 # [N, b, ...]
        targets = [tf.gather(a, idx) for a in ys]
        weights = tf.gather(sw, idx) if sw is not None else None
        outputs, activity = self.array.forward(inputs, training, context)
        contributions = []
        for p, model in enumerate(self.models):
            y_pred = _compat.pack_outputs(self.functionals[p], [o[p] for o in outputs])
            y_true = targets[0][p] if len(targets) == 1 else [t[p] for t in targets]
            sample_weight = weights[p] if weights is not None else None
            loss = _compat.call_compile_loss(_compat.compile_loss(model), y_true, y_pred,
                                             sample_weight, share)
            extra = [tf.cast(tf.reduce_sum(l), tf.float32)
                     for l in activity[p] + self.array.regularization(p)]
            total = tf.cast(loss, tf.float32)
            if extra:
                total = total + tf.add_n(extra)
            metrics = _compat.compile_metrics(model)
            if metrics is not None:
                metrics.update_state(y_true, y_pred, sample_weight=sample_weight)
            contributions.append(share * total)
        return tf.stack(contributions)

    def _differentiate(self, idx, share, rows):
        with tf.GradientTape() as tape:
            contributions = self._contributions(self.data, idx, True, share,
                                                Context(rows))
            total = tf.reduce_sum(contributions)
        return contributions, tape.gradient(total, self.variables)

    def _train_apply(self, idx, share):
        contributions, grads = self._differentiate(idx, share, None)
        self._apply_step(grads)
        return contributions

    def _train_gradients(self, idx, share, start, total):
        return self._differentiate(idx, share, (start, total))

    def _apply_step(self, grads):
        self.optimizer.apply(list(grads))
        self.array.apply_constraints()

    def _evaluate_step(self, idx, share):
        return self._contributions(self.validation, idx, False, share, Context(None))

    # called per step ---------------------------------------------------------------------
    def train(self, idx, share, start, total):
        """One step of every member on its rows `idx` ([N, b], of the global batch's
        `total` rows this replica's from `start`); returns the members' loss
        contributions (numpy [N])."""
        idx = tf.constant(idx, tf.int32)
        share = tf.constant(share, tf.float32)
        if self.replicas == 1:
            return self._train(idx, share).numpy()
        contributions, grads = self._gradients(idx, share, tf.constant(start, tf.int32),
                                               tf.constant(total, tf.int32))
        self._apply(self._sum_over_replicas(grads))
        return contributions.numpy()

    def evaluate(self, idx, share):
        return self._evaluate(tf.constant(idx, tf.int32), tf.constant(share, tf.float32)).numpy()

    def _sum_over_replicas(self, grads):
        """Dense gradients summed over the group's replicas (in rank order, the same bits
        everywhere); sparse ones' pairs gathered, replica by replica: the global batch's
        pairs in its order."""
        dense = [k for k, g in enumerate(grads) if g is not None
                 and not isinstance(g, tf.IndexedSlices)]
        out = list(grads)
        if dense:
            arrays = [np.asarray(grads[k]) for k in dense]
            flat = np.concatenate([a.reshape(-1) for a in arrays]).astype(np.float32)
            self.comm.allreduce(flat, timeout_seconds())
            start = 0
            for k, a in zip(dense, arrays):
                out[k] = tf.constant(flat[start:start + a.size].reshape(a.shape))
                start += a.size
        for k, g in enumerate(grads):
            if isinstance(g, tf.IndexedSlices):
                parts = self.comm.allgather_obj((g.indices.numpy(), g.values.numpy()))
                out[k] = tf.IndexedSlices(tf.constant(np.concatenate([v for _, v in parts])),
                                          tf.constant(np.concatenate([i for i, _ in parts])),
                                          g.dense_shape)
        return out
