"""Benchmark models: the MLP, a CNN feeding an MLP, ResNet-110, a ResNet-1001-style net (synthetic data), the
GPT-style language model of examples/gpt_text.py (the standard library's source) and a
text classifier with a 200,000-row embedding (synthetic ids)."""

import os
import sys
import time

import keras
import numpy as np

L = keras.layers


def mlp():
    """8 Dense(1024) + ReLU layers on 1024 features, MSE, SGD."""
    inp = keras.Input((1024,))
    x = inp
    for _ in range(8):
        x = L.Dense(1024, activation="relu")(x)
    model = keras.Model(inp, x, name="mlp8x1024")
    model.compile(optimizer=keras.optimizers.SGD(0.001), loss="mse")
    return model, (1024,), (1024,)


def wide():
    """A wide MLP: 1024 features, 4 Dense(4096) + ReLU layers (54M weights), MSE, Adam:
    weights, gradients and Adam's two slots take 860 MB on one rank."""
    inp = keras.Input((1024,))
    x = inp
    for k in range(4):
        x = L.Dense(4096, activation="relu", name=f"wide_{k}")(x)
    model = keras.Model(inp, L.Dense(16, name="out")(x), name="wide_mlp")
    model.compile(optimizer=keras.optimizers.Adam(1e-4), loss="mse")
    return model, (1024,), (16,)


def cnnmlp():
    """A CNN feeding an MLP (the shape of many user models): three Conv2D + BatchNorm +
    pooling blocks on 32x32x3 images, then Dense(512) x 2, 10 classes, Adam."""
    inp = keras.Input((32, 32, 3))
    x = inp
    for filters in (32, 64, 128):
        x = L.Conv2D(filters, 3, padding="same", use_bias=False)(x)
        x = L.ReLU()(L.BatchNormalization()(x))
        x = L.MaxPooling2D()(x)
    x = L.Flatten()(x)
    for _ in range(2):
        x = L.Dense(512, activation="relu")(x)
    model = keras.Model(inp, L.Dense(10)(x), name="cnn_mlp")
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model, (32, 32, 3), ()


def _basic_block(x, filters, stride):
    y = L.Conv2D(filters, 3, strides=stride, padding="same", use_bias=False)(x)
    y = L.BatchNormalization()(y)
    y = L.Activation("relu")(y)
    y = L.Conv2D(filters, 3, padding="same", use_bias=False)(y)
    y = L.BatchNormalization()(y)
    if stride != 1 or x.shape[-1] != filters:
        x = L.Conv2D(filters, 1, strides=stride, use_bias=False)(x)
    return L.Activation("relu")(L.Add()([x, y]))


def resnet_cifar(depth):
    """The CIFAR ResNet of He et al.: 3 groups of (depth - 2) / 6 basic blocks."""
    n = (depth - 2) // 6
    inp = keras.Input((32, 32, 3))
    x = L.Activation("relu")(L.BatchNormalization()(L.Conv2D(16, 3, padding="same", use_bias=False)(inp)))
    for group, filters in enumerate((16, 32, 64)):
        for block in range(n):
            x = _basic_block(x, filters, 2 if group and block == 0 else 1)
    x = L.GlobalAveragePooling2D()(x)
    model = keras.Model(inp, L.Dense(10, activation="softmax")(x), name=f"resnet{depth}")
    model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9),
                  loss="sparse_categorical_crossentropy")
    return model, (32, 32, 3), ()


def _bottleneck(x, filters, stride):
    """Pre-activation bottleneck block (ResNet-1001, He et al. 2016)."""
    y = L.Activation("relu")(L.BatchNormalization()(x))
    shortcut = x
    if stride != 1 or x.shape[-1] != 4 * filters:
        shortcut = L.Conv2D(4 * filters, 1, strides=stride, use_bias=False)(y)
    y = L.Conv2D(filters, 1, use_bias=False)(y)
    y = L.Conv2D(filters, 3, strides=stride, padding="same", use_bias=False)(
        L.Activation("relu")(L.BatchNormalization()(y)))
    y = L.Conv2D(4 * filters, 1, use_bias=False)(L.Activation("relu")(L.BatchNormalization()(y)))
    return L.Add()([shortcut, y])


def resnet1001():
    """ResNet-1001: 3 groups of 111 pre-activation bottleneck blocks (16/32/64 x4 channels)."""
    inp = keras.Input((32, 32, 3))
    x = L.Conv2D(16, 3, padding="same", use_bias=False)(inp)
    for group, filters in enumerate((16, 32, 64)):
        for block in range(111):
            x = _bottleneck(x, filters, 2 if group and block == 0 else 1)
    x = L.GlobalAveragePooling2D()(L.Activation("relu")(L.BatchNormalization()(x)))
    model = keras.Model(inp, L.Dense(10, activation="softmax")(x), name="resnet1001")
    model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9),
                  loss="sparse_categorical_crossentropy")
    return model, (32, 32, 3), ()


def _gpt_text():
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                    "examples"))
    import gpt_text

    return gpt_text


def gpt(samples):
    """examples/gpt_text.py at context 128, width 128, 4 blocks (0.8M weights), Adam, on
    windows of the standard library's source."""
    text = _gpt_text()
    model = text.compile_model(text.build_model(context=128, dim=128, heads=4, blocks=4))
    ids = text.encode(text.read_source(samples * 64 + 256))
    x, y = text.windows(ids, 128, 64)
    return model, x[:samples], y[:samples]


def embed(samples, vocab=200_000, length=64):
    """A bag-of-embeddings classifier: Embedding(200,000, 128) (25.6M weights) over 64
    ids, pooled, two Dense layers, Adam. A batch touches a few thousand rows."""
    ids = keras.Input((length,), dtype="int32")
    x = L.GlobalAveragePooling1D()(L.Embedding(vocab, 128)(ids))
    x = L.Dense(128, activation="relu")(x)
    model = keras.Model(ids, L.Dense(10)(x), name="embed200k")
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(0)
    # Zipf-like ids, as words in text: a few frequent, a long tail.
    x = np.minimum(rng.zipf(1.3, size=(samples, length)), vocab) - 1
    return model, x.astype("int32"), rng.integers(0, 10, samples)


def make(name, samples):
    """(compiled model, x, y) with the same initial weights on every rank."""
    keras.utils.set_random_seed(0)
    if name in ("gpt", "embed"):
        return {"gpt": gpt, "embed": embed}[name](samples)
    builders = {"mlp": mlp, "wide": wide, "cnnmlp": cnnmlp, "resnet56": lambda: resnet_cifar(56),
                "resnet110": lambda: resnet_cifar(110), "resnet1001": resnet1001}
    model, x_shape, y_shape = builders[name]()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(samples,) + x_shape).astype("float32")
    if y_shape:
        y = rng.normal(size=(samples,) + y_shape).astype("float32")
    else:
        y = rng.integers(0, 10, samples)
    return model, x, y


class BatchTimer(keras.callbacks.Callback):
    """Appends each training batch's seconds to `times`."""

    def __init__(self, times):
        super().__init__()
        self.times = times

    def on_train_batch_begin(self, batch, logs=None):
        self.start = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        self.times.append(time.perf_counter() - self.start)
