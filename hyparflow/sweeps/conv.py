"""The sweep's Conv1D/2D/3D kind: one grouped convolution where the runtime trains one,
else each member's own convolution.

A grouped convolution (the members' channels side by side, N x groups groups) runs the N
members in one kernel, but not every TensorFlow build trains one: on CPUs without oneDNN
(`TF_ENABLE_ONEDNN_OPTS=0`, builds without it) the filter gradient's kernel
(Conv2DBackpropFilter) has no groups and fails at the first step with "filter_size does
not have enough elements"; Conv3D's CPU kernels have no groups with or without oneDNN.
So each layer's grouped convolution is tried once, at its shapes, forward and both
gradients, before the sweep's first step; where it fails, the kind runs each member's
convolution with Keras's own op (what the member's own fit runs), stacked.
"""

import math

import keras
import tensorflow as tf
from keras import ops

from .kinds import Kind, _plain

__all__ = ["Conv", "grouped_trains"]

# (rank, kernel, strides, dilations, padding, channels, filters, groups) -> whether it trains
_TRIED: dict[tuple, bool] = {}


def grouped_trains(rank, kernel_size, strides, dilations, padding, channels, filters, groups):
    """Whether this runtime runs and differentiates (input and filter) a grouped
    convolution of `groups` groups of `channels` -> `filters` (per group), tried once
    on a small input inside a tf.function, as the sweep's step runs it."""
    key = (rank, tuple(kernel_size), tuple(strides), tuple(dilations), padding, channels,
           filters, groups)
    if key not in _TRIED:
        # Asked eagerly, where the kinds are made (not tf.init_scope: it pauses the
        # gradient tapes, and the try would see no gradient).
        _TRIED[key] = _try_grouped(*key)
    return _TRIED[key]


def _try_grouped(rank, kernel_size, strides, dilations, padding, channels, filters, groups):
    space = [(k - 1) * d + 2 * s + 1 for k, s, d in zip(kernel_size, strides, dilations)]
    x = tf.reshape(tf.range(2 * groups * channels * math.prod(space), dtype=tf.float32)
                   % 7.0 - 3.0, [2] + space + [groups * channels])
    k = tf.reshape(tf.range(math.prod(kernel_size) * channels * groups * filters,
                            dtype=tf.float32) % 5.0 - 2.0,
                   list(kernel_size) + [channels, groups * filters])

    @tf.function(autograph=False)
    def step(x, k):
        with tf.GradientTape() as tape:
            tape.watch([x, k])
            y = tf.nn.convolution(x, k, strides=list(strides), padding=padding,
                                  dilations=list(dilations))
            loss = tf.reduce_sum(y * y)
        return tape.gradient(loss, [x, k])

    try:
        dx, dk = step(x, k)
        return dx.shape == x.shape and dk.shape == k.shape
    except (tf.errors.OpError, ValueError):
        return False


class Conv(Kind):
    """Conv1D/2D/3D (channels last): the members' input channels side by side, their
    filters side by side, one convolution with N x groups groups; or, where the runtime
    cannot train that (grouped_trains), each member's own convolution."""

    classes = (keras.layers.Conv1D, keras.layers.Conv2D, keras.layers.Conv3D)
    varying = frozenset({"activation"})

    @classmethod
    def accepts(cls, layer, calls):
        return (super().accepts(layer, calls) and _plain(layer)
                and layer.data_format == "channels_last")

    def __init__(self, layers, slot):
        super().__init__(layers, slot)
        layer = self.layers[0]
        padding = "VALID" if layer.padding == "causal" else layer.padding.upper()
        kernel = layer.kernel.shape                              # [*k, C/g, F]
        self.grouped = grouped_trains(layer.rank, layer.kernel_size, layer.strides,
                                      layer.dilation_rate, padding, kernel[-2],
                                      kernel[-1] // layer.groups, self.n * layer.groups)

    def call(self, args, kwargs, training, ctx):
        x = args[0]                                              # [N, b, *space, C]
        layer = self.layers[0]
        rank = layer.rank
        padding = layer.padding
        if padding == "causal":                                  # Conv1D: Keras pads first
            left = layer.dilation_rate[0] * (layer.kernel_size[0] - 1)
            x = ops.pad(x, [[0, 0], [0, 0], [left, 0], [0, 0]])
            padding = "valid"
        kernel = self.weight(layer.kernel)                       # [N, *k, C/g, F]
        filters = kernel.shape[-1]
        if self.grouped:
            y = self._grouped(x, kernel, padding)
        else:
            # Keras's own op on each member's value and kernel, as its own layer runs it.
            y = tf.stack([ops.conv(x[p], kernel[p], strides=layer.strides, padding=padding,
                                   data_format="channels_last",
                                   dilation_rate=layer.dilation_rate)
                          for p in range(self.n)])
        if layer.use_bias:
            bias = tf.reshape(self.weight(layer.bias), [self.n] + [1] * (rank + 1) + [filters])
            y = ops.add(y, bias)
        return self._activate(y)

    def _grouped(self, x, kernel, padding):
        layer = self.layers[0]
        rank = layer.rank
        filters = kernel.shape[-1]
        # [N, b, *space, C] -> [b, *space, N * C]
        perm = list(range(1, rank + 2)) + [0, rank + 2]
        shape = tf.shape(x)
        grouped = tf.reshape(tf.transpose(x, perm),
                             tf.concat([shape[1:rank + 2], [-1]], 0))
        # [N, *k, C/g, F] -> [*k, C/g, N * F]
        kperm = list(range(1, rank + 2)) + [0, rank + 2]
        k = tf.reshape(tf.transpose(kernel, kperm), list(kernel.shape[1:-1]) + [-1])
        # TensorFlow's own grouped convolution, not keras.ops.conv: Keras compiles a grouped
        # one with XLA on CPUs, which made a step of 16 digits CNNs take 200 ms here, against
        # 24 ms with 16 separate convolutions and 7 ms grouped without XLA (the same
        # values as each member's own convolution, forward and backward).
        y = tf.nn.convolution(grouped, k, strides=list(layer.strides), padding=padding.upper(),
                              dilations=list(layer.dilation_rate))
        # [b, *space', N * F] -> [N, b, *space', F]
        out = tf.shape(y)
        y = tf.reshape(y, tf.concat([out[:-1], [self.n, filters]], 0))
        return tf.transpose(y, [rank + 1] + list(range(rank + 1)) + [rank + 2])
