"""A zoo of graph shapes for the hybrid-parallel equivalence tests.

Each entry builds a compiled model deterministically and makes its data."""

import keras
import numpy as np
from keras import ops

L = keras.layers


def _compile(model, loss="sparse_categorical_crossentropy", **kwargs):
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss=loss, **kwargs)
    return model


def _images(n, shape, classes, seed):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n,) + shape).astype("float32"), rng.integers(0, classes, n)


def unet():
    """A long skip: the first block's output is concatenated at the very end."""
    keras.utils.set_random_seed(10)
    inp = keras.Input((8, 8, 2))
    e1 = L.Conv2D(4, 3, padding="same", activation="relu")(inp)
    e2 = L.Conv2D(8, 3, strides=2, padding="same", activation="relu")(e1)
    m = L.Conv2D(8, 3, padding="same", activation="relu")(e2)
    m = L.Conv2D(8, 3, padding="same", activation="relu")(m)
    d = L.UpSampling2D()(m)
    d = L.Concatenate()([d, e1])
    d = L.Conv2D(4, 3, padding="same", activation="relu")(d)
    out = L.Dense(3, activation="softmax")(L.GlobalAveragePooling2D()(d))
    return _compile(keras.Model(inp, out)), _images(48, (8, 8, 2), 3, 10)


def densenet():
    """Dense connectivity: each layer sees the concatenation of all before it."""
    keras.utils.set_random_seed(11)
    inp = keras.Input((10,))
    feats = [inp]
    for width in (6, 6, 6, 6):
        x = feats[0] if len(feats) == 1 else L.Concatenate()(feats)
        feats.append(L.Dense(width, activation="relu")(x))
    out = L.Dense(3, activation="softmax")(L.Concatenate()(feats))
    rng = np.random.default_rng(11)
    return _compile(keras.Model(inp, out)), (rng.normal(size=(60, 10)).astype("float32"), rng.integers(0, 3, 60))


def inception():
    """Parallel branches joined by a concatenation; stage cuts fall inside them."""
    keras.utils.set_random_seed(12)
    inp = keras.Input((8, 8, 3))
    b1 = L.Conv2D(4, 1, activation="relu")(inp)
    b2 = L.Conv2D(4, 1, activation="relu")(inp)
    b2 = L.Conv2D(4, 3, padding="same", activation="relu")(b2)
    b3 = L.MaxPooling2D(3, strides=1, padding="same")(inp)
    b3 = L.Conv2D(4, 1, activation="relu")(b3)
    x = L.Concatenate()([b1, b2, b3])
    out = L.Dense(4, activation="softmax")(L.GlobalAveragePooling2D()(x))
    return _compile(keras.Model(inp, out)), _images(40, (8, 8, 3), 4, 12)


def sequential():
    keras.utils.set_random_seed(13)
    model = keras.Sequential([keras.Input((7,)), L.Dense(16, activation="relu"),
                              L.Dense(16, activation="relu"), L.Dense(8, activation="tanh"),
                              L.Dense(3, activation="softmax")])
    rng = np.random.default_rng(13)
    return _compile(model), (rng.normal(size=(50, 7)).astype("float32"), rng.integers(0, 3, 50))


def nested():
    """A Functional model used as a layer of another (one layer call, whole on a stage)."""
    keras.utils.set_random_seed(14)
    inner_in = keras.Input((6,))
    inner = keras.Model(inner_in, L.Dense(8, activation="relu")(L.Dense(8, activation="relu")(inner_in)),
                        name="inner")
    inp = keras.Input((6,))
    x = L.Dense(6, activation="tanh")(inp)
    x = inner(x)
    x = L.Dense(8, activation="relu")(x)
    out = L.Dense(2, activation="softmax")(x)
    rng = np.random.default_rng(14)
    return _compile(keras.Model(inp, out)), (rng.normal(size=(40, 6)).astype("float32"), rng.integers(0, 2, 40))


@keras.saving.register_keras_serializable("hyparflow_tests")
class ScaledResidual(keras.layers.Layer):
    """A custom layer with its own weights and a regulariser-style add_loss."""

    def __init__(self, units, **kwargs):
        super().__init__(**kwargs)
        self.units = units

    def build(self, shape):
        self.w = self.add_weight(shape=(shape[-1], self.units), initializer="glorot_uniform")
        self.scale = self.add_weight(shape=(), initializer="ones")

    def call(self, x):
        self.add_loss(1e-3 * ops.sum(ops.square(self.w)))
        return x[..., : self.units] + self.scale * ops.tanh(ops.matmul(x, self.w))

    def get_config(self):
        return dict(super().get_config(), units=self.units)


def custom_layers():
    keras.utils.set_random_seed(15)
    inp = keras.Input((8,))
    x = ScaledResidual(8)(inp)
    x = ScaledResidual(8)(x)
    x = L.Dense(8, activation="relu", kernel_regularizer=keras.regularizers.L2(1e-3))(x)
    out = L.Dense(3, activation="softmax")(x)
    rng = np.random.default_rng(15)
    return _compile(keras.Model(inp, out)), (rng.normal(size=(48, 8)).astype("float32"), rng.integers(0, 3, 48))


def frozen():
    """Non-trainable weights: a frozen Dense between trainable ones."""
    keras.utils.set_random_seed(16)
    inp = keras.Input((8,))
    x = L.Dense(12, activation="relu")(inp)
    frozen_layer = L.Dense(12, activation="relu", name="frozen")
    frozen_layer.trainable = False
    x = frozen_layer(x)
    x = L.Dense(12, activation="relu")(x)
    out = L.Dense(3, activation="softmax")(x)
    rng = np.random.default_rng(16)
    return _compile(keras.Model(inp, out)), (rng.normal(size=(48, 8)).astype("float32"), rng.integers(0, 3, 48))


def text_rnn():
    """Embedding + LSTM + GRU on integer token sequences."""
    keras.utils.set_random_seed(17)
    inp = keras.Input((12,), dtype="int32")
    x = L.Embedding(50, 8)(inp)
    x = L.LSTM(8, return_sequences=True)(x)
    x = L.GRU(8)(x)
    out = L.Dense(2, activation="softmax")(x)
    rng = np.random.default_rng(17)
    return _compile(keras.Model(inp, out)), (rng.integers(0, 50, (40, 12)).astype("int32"), rng.integers(0, 2, 40))


def masked_text():
    """Embedding(mask_zero=True): Keras 3 passes the mask to the LSTM as an explicit
    argument of its call, so the mask is a boundary tensor like any other."""
    keras.utils.set_random_seed(21)
    inp = keras.Input((10,), dtype="int32")
    x = L.Embedding(30, 6, mask_zero=True)(inp)
    x = L.LSTM(6)(x)
    x = L.Dense(6, activation="relu")(x)
    out = L.Dense(2, activation="softmax")(x)
    rng = np.random.default_rng(21)
    tokens = rng.integers(1, 30, (40, 10)).astype("int32")
    for row, length in zip(tokens, rng.integers(3, 11, 40)):
        row[length:] = 0  # padded sequences of different lengths
    return _compile(keras.Model(inp, out)), (tokens, rng.integers(0, 2, 40))


def ops_graph():
    """keras.ops calls in a Functional graph become operation nodes (no Lambda)."""
    keras.utils.set_random_seed(18)
    inp = keras.Input((9,))
    a = L.Dense(9, activation="relu")(inp)
    b = ops.multiply(ops.sin(a), 0.5) + inp
    c = L.Dense(9)(b)
    d = ops.concatenate([ops.tanh(c), ops.square(a)], axis=-1)
    out = L.Dense(3, activation="softmax")(d)
    rng = np.random.default_rng(18)
    return _compile(keras.Model(inp, out)), (rng.normal(size=(45, 9)).astype("float32"), rng.integers(0, 3, 45))


def tied():
    """The same Dense called at the start and near the end (tied weights across stages)."""
    keras.utils.set_random_seed(19)
    inp = keras.Input((8,))
    shared = L.Dense(8, activation="tanh", name="tied")
    x = shared(inp)
    x = L.Dense(8, activation="relu")(x)
    x = L.Dense(8, activation="relu")(x)
    x = shared(x)
    out = L.Dense(3, activation="softmax")(x)
    rng = np.random.default_rng(19)
    return _compile(keras.Model(inp, out)), (rng.normal(size=(48, 8)).astype("float32"), rng.integers(0, 3, 48))


def multi_io():
    """Dict inputs and outputs, per-output losses, loss weights, per-output metrics."""
    keras.utils.set_random_seed(20)
    a = keras.Input((5,), name="left")
    b = keras.Input((4,), name="right")
    h = L.Concatenate()([L.Dense(8, activation="relu")(a), L.Dense(8, activation="relu")(b)])
    h = L.Dense(8, activation="relu")(h)
    p = L.Dense(2, activation="softmax", name="p")(h)
    q = L.Dense(1, activation="sigmoid", name="q")(L.Dense(4, activation="relu")(h))
    model = keras.Model({"left": a, "right": b}, {"p": p, "q": q})
    model.compile(optimizer=keras.optimizers.SGD(0.05),
                  loss={"p": "sparse_categorical_crossentropy", "q": "binary_crossentropy"},
                  loss_weights={"p": 0.7, "q": 1.3},
                  metrics={"p": ["accuracy"], "q": ["binary_accuracy", keras.metrics.AUC(name="auc")]})
    rng = np.random.default_rng(20)
    x = {"left": rng.normal(size=(50, 5)).astype("float32"), "right": rng.normal(size=(50, 4)).astype("float32")}
    y = {"p": rng.integers(0, 2, 50), "q": rng.integers(0, 2, (50, 1)).astype("float32")}
    return model, (x, y)


ZOO = {f.__name__: f for f in (unet, densenet, inception, sequential, nested, custom_layers, frozen,
                               text_rnn, masked_text, ops_graph, tied, multi_io)}
