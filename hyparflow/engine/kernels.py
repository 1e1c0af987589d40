"""Dense layers whose input gradient runs at forward speed on microbatches, and the
kernels whose gradient a split backward defers to W (Dense, EinsumDense, Conv2D).

TensorFlow computes a Dense layer's input gradient as `dy @ W^T` with the
transposition folded into the product (`transpose_b`). On this kind of CPU, at
the row counts a microbatch has, that product ran three times slower per flop
than the forward `x @ W` (one thread, 1024 x 1024: 6 against 20 GFLOPS at 32
rows, 10 against 24 at 64, 17 against 26 at 256). The weights do not change
within a step, so a stage keeps each such layer's `W^T` materialised, copied
once per step before its first microbatch, and its backward multiplies by it:
the same product, at forward speed, for the price of one copy of the kernel.

The copy is not free (about as long as a product of a few hundred rows), and how
much the folded product loses depends on the CPU and the row count: on a CPU with
AVX-512 the folded product at 128 rows was only 1.4x slower, and one copy cost more
than it saved. So the first training step measures, per kernel shape, one copy
against the step's products (`pays`), and keeps `W^T` only where it saves time.
The two products round differently at some shapes, so the ranks that hold a layer
agree on one choice and a checkpoint records it (`Executor.choices`): a resume
runs the same products as the run it continues.

Only plain `keras.layers.Dense` calls take this path, in float32, without LoRA,
quantization or an activity regulariser, and only where the input gradient is
wanted (not on a stage's data inputs). `HYPARFLOW_TRANSPOSED=0` turns it off, `1`
keeps every `W^T` without timing.
"""

import threading
import time

import keras
import tensorflow as tf

from .. import _compat
from .. import settings

__all__ = ["Transposed", "eligible", "enabled", "pays", "deferrable", "deferred_nodes", "deferred_call",
           "weight_grad"]


def enabled():
    return settings.transposed() is not False


def eligible(op, input_dtype):
    """Whether layer call `op` on an input of `input_dtype` may use `Transposed`."""
    return (type(op) is keras.layers.Dense and op.built and not op.lora_enabled
            and op.quantization_mode is None and op.activity_regularizer is None
            and op.compute_dtype == "float32" and op.kernel.dtype == "float32"
            and input_dtype == "float32" and len(op.kernel.shape) == 2)


_PAYS: dict = {}  # (kernel shape, rows, products per step) -> whether W^T pays
_MEASURING = threading.Lock()  # ranks run as threads (hyparflow.local) measure once
_COLD_BYTES = 32 << 20  # more than a CPU's caches keep of what the step touched last


def _fastest(fn, items):
    """The shortest of `fn(item)` over `items` (after one call that allocates)."""
    fn(items[0])
    best = float("inf")
    for item in items[1:]:
        start = time.perf_counter()
        fn(item)
        best = min(best, time.perf_counter() - start)
    return best


def pays(kernel, rows, uses):
    """Whether keeping `kernel`'s `W^T` saves time in a step that computes `uses`
    input gradients of `rows` rows each: the products' gain against one copy, each
    timed on kernels and copies the caches do not hold (as in a step, where the
    optimizer wrote every kernel since the last read), once per shape in a process."""
    if settings.transposed():
        return True  # forced: no timing, so every run takes the same products
    key = (tuple(kernel.shape), int(rows), int(uses))
    with _MEASURING:
        if key not in _PAYS:
            _PAYS[key] = _measure(kernel, rows, uses)
    return _PAYS[key]


def _measure(kernel, rows, uses):
    w = tf.convert_to_tensor(kernel.value)
    count = max(2, min(9, _COLD_BYTES // max(1, w.shape[0] * w.shape[1] * 4)))
    sets = [(w + float(j), tf.Variable(tf.transpose(w), trainable=False))
            for j in range(count)]
    dy = tf.ones((max(1, int(rows)), w.shape[1]), w.dtype)
    folded = _fastest(lambda p: tf.matmul(dy, p[0], transpose_b=True), sets)
    plain = _fastest(lambda p: tf.matmul(dy, p[1]), sets)
    copy = _fastest(lambda p: p[1].assign(tf.transpose(p[0])), sets)
    return uses * (folded - plain) > copy


class Transposed:
    """A Dense layer's call with its `W^T` kept beside it for the backward."""

    def __init__(self, op):
        self.op = op
        self.wt = tf.Variable(tf.transpose(op.kernel.value), trainable=False,
                              name=f"{op.name}_kernel_t")

    def refresh(self):
        """Copy the kernel's current value, transposed (before each step)."""
        self.wt.assign(tf.transpose(self.op.kernel.value))

    def __call__(self, args, kwargs):
        op = self.op
        x = args[0] if args else kwargs["inputs"]
        mask = _compat.get_mask(x)
        wt = self.wt

        @tf.custom_gradient
        def product(x, kernel):
            flat = tf.reshape(x, (-1, x.shape[-1])) if x.shape.rank != 2 else x
            y = tf.matmul(flat, kernel)

            def grad(dy):
                dflat = tf.reshape(dy, (-1, dy.shape[-1])) if dy.shape.rank != 2 else dy
                dx = tf.matmul(dflat, wt)
                dkernel = tf.matmul(flat, dflat, transpose_a=True)
                return tf.reshape(dx, tf.shape(x)), dkernel

            if x.shape.rank != 2:
                y = tf.reshape(y, tf.concat([tf.shape(x)[:-1], [kernel.shape[-1]]], 0))
                y.set_shape(x.shape[:-1].concatenate([kernel.shape[-1]]))
            return y, grad

        y = product(x, op.kernel.value)
        if op.bias is not None:
            y = keras.ops.add(y, op.bias.value)
        if op.activation is not None:
            y = op.activation(y)
        if mask is not None:
            _compat.set_mask(y, mask)  # Dense passes its input's mask on
        return y


def defer_conv():
    """HYPARFLOW_DEFER_CONV=1: Conv2D kernels' gradients wait for W too (off by
    default: see docs/performance.md for what it measured)."""
    return settings.defer_conv()


def _plain_conv(op, input_dtype):
    return (type(op) is keras.layers.Conv2D and op.built and op.groups == 1
            and not getattr(op, "lora_enabled", False)
            and getattr(op, "quantization_mode", None) is None
            and op.activity_regularizer is None and op.compute_dtype == "float32"
            and op.kernel.dtype == "float32" and input_dtype == "float32")


def _plain_einsum(op, input_dtype):
    """A float32 EinsumDense (attention's projections) whose first input axis is the
    batch and stays the first output axis, so that W can stack microbatches' rows."""
    if not (type(op) is keras.layers.EinsumDense and op.built
            and not getattr(op, "lora_enabled", False)
            and getattr(op, "quantization_mode", None) is None
            and op.activity_regularizer is None and op.compute_dtype == "float32"
            and op.kernel.dtype == "float32" and input_dtype == "float32"):
        return False
    lhs, _, out = op.equation.replace(" ", "").partition("->")
    x, _, kernel = lhs.partition(",")
    if x.startswith("...") and out.startswith("..."):
        return True
    return bool(x) and bool(out) and x[0] == out[0] and x[0] not in kernel


def deferrable(op, input_dtype):
    """Whether layer call `op`'s kernel gradient can wait for a later, batched call
    (a split backward's W): a plain float32 Dense or EinsumDense (or, with
    `defer_conv`, Conv2D) whose kernel nothing but the product reads (no kernel
    regulariser, whose gradient would come in B)."""
    plain = (eligible(op, input_dtype) or _plain_einsum(op, input_dtype)
             or (defer_conv() and _plain_conv(op, input_dtype)))
    return plain and op.kernel_regularizer is None and op.kernel.trainable


def deferred_nodes(graph, nodes, exclude=()):
    """[(node, shape of its output without the batch)]: the Dense and EinsumDense
    calls among `nodes` (not in `exclude`: split over tensor ranks) whose kernel
    gradient a W can
    compute. The kernel must be read by this one call of the whole model (a shared
    layer's or a tied kernel's gradient sums over calls, which B computes), and
    every dimension but the batch known (W's zero inputs are made to measure)."""
    if graph.functional is None:
        return []
    calls, holders = {}, {}
    for node in graph.nodes:
        calls[id(node.op)] = calls.get(id(node.op), 0) + 1
        for v in getattr(node.op, "trainable_weights", ()):
            holders.setdefault(id(v), set()).add(id(node.op))
    out = []
    for i in nodes:
        node = graph.nodes[i]
        op = node.op
        if i in exclude or len(node.inputs) != 1 or len(node.outputs) != 1:
            continue
        if calls[id(op)] != 1 or not deferrable(op, graph.tensors[node.inputs[0]].dtype):
            continue
        if holders.get(id(op.kernel)) != {id(op)}:
            continue
        shape = tuple(graph.tensors[node.outputs[0]].shape[1:])
        if any(d is None for d in shape + tuple(graph.tensors[node.inputs[0]].shape[1:])):
            continue
        out.append((i, shape))
    return out


def deferred_call(op, args, kwargs, z, wt=None):
    """Dense call `op` for a split backward: `y = act(x @ stop_gradient(W) + b + z)`.
    `z` is a zero input of the shape of `x @ W`: its gradient is the product's
    output gradient, which W needs with `x` (returned too) for `x^T dy`. The
    kernel gets no gradient here; the bias does (cheap, in B). `wt`: the kept
    `W^T` (`Transposed`), so that the input gradient runs at forward speed."""
    x = args[0] if args else kwargs["inputs"]
    mask = _compat.get_mask(x)
    kernel = tf.stop_gradient(op.kernel.value)
    if isinstance(op, keras.layers.EinsumDense):
        # As EinsumDense.call, with the kernel stopped and z added to the product.
        y = keras.ops.einsum(op.equation, x, kernel) + z
        if op.bias is not None:
            y = keras.ops.add(y, op.bias.value)
        if op.activation is not None:
            y = op.activation(y)
        return y, x
    if isinstance(op, keras.layers.Conv2D):
        # As BaseConv.call, with the kernel stopped and z added to the product.
        y = op.convolution_op(x, kernel) + z
        if op.use_bias:
            shape = ((1,) * 3 + (op.filters,) if op.data_format == "channels_last"
                     else (1, op.filters, 1, 1))
            y = keras.ops.add(y, keras.ops.reshape(op.bias.value, shape))
        if op.activation is not None:
            y = op.activation(y)
        return y, x
    flat = tf.reshape(x, (-1, x.shape[-1])) if x.shape.rank != 2 else x
    if wt is not None:
        wt_value = wt.wt

        @tf.custom_gradient
        def product(flat):
            def grad(dy):
                return tf.matmul(dy, wt_value)
            return tf.matmul(flat, kernel), grad

        y = product(flat)
    else:
        y = tf.matmul(flat, kernel)
    if x.shape.rank != 2:
        y = tf.reshape(y, tf.concat([tf.shape(x)[:-1], [kernel.shape[-1]]], 0))
        y.set_shape(x.shape[:-1].concatenate([kernel.shape[-1]]))
    y = y + z
    if op.bias is not None:
        y = keras.ops.add(y, op.bias.value)
    if op.activation is not None:
        y = op.activation(y)
    if mask is not None:
        _compat.set_mask(y, mask)
    return y, x


def weight_grad(op, x, dy):
    """A deferred kernel's gradient over all rows: `x^T dy` for a Dense (any leading
    shape); an EinsumDense's or a Conv2D's by TensorFlow's gradient of its product."""
    if isinstance(op, (keras.layers.Conv2D, keras.layers.EinsumDense)):
        kernel = op.kernel.value
        with tf.GradientTape() as tape:
            tape.watch(kernel)
            y = (keras.ops.einsum(op.equation, x, kernel)
                 if isinstance(op, keras.layers.EinsumDense) else op.convolution_op(x, kernel))
        return tape.gradient(y, kernel, output_gradients=dy)
    flat_x = tf.reshape(x, (-1, x.shape[-1]))
    flat_dy = tf.reshape(dy, (-1, dy.shape[-1]))
    return tf.matmul(flat_x, flat_dy, transpose_a=True)
