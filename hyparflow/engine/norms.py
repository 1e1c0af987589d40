"""BatchNormalization in training as one fused kernel.

Keras 3 normalizes a batch in training with separate operations: `tf.nn.moments`
(two reductions), then `tf.nn.batch_normalization`; its backward is the autodiff of
all of them. TensorFlow's `FusedBatchNormV3` does the same in one forward kernel and
one backward kernel. On a one-thread rank of ResNet-56 (batch 32) the fused step was
14 % shorter (docs/performance.md, "BatchNormalization as one kernel"). The
mathematics is the same; the rounding differs, as a stage cut changes it: weights
after training agree with model.fit's to float32 round-off. Against float64, one call
rounds as little as Keras's operations up to 64 values per channel (the few-values case
included: no floor), its output up to 2.5 times as much at thousands
(benchmarks/norms_roundoff.py; docs/models.md, "BatchNormalization").

A call takes this path only where it is what Keras would compute: a plain, built
`keras.layers.BatchNormalization`, trainable, in training, float32 in and out,
statistics over every axis but the last, no renorm, no synchronized statistics, no
mask. Anything else is Keras's own call. `HYPARFLOW_FUSED_NORM=0` turns the path off.
"""

from typing import Any, Container, Dict, Iterable

import keras
import tensorflow as tf

from .. import _compat
from .. import settings

__all__ = ["Fused", "eligible", "fused_nodes"]


def eligible(op, input_dtype):
    """Whether layer call `op` on an input of `input_dtype` may run as `Fused`."""
    if not settings.fused_norm():
        return False
    if type(op) is not keras.layers.BatchNormalization or not op.built:
        return False
    spec = op.input_spec
    ndim = getattr(spec, "ndim", None)
    if not isinstance(op.axis, int) or ndim is None or op.axis % ndim != ndim - 1:
        return False  # statistics over other axes than all but the last: Keras's call
    return (not op.renorm and not op.synchronized
            and op.compute_dtype == "float32" and op.moving_mean.dtype == "float32"
            and input_dtype == "float32")


def fused_nodes(graph: Any, nodes: Iterable[int],
                exclude: Container[int] = ()) -> Dict[int, "Fused"]:
    """{node: Fused} for the calls among `nodes` (not in `exclude`) that may take the path."""
    out = {}
    for i in nodes:
        node = graph.nodes[i]
        if (i not in exclude and len(node.inputs) == 1
                and eligible(node.op, graph.tensors[node.inputs[0]].dtype)):
            out[i] = Fused(node.op)
    return out


class Fused:
    """A BatchNormalization layer's training call through `FusedBatchNormV3`."""

    def __init__(self, op):
        self.op = op

    def _takes(self, x, mask):
        op = self.op
        return (op.trainable and mask is None and x.dtype == tf.float32
                and x.shape.rank is not None and x.shape.rank >= 2
                and op.axis % x.shape.rank == x.shape.rank - 1)

    def __call__(self, args, kwargs):
        op = self.op
        x = args[0] if args else kwargs["inputs"]
        mask = kwargs.get("mask")
        if mask is None:
            mask = _compat.get_mask(x)
        if not self._takes(x, mask):
            return _compat.call_operation(op, args, kwargs, True)
        channels = x.shape[-1]
        shape = tf.shape(x)
        # Every axis but the channels' is a statistics axis: as NHWC with H = the
        # rest and W = 1, without a copy.
        flat = tf.reshape(x, tf.stack([shape[0], -1, 1, channels]))
        scale = op.gamma.value if op.scale else tf.ones((channels,), tf.float32)
        offset = op.beta.value if op.center else tf.zeros((channels,), tf.float32)
        y, mean, variance, _, _, _ = tf.raw_ops.FusedBatchNormV3(
            x=flat, scale=scale, offset=offset, mean=tf.zeros((0,), tf.float32),
            variance=tf.zeros((0,), tf.float32), epsilon=op.epsilon,
            exponential_avg_factor=1.0, data_format="NHWC", is_training=True)
        # The kernel returns the sample variance (n / (n - 1) of the batch's, n / 1
        # for one value); the moving variance, as Keras's, follows the batch's own.
        n = tf.cast(tf.size(x) // channels, tf.float32)
        variance = variance * (tf.maximum(n - 1.0, 1.0) / n)
        momentum = op.momentum
        op.moving_mean.assign(op.moving_mean.value * momentum + mean * (1.0 - momentum))
        op.moving_variance.assign(op.moving_variance.value * momentum
                                  + variance * (1.0 - momentum))
        y = tf.reshape(y, shape)
        y.set_shape(x.shape)
        return y
