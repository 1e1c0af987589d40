"""Small models for the equivalence tests; each builder is deterministic."""

import keras
import numpy as np


def mlp(optimizer="sgd"):
    keras.utils.set_random_seed(1)
    inp = keras.Input((12,), name="features")
    h = inp
    for k, width in enumerate((32, 32, 24, 16)):
        # Named: plan files name layer calls, and automatic names change per build.
        h = keras.layers.Dense(width, activation="relu", name=f"hidden_{k}")(h)
    out = keras.layers.Dense(4, name="logits")(h)
    model = keras.Model(inp, out)
    model.compile(optimizer=optimizer,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


def mlp_data(n=100):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 12)).astype("float32"), rng.integers(0, 4, n)


def skip_cnn(optimizer="sgd"):
    """A CNN whose first block's output is added back four layer calls later, so
    with the balance below the skip tensor crosses two stage boundaries."""
    keras.utils.set_random_seed(2)
    inp = keras.Input((8, 8, 1))
    a = keras.layers.Conv2D(4, 3, padding="same", activation="relu", name="stem")(inp)
    b = keras.layers.Conv2D(4, 3, padding="same", activation="relu")(a)
    b = keras.layers.Conv2D(4, 3, padding="same", activation="relu")(b)
    b = keras.layers.Conv2D(4, 3, padding="same")(b)
    c = keras.layers.Add(name="skip_add")([a, b])
    c = keras.layers.Activation("relu")(c)
    c = keras.layers.GlobalAveragePooling2D()(c)
    out = keras.layers.Dense(3)(c)
    model = keras.Model(inp, out)
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


# stem | conv conv | conv add relu pool dense: the stem's output skips stage 1.
SKIP_CNN_BALANCE = {2: [1, 7], 3: [1, 2, 5], 4: [1, 2, 2, 3]}


def skip_cnn_data(n=60):
    rng = np.random.default_rng(1)
    return rng.normal(size=(n, 8, 8, 1)).astype("float32"), rng.integers(0, 3, n)


def two_in_two_out(optimizer="sgd"):
    """Two inputs, two outputs, per-output losses, loss weights and metrics."""
    keras.utils.set_random_seed(3)
    a = keras.Input((6,), name="a")
    b = keras.Input((5,), name="b")
    ha = keras.layers.Dense(16, activation="tanh")(a)
    hb = keras.layers.Dense(16, activation="tanh")(b)
    h = keras.layers.Concatenate()([ha, hb])
    h = keras.layers.Dense(16, activation="relu")(h)
    cls = keras.layers.Dense(3, activation="softmax", name="cls")(h)
    reg = keras.layers.Dense(1, name="reg")(keras.layers.Dense(8, activation="relu")(h))
    model = keras.Model({"a": a, "b": b}, {"cls": cls, "reg": reg})
    model.compile(optimizer=optimizer,
                  loss={"cls": "sparse_categorical_crossentropy", "reg": "mse"},
                  loss_weights={"cls": 1.0, "reg": 0.5},
                  metrics={"cls": ["accuracy"], "reg": ["mae"]})
    return model


def two_in_two_out_data(n=90):
    rng = np.random.default_rng(2)
    x = {"a": rng.normal(size=(n, 6)).astype("float32"), "b": rng.normal(size=(n, 5)).astype("float32")}
    y = {"cls": rng.integers(0, 3, n), "reg": rng.normal(size=(n, 1)).astype("float32")}
    return x, y


def causal_lm(family="Llama", *, vocab, hidden_dim=16, intermediate_dim=32, num_query_heads=2,
              num_key_value_heads=1, num_layers=2, learning_rate=1e-3, **backbone_kwargs):
    """A tiny Keras Hub `<family>CausalLM` (random init, no preset), compiled with Adam and
    per-token cross-entropy over its logits. The backbone is named: Keras numbers automatic
    names per thread, so a model built on a rank's thread would not get the name one built
    on the main thread got after other tests."""
    import keras_hub

    keras.utils.set_random_seed(21)
    backbone = getattr(keras_hub.models, family + "Backbone")(
        vocabulary_size=vocab, num_layers=num_layers, num_query_heads=num_query_heads,
        num_key_value_heads=num_key_value_heads, hidden_dim=hidden_dim,
        intermediate_dim=intermediate_dim, name="backbone", **backbone_kwargs)
    model = getattr(keras_hub.models, family + "CausalLM")(backbone=backbone, preprocessor=None)
    model.compile(optimizer=keras.optimizers.Adam(learning_rate),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  weighted_metrics=[])
    return model
