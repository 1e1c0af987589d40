"""Small models built from a sweep config (tests/sweeps/test_sweep.py, tests/mpi): each reads its
seed and hyper-parameters from the config, deterministically."""

import keras
import numpy as np


def _optimizer(config):
    name = config.get("optimizer", "sgd")
    lr = config["lr"]
    if name == "sgd":
        return keras.optimizers.SGD(lr, momentum=config.get("momentum", 0.0),
                                    nesterov=config.get("nesterov", False),
                                    global_clipnorm=config.get("global_clipnorm"))
    if name == "adam":
        return keras.optimizers.Adam(lr, beta_1=config.get("beta_1", 0.9),
                                     beta_2=config.get("beta_2", 0.999),
                                     amsgrad=config.get("amsgrad", False))
    if name == "adamw":
        return keras.optimizers.AdamW(lr, weight_decay=config.get("weight_decay", 0.004),
                                      beta_1=config.get("beta_1", 0.9))
    if name == "rmsprop":
        return keras.optimizers.RMSprop(lr, rho=config.get("rho", 0.9),
                                        momentum=config.get("momentum", 0.0),
                                        centered=config.get("centered", False),
                                        clipnorm=config.get("clipnorm"))
    raise ValueError(name)


def _compile(model, config):
    model.compile(optimizer=_optimizer(config),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


def mlp(config):
    """Dense layers with an L2 regularizer, per-member dropout."""
    keras.utils.set_random_seed(config["seed"])
    inp = keras.Input((12,))
    h = keras.layers.Dense(config.get("width", 24), activation="relu",
                           kernel_regularizer=keras.regularizers.L2(1e-3))(inp)
    h = keras.layers.Dropout(config.get("dropout", 0.0))(h)
    h = keras.layers.Dense(16, activation="tanh")(h)
    return _compile(keras.Model(inp, keras.layers.Dense(4)(h)), config)


def mlp_data(n=64):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 12)).astype("float32"), rng.integers(0, 4, n)


def cnn(config):
    """Conv2D + BatchNormalization (per-member momentum), pooling, dropout, Dense."""
    keras.utils.set_random_seed(config["seed"])
    inp = keras.Input((8, 8, 1))
    h = keras.layers.Conv2D(4, 3, padding="same")(inp)
    h = keras.layers.BatchNormalization(momentum=config.get("bn_momentum", 0.9))(h)
    h = keras.layers.Activation("relu")(h)
    h = keras.layers.MaxPooling2D()(h)
    h = keras.layers.Conv2D(6, 3, activation="relu")(h)
    h = keras.layers.Flatten()(h)
    h = keras.layers.Dropout(config.get("dropout", 0.0))(h)
    return _compile(keras.Model(inp, keras.layers.Dense(3)(h)), config)


def cnn_data(n=48):
    rng = np.random.default_rng(1)
    return rng.normal(size=(n, 8, 8, 1)).astype("float32"), rng.integers(0, 3, n)


def transformer(config):
    """Embedding, causal MultiHeadAttention (per-member attention dropout), residual
    adds (keras.ops), LayerNormalization, a feed-forward block, pooling."""
    keras.utils.set_random_seed(config["seed"])
    steps, vocabulary, width = 8, 20, 16
    ids = keras.Input((steps,), dtype="int32")
    h = keras.layers.Embedding(vocabulary, width)(ids)
    a = keras.layers.MultiHeadAttention(2, 8, dropout=config.get("attention_dropout", 0.0))(
        h, h, use_causal_mask=True)
    h = keras.layers.LayerNormalization()(h + a)
    f = keras.layers.Dense(32, activation="relu")(h)
    f = keras.layers.Dropout(config.get("dropout", 0.0))(keras.layers.Dense(width)(f))
    h = keras.layers.LayerNormalization(epsilon=config.get("ln_epsilon", 1e-3))(h + f)
    h = keras.layers.GlobalAveragePooling1D()(h)
    return _compile(keras.Model(ids, keras.layers.Dense(vocabulary)(h)), config)


def transformer_data(n=48):
    rng = np.random.default_rng(2)
    return rng.integers(0, 20, (n, 8)).astype("int32"), rng.integers(0, 20, n)


def vgg(config):
    """A VGG-style stack: two Conv2D straight after each other (no pooling or
    normalization between), pooling, two more (one valid, two input channels), a
    global pooling and a classifier."""
    keras.utils.set_random_seed(config["seed"])
    inp = keras.Input((8, 8, 2))
    h = keras.layers.Conv2D(4, 3, padding="same", activation="relu")(inp)
    h = keras.layers.Conv2D(6, 3, padding="same")(h)
    h = keras.layers.MaxPooling2D()(h)
    h = keras.layers.Conv2D(8, 3, padding="same", activation="relu")(h)
    h = keras.layers.Conv2D(8, 2, padding="valid", activation="relu")(h)
    h = keras.layers.GlobalAveragePooling2D()(h)
    return _compile(keras.Model(inp, keras.layers.Dense(3)(h)), config)


def separable(config):
    """Depthwise and separable convolutions between ordinary ones (a depth multiplier,
    strides, a dilation)."""
    keras.utils.set_random_seed(config["seed"])
    inp = keras.Input((8, 8, 2))
    h = keras.layers.Conv2D(4, 3, padding="same")(inp)
    h = keras.layers.DepthwiseConv2D(3, depth_multiplier=2, padding="same",
                                     activation="relu")(h)
    h = keras.layers.SeparableConv2D(6, 3, strides=2, padding="same")(h)
    h = keras.layers.SeparableConv2D(6, 3, dilation_rate=2, padding="same",
                                     depth_multiplier=2, activation="relu")(h)
    h = keras.layers.Conv2D(5, 1)(h)
    h = keras.layers.Flatten()(h)
    return _compile(keras.Model(inp, keras.layers.Dense(3)(h)), config)


def conv1d(config):
    """A Conv1D stack: causal, dilated, strided and valid convolutions straight after
    each other, a depthwise and a separable one, pooling."""
    keras.utils.set_random_seed(config["seed"])
    inp = keras.Input((16, 3))
    h = keras.layers.Conv1D(6, 3, padding="causal", activation="relu")(inp)
    h = keras.layers.Conv1D(6, 3, padding="causal", dilation_rate=2)(h)
    h = keras.layers.Conv1D(8, 3, strides=2, padding="same", activation="relu")(h)
    h = keras.layers.DepthwiseConv1D(3, padding="same")(h)
    h = keras.layers.SeparableConv1D(8, 3, padding="valid", activation="relu")(h)
    h = keras.layers.Conv1D(4, 2)(h)
    h = keras.layers.GlobalMaxPooling1D()(h)
    return _compile(keras.Model(inp, keras.layers.Dense(3)(h)), config)


def conv3d(config):
    """Two Conv3D straight after each other."""
    keras.utils.set_random_seed(config["seed"])
    inp = keras.Input((4, 4, 4, 1))
    h = keras.layers.Conv3D(3, 2, padding="same", activation="relu")(inp)
    h = keras.layers.Conv3D(4, 2)(h)
    h = keras.layers.Flatten()(h)
    return _compile(keras.Model(inp, keras.layers.Dense(3)(h)), config)


def images_data(n=32, shape=(8, 8, 2), seed=3):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n,) + shape).astype("float32"), rng.integers(0, 3, n)


CONV_CONFIGS = [
    dict(seed=1, lr=0.01, optimizer="adam"),
    dict(seed=2, lr=0.003, optimizer="adam", beta_1=0.8),
    dict(seed=3, lr=0.005, optimizer="adam", amsgrad=True),
    dict(seed=4, lr=0.02, optimizer="adam", beta_2=0.99),
]
CONV_CASES = {
    "vgg": (vgg, lambda: images_data()),
    "separable": (separable, lambda: images_data()),
    "conv1d": (conv1d, lambda: images_data(shape=(16, 3))),
    "conv3d": (conv3d, lambda: images_data(shape=(4, 4, 4, 1))),
}


# Eight members each: learning rates, momenta, optimizer arguments, dropout rates, seeds.
MLP_CONFIGS = [
    dict(seed=1, lr=0.05),
    dict(seed=2, lr=0.1, momentum=0.9, dropout=0.3),
    dict(seed=3, lr=0.02, dropout=0.5),
    dict(seed=4, lr=0.05, momentum=0.5, nesterov=True),
    dict(seed=5, lr=0.2, dropout=0.1),
    dict(seed=6, lr=0.01, momentum=0.9),
    dict(seed=7, lr=0.08, dropout=0.2, momentum=0.8, nesterov=True),
    dict(seed=8, lr=0.03),
]
CNN_CONFIGS = [
    dict(seed=1, lr=0.05),
    dict(seed=2, lr=0.1, bn_momentum=0.8, dropout=0.3, momentum=0.9),
    dict(seed=3, lr=0.02, bn_momentum=0.99),
    dict(seed=4, lr=0.05, dropout=0.5),
    dict(seed=5, lr=0.03, momentum=0.5),
    dict(seed=6, lr=0.08, bn_momentum=0.7),
    dict(seed=7, lr=0.01, dropout=0.2),
    dict(seed=8, lr=0.06),
]
TRANSFORMER_CONFIGS = [
    dict(seed=1, lr=0.01, optimizer="adam"),
    dict(seed=2, lr=0.003, optimizer="adam", beta_1=0.8, attention_dropout=0.2),
    dict(seed=3, lr=0.001, optimizer="adam", beta_2=0.99, ln_epsilon=1e-5),
    dict(seed=4, lr=0.005, optimizer="adam", dropout=0.3, amsgrad=True),
    dict(seed=5, lr=0.002, optimizer="adam", beta_1=0.95, beta_2=0.98),
    dict(seed=6, lr=0.004, optimizer="adam", attention_dropout=0.1, dropout=0.1),
    dict(seed=7, lr=0.01, optimizer="adam", beta_1=0.7),
    dict(seed=8, lr=0.0005, optimizer="adam"),
]

CASES = {
    "mlp": (mlp, mlp_data, MLP_CONFIGS),
    "cnn": (cnn, cnn_data, CNN_CONFIGS),
    "transformer": (transformer, transformer_data, TRANSFORMER_CONFIGS),
}
