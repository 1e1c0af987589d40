"""Fused kinds: how one layer of the N members runs once for all of them.

A fused value is every member's value stacked on a new leading axis: [N, batch, ...].
Each kind is an object made for one layer of the members (`layers`, by array position)
and called at each of that layer's calls (`call`); it reads its weights through
`weight(v)`: the array's variable that holds member 0's `v` and its siblings
(variables.Stacked). A kind computes what each member's own layer computes, with
Keras's own ops where they take the stacked operands, so that every member trains to
the weights its own `model.fit` gives:

- Dense / EinsumDense: one batched product over the [N, in, out] kernel;
- Conv1D / Conv2D / Conv3D: one grouped convolution where the runtime trains one,
  else each member's own (sweeps/conv.py);
- Embedding: one gather from the [N x V, D] table (gradients stay row pairs);
- BatchNormalization / LayerNormalization: statistics per member, momentum and epsilon
  per member;
- Dropout: each member's own rate and seed generator (the masks of its own fit);
- MultiHeadAttention: fused projections, the attention itself on the members folded
  into the batch (per member when some member has attention dropout);
- Fold: layers without weights that treat each sample alone (activations, pooling,
  element-wise, reshapes): the members folded into the batch, one call;
- Loop: anything else, once per member with the member's own layer (its own
  variables), the run says which.
"""

import keras
import tensorflow as tf
from keras import ops

from .. import _compat

__all__ = ["Kind", "Loop", "Fold", "config_differences", "COMMON_VARYING"]  # KINDS, choose: registry

# Config keys any two members of a sweep may differ in without changing the graph: the
# initial weights are taken from the built members, regularizers and constraints are
# applied per member.
COMMON_VARYING = frozenset({
    "name", "seed", "activity_regularizer",
    "kernel_initializer", "bias_initializer", "kernel_regularizer", "bias_regularizer",
    "kernel_constraint", "bias_constraint", "embeddings_initializer",
    "embeddings_regularizer", "embeddings_constraint", "beta_initializer",
    "gamma_initializer", "moving_mean_initializer", "moving_variance_initializer",
    "beta_regularizer", "gamma_regularizer", "beta_constraint", "gamma_constraint",
})


def config_differences(layers, varying):
    """[(member position, key, member 0's value, that member's value)] of the config keys
    outside `varying` in which a member's layer differs from member 0's."""
    def config(layer):
        try:
            return layer.get_config()
        except Exception:  # noqa: BLE001 - a layer without a config: compare its class only
            return {}

    first = config(layers[0])
    out = []
    for p, layer in enumerate(layers[1:], 1):
        other = config(layer)
        for key in sorted(set(first) | set(other)):
            if key in varying or key in COMMON_VARYING:
                continue
            if first.get(key) != other.get(key):
                out.append((p, key, first.get(key), other.get(key)))
    return out


def _is_tensor(value):
    return isinstance(value, (tf.Tensor, tf.Variable)) or tf.is_tensor(value)


def _fold(t):
    """[N, b, ...] -> [N * b, ...]."""
    return tf.reshape(t, tf.concat([[-1], tf.shape(t)[2:]], 0))


def _unfold(t, n):
    """[N * b, ...] -> [N, b, ...]."""
    return tf.reshape(t, tf.concat([[n, -1], tf.shape(t)[1:]], 0))


def _stack(outputs):
    """Per-member output structures -> one structure of stacked tensors."""
    return _compat.tree.map_structure(lambda *vs: tf.stack(vs), *outputs)


def _training(kwargs, training):
    """The call's `training`: the model call's (the step's) when it has one, as Keras's
    Functional passes it over what the layer call recorded; else the recorded one."""
    recorded = kwargs.pop("training", None)
    return recorded if training is None else training


class Kind:
    """One layer of the N members, run once for all (see the module's docstring)."""

    fused = True                 # False: the members' own layers, once each (Loop)
    classes: tuple = ()          # the Keras classes this kind takes (exactly these)
    varying: frozenset = frozenset()  # config keys, besides COMMON_VARYING, members may differ in
    rows: tuple = ()             # weights stored by rows ([N x V, D], variables.Stacked)

    def __init__(self, layers, slot):
        self.layers = list(layers)
        self.n = len(self.layers)
        self.slot = slot         # member 0's variable -> its variables.Stacked

    @classmethod
    def accepts(cls, layer, calls):
        """Whether this kind runs `layer` called as `calls` ([(args, kwargs)] symbolic)."""
        return type(layer) in cls.classes and _float32(layer)

    def weight(self, variable):
        return self.slot(variable).variable

    def call(self, args, kwargs, training, ctx):
        raise NotImplementedError

    def _activate(self, y):
        """Member 0's activation for all, or each member's own where they differ."""
        activations = [getattr(layer, "activation", None) for layer in self.layers]
        names = {keras.activations.serialize(a) if a is not None else None for a in activations}
        if len(names) == 1:
            return y if activations[0] is None else activations[0](y)
        return tf.stack([y[p] if a is None else a(y[p]) for p, a in enumerate(activations)])


def _float32(layer):
    policy = getattr(layer, "dtype_policy", None)
    return policy is None or (getattr(policy, "compute_dtype", "float32") == "float32"
                              and getattr(policy, "variable_dtype", "float32") == "float32"
                              and getattr(policy, "quantization_mode", None) is None)


def _plain(layer):
    """No LoRA, no quantization: the layer's kernel is its weight."""
    return not getattr(layer, "lora_enabled", False) and \
        getattr(layer, "quantization_mode", None) is None


class Dense(Kind):
    classes = (keras.layers.Dense,)
    varying = frozenset({"activation"})

    @classmethod
    def accepts(cls, layer, calls):
        return super().accepts(layer, calls) and _plain(layer)

    def call(self, args, kwargs, training, ctx):
        x = args[0]
        layer = self.layers[0]
        kernel = self.weight(layer.kernel)                      # [N, in, out]
        shape = tf.shape(x)
        rows = tf.reshape(x, [self.n, -1, kernel.shape[1]])     # [N, b..., in] -> [N, m, in]
        y = tf.matmul(rows, kernel)
        if layer.bias is not None:
            y = ops.add(y, self.weight(layer.bias)[:, None, :])
        y = tf.reshape(y, tf.concat([shape[:-1], [kernel.shape[2]]], 0))
        return self._activate(y)


def _free_letter(equation):
    for c in "zyxwvutsrqponmlkjihgfedcba":
        if c not in equation:
            return c
    raise ValueError(f"no letter left for the members' axis in {equation!r}")


class EinsumDense(Kind):
    classes = (keras.layers.EinsumDense,)
    varying = frozenset({"activation"})

    @classmethod
    def accepts(cls, layer, calls):
        return super().accepts(layer, calls) and _plain(layer)

    def __init__(self, layers, slot):
        super().__init__(layers, slot)
        equation = self.layers[0].equation
        inputs, output = equation.split("->")
        left, right = inputs.split(",")
        c = _free_letter(equation)
        self.equation = f"{c}{left},{c}{right}->{c}{output}"

    def call(self, args, kwargs, training, ctx):
        x = args[0]
        layer = self.layers[0]
        y = ops.einsum(self.equation, x, self.weight(layer.kernel))
        if layer.bias is not None:
            bias = self.weight(layer.bias)                       # [N, *bias_shape]
            # Keras adds the bias by broadcasting against the output's trailing axes.
            pad = len(y.shape) - 1 - (len(bias.shape) - 1)
            bias = tf.reshape(bias, [self.n] + [1] * pad + list(bias.shape[1:]))
            y = ops.add(y, bias)
        return self._activate(y)


class Embedding(Kind):
    classes = (keras.layers.Embedding,)
    rows = ("embeddings",)

    @classmethod
    def accepts(cls, layer, calls):
        return super().accepts(layer, calls) and _plain(layer) and not layer.mask_zero

    def call(self, args, kwargs, training, ctx):
        ids = args[0]                                            # [N, b, ...]
        layer = self.layers[0]
        if ids.dtype not in (tf.int32, tf.int64):
            ids = ops.cast(ids, "int32")
        table = self.weight(layer.embeddings)                    # [N * V, D]
        vocabulary = layer.input_dim
        # Keras's take wraps negative ids; then member p's rows start at p * V.
        ids = tf.where(ids < 0, ids + tf.cast(vocabulary, ids.dtype), ids)
        offsets = tf.reshape(tf.range(self.n, dtype=ids.dtype) * vocabulary,
                             [self.n] + [1] * (len(ids.shape) - 1))
        return tf.gather(table, ids + offsets)


def _per_member(values, dtype="float32"):
    return tf.constant(values, dtype=dtype)


class BatchNormalization(Kind):
    classes = (keras.layers.BatchNormalization,)
    varying = frozenset({"momentum", "epsilon"})

    @classmethod
    def accepts(cls, layer, calls):
        return super().accepts(layer, calls) and not layer.renorm and \
            not any("mask" in kwargs for _, kwargs in calls)

    def __init__(self, layers, slot):
        super().__init__(layers, slot)
        import numpy as np

        # Keras multiplies by the Python floats: momentum as float32, 1 - momentum
        # computed in double first.
        self.momentum = np.array([l.momentum for l in self.layers], np.float32)
        self.complement = np.array([1.0 - l.momentum for l in self.layers]).astype(np.float32)
        self.epsilon = np.array([l.epsilon for l in self.layers], np.float32)

    def call(self, args, kwargs, training, ctx):
        training = _training(kwargs, training)
        x = args[0]
        layer = self.layers[0]
        rank = len(x.shape) - 1                                  # the member's rank
        axis = layer.axis % rank
        reduction = [a + 1 for a in range(rank) if a != axis]
        channels = x.shape[axis + 1]
        shape = [self.n] + [1] * rank
        shape[axis + 1] = channels

        def shaped(v):
            return tf.reshape(v, shape)

        x = ops.cast(x, keras.backend.result_type(x.dtype, "float32"))
        mean_var = self.weight(layer.moving_mean)
        var_var = self.weight(layer.moving_variance)
        gamma = shaped(self.weight(layer.gamma)) if layer.scale else None
        beta = shaped(self.weight(layer.beta)) if layer.center else None
        if training and layer.trainable:
            mean, variance = ops.moments(x, axes=reduction, keepdims=True)
            momentum = self.momentum[:, None]
            complement = self.complement[:, None]
            mean_var.assign(mean_var * momentum + tf.reshape(mean, [self.n, channels]) * complement)
            var_var.assign(var_var * momentum
                           + tf.reshape(variance, [self.n, channels]) * complement)
        else:
            mean, variance = shaped(mean_var), shaped(var_var)
        epsilon = tf.reshape(_per_member(self.epsilon), [self.n] + [1] * rank)
        y = tf.nn.batch_normalization(x, mean, variance, offset=beta, scale=gamma,
                                      variance_epsilon=epsilon)
        return ops.cast(y, layer.compute_dtype)


class LayerNormalization(Kind):
    classes = (keras.layers.LayerNormalization,)
    varying = frozenset({"epsilon"})

    @classmethod
    def accepts(cls, layer, calls):
        return super().accepts(layer, calls) and not getattr(layer, "rms_scaling", False)

    def call(self, args, kwargs, training, ctx):
        x = args[0]
        layer = self.layers[0]
        rank = len(x.shape) - 1
        axes = layer.axis if isinstance(layer.axis, (list, tuple)) else [layer.axis]
        axes = sorted(a % rank + 1 for a in axes)
        shape = [self.n] + [1] * rank
        for a in axes:
            shape[a] = x.shape[a]
        original = x.dtype
        x = ops.cast(x, keras.backend.result_type(x.dtype, "float32"))
        epsilon = tf.reshape(_per_member([l.epsilon for l in self.layers]), [self.n] + [1] * rank)
        # keras.ops.layer_normalization's own steps, with each member's gamma and beta.
        mean, variance = ops.moments(x, axes=axes, keepdims=True)
        inv = tf.math.rsqrt(variance + epsilon)
        if layer.scale:
            inv = inv * tf.reshape(self.weight(layer.gamma), shape)
        res = -mean * inv
        if layer.center:
            res = res + tf.reshape(self.weight(layer.beta), shape)
        y = x * inv + res
        return ops.cast(ops.cast(y, original), layer.compute_dtype)


def member_dropout(x, layer, ctx):
    """Member `layer`'s Dropout on its value `x`, with its own rate and seed generator:
    the mask its own fit draws (for a replica's rows, those rows of the global batch's)."""
    if ctx is None or ctx.rows is None:
        return keras.random.dropout(x, layer.rate, noise_shape=layer.noise_shape,
                                    seed=layer.seed_generator)
    start, total = ctx.rows
    return _compat.dropout_rows(x, layer.rate, layer.noise_shape, layer.seed_generator,
                                start, total)


class Dropout(Kind):
    classes = (keras.layers.Dropout,)
    varying = frozenset({"rate"})

    def call(self, args, kwargs, training, ctx):
        training = _training(kwargs, training)
        x = args[0]
        if not training:
            return x
        return tf.stack([member_dropout(x[p], layer, ctx) if layer.rate > 0 else x[p]
                         for p, layer in enumerate(self.layers)])


_FOLD_LAYERS = tuple(getattr(keras.layers, name) for name in (
    "Activation", "ReLU", "LeakyReLU", "ELU", "Softmax", "Flatten", "Reshape", "Permute",
    "RepeatVector", "Add", "Subtract", "Multiply", "Average", "Maximum", "Minimum",
    "Concatenate", "MaxPooling1D", "MaxPooling2D", "MaxPooling3D", "AveragePooling1D",
    "AveragePooling2D", "AveragePooling3D", "GlobalAveragePooling1D", "GlobalAveragePooling2D",
    "GlobalAveragePooling3D", "GlobalMaxPooling1D", "GlobalMaxPooling2D", "GlobalMaxPooling3D",
    "ZeroPadding1D", "ZeroPadding2D", "ZeroPadding3D", "Cropping1D", "Cropping2D",
    "Cropping3D", "UpSampling1D", "UpSampling2D", "UpSampling3D", "Identity",
    "UnitNormalization", "Rescaling") if hasattr(keras.layers, name))
# keras.ops called on symbolic tensors in a Functional model: element-wise ones fold.
_FOLD_OPS = frozenset({
    "Add", "Subtract", "Multiply", "Divide", "TrueDivide", "Negative", "Absolute", "Abs",
    "Square", "Sqrt", "Exp", "Log", "Maximum", "Minimum", "Relu", "Relu6", "Gelu", "Sigmoid",
    "Tanh", "Silu", "Swish", "Softplus", "Cast", "Clip", "Power"})


class Fold(Kind):
    """A layer without weights that treats each sample alone: one call of member 0's
    layer on the members folded into the batch ([N x b, ...])."""

    @classmethod
    def accepts(cls, layer, calls):
        if getattr(layer, "weights", None):
            return False
        if isinstance(layer, keras.layers.Layer):
            if type(layer) not in _FOLD_LAYERS or not _float32(layer):
                return False
            if getattr(layer, "axis", None) == 0 or getattr(layer, "activity_regularizer", None):
                return False
        elif not (type(layer).__name__ in _FOLD_OPS
                  and type(layer).__module__.startswith("keras.src.ops")):
            return False
        # Every symbolic argument must have the batch axis first (so it folds).
        for args, kwargs in calls:
            for t in _compat.tree.flatten((args, kwargs)):
                if isinstance(t, keras.KerasTensor) and (not t.shape or t.shape[0] is not None):
                    return False
        return True

    def call(self, args, kwargs, training, ctx):
        folded = _compat.tree.map_structure(lambda t: _fold(t) if _is_tensor(t) else t,
                                            (list(args), dict(kwargs)))
        out = _compat.call_operation(self.layers[0], folded[0], folded[1], training)
        return _compat.tree.map_structure(lambda t: _unfold(t, self.n), out)


class Loop(Kind):
    """Not fused: each member's own layer (its own variables) on its own value."""

    fused = False

    @classmethod
    def accepts(cls, layer, calls):
        return True

    def call(self, args, kwargs, training, ctx):
        outputs = []
        for p, layer in enumerate(self.layers):
            a, k = _compat.tree.map_structure(lambda t: t[p] if _is_tensor(t) else t,
                                              (list(args), dict(kwargs)))
            before = _compat.own_loss_count(layer)
            outputs.append(_compat.call_operation(layer, a, k, training))
            if _compat.own_loss_count(layer) > before + (
                    1 if getattr(layer, "activity_regularizer", None) else 0):
                raise NotImplementedError(
                    f"Layer {layer.name!r} ({type(layer).__name__}) adds a loss in its call "
                    "(add_loss): a sweep does not collect such losses. Use a compiled loss, "
                    "or train this model with model.fit / hf.fit.")
        return _stack(outputs)
