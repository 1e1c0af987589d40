"""Inputs of any dtype model.fit takes: strings turned into ids inside the model
(StringLookup, as Keras's preprocessing guide does it), integer ids of a subclassed
model; a string that would cross a stage boundary, or text fed to a numeric input,
refused with the layer, the cut and the fix."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import hyparflow as hf
from hyparflow import graph as G
from conftest import max_diff, reference, train_ranks

pytestmark = pytest.mark.timeout(600)
L = keras.layers
N, B = 64, 16
COLOURS = ["red", "green", "blue", "cyan"]   # "cyan": out of the vocabulary


def columns(seed=0):
    rng = np.random.default_rng(seed)
    colour = np.array(COLOURS)[rng.integers(0, 4, N)].reshape(-1, 1)
    number = rng.normal(size=(N, 3)).astype("float32")
    return colour, number, rng.integers(0, 2, N)


class Lower(L.Layer):
    """Text in, text out (what a cleaning step before the lookup does)."""

    def call(self, text):
        return tf.strings.lower(text)

    def compute_output_spec(self, text):
        return keras.KerasTensor(text.shape, "string")


def structured(lower=False):
    """Keras's structured-data recipe: a string column looked up inside the model."""
    keras.utils.set_random_seed(3)
    colour = keras.Input((1,), dtype="string", name="colour")
    number = keras.Input((3,), name="number")
    text = Lower(name="lower")(colour) if lower else colour
    ids = L.StringLookup(vocabulary=COLOURS[:3], output_mode="one_hot", name="lookup")(text)
    h = L.Concatenate()([L.Reshape((4,))(ids), number])
    h = L.Dense(8, activation="relu")(h)
    h = L.Dense(8, activation="tanh")(h)
    model = keras.Model([colour, number], L.Dense(2)(h))
    model.compile(optimizer=keras.optimizers.Adam(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


@pytest.mark.parametrize("form", ["tf.string", "numpy str", "tf.data"])
@pytest.mark.parametrize("stages,replicas,micro", [(2, 1, 2), (1, 2, 1), (2, 2, 2)])
def test_string_columns_train_to_model_fit(form, stages, replicas, micro):
    colour, number, y = columns()
    start, want, _ = reference(structured, {"colour": tf.constant(colour), "number": number},
                               y, epochs=2, batch_size=B)
    x = {"colour": colour if form == "numpy str" else tf.constant(colour), "number": number}
    kwargs = dict(batch_size=B)
    if form == "tf.data":
        x, y, kwargs = tf.data.Dataset.from_tensor_slices((x, y)).batch(B), None, {}
    out = train_ranks(structured, x, y, num_stages=stages, num_replicas=replicas,
                      num_microbatches=micro, weights=start, epochs=2, shuffle=False, **kwargs)
    assert max(max_diff(w, want) for w, _ in out) < 2e-6


def test_every_cut_of_the_string_model():
    """The text reaches only the stage that reads it, wherever the cut falls."""
    colour, number, y = columns()
    x = {"colour": tf.constant(colour), "number": number}
    start, want, _ = reference(structured, x, y, epochs=1, batch_size=B)
    calls = len(G.from_model(structured()).nodes)
    for first in range(1, calls):
        out = train_ranks(structured, x, y, num_stages=2, num_replicas=1, num_microbatches=2,
                          weights=start, epochs=1, batch_size=B, shuffle=False,
                          balance=[first, calls - first])
        assert max(max_diff(w, want) for w, _ in out) < 2e-6, first


def test_strings_crossing_a_cut_are_refused_naming_the_layer_and_the_cut():
    colour, number, y = columns()
    model = structured(lower=True)
    order = [n.name for n in G.from_model(model).nodes]
    calls, first = len(order), order.index("lower") + 1   # the cut right after the text
    with pytest.raises(ValueError, match=r"Layer 'lower' gives strings .* stages 0 and 1"):
        train_ranks(structured_lower, {"colour": tf.constant(colour), "number": number}, y,
                    num_stages=2, num_replicas=1, num_microbatches=1,
                    weights=model.get_weights(), batch_size=B,
                    balance=[first, calls - first])


def structured_lower():
    return structured(lower=True)


def test_text_fed_to_a_numeric_input_is_refused_naming_the_input():
    colour, number, y = columns()
    model = structured()
    with pytest.raises(ValueError, match=r"Input 'number' takes float32 but the data holds text"):
        hf.fit(model, {"colour": colour, "number": colour}, y, batch_size=B, verbose=0)


class Recommender(keras.Model):
    """A subclassed recommender on int64 (user, movie) id pairs, as Keras's
    collaborative-filtering example: each score a dot product of the pair's vectors."""

    def __init__(self):
        super().__init__()
        self.users = L.Embedding(20, 4)
        self.movies = L.Embedding(30, 4)
        self.bias = L.Embedding(30, 1)

    def call(self, pairs):
        user, movie = self.users(pairs[:, 0]), self.movies(pairs[:, 1])
        score = keras.ops.sum(user * movie, axis=1, keepdims=True) + self.bias(pairs[:, 1])
        return keras.ops.sigmoid(score)


def recommender():
    keras.utils.set_random_seed(5)
    model = Recommender()
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="binary_crossentropy")
    model(np.zeros((1, 2), np.int64))
    return model


@pytest.mark.parametrize("replicas", [1, 2])
def test_subclassed_model_takes_int64_ids(replicas):
    rng = np.random.default_rng(1)
    # Repeated ids: Keras applies an Embedding's gradient sparsely, rows summed.
    pairs = np.stack([rng.integers(0, 20, N), rng.integers(0, 30, N)], 1).astype(np.int64)
    y = rng.uniform(0, 1, (N, 1)).astype("float32")
    start, want, _ = reference(recommender, pairs, y, epochs=2, batch_size=B)
    out = train_ranks(recommender, pairs, y, num_stages=1, num_replicas=replicas,
                      num_microbatches=1, weights=start, epochs=2, batch_size=B, shuffle=False)
    assert max(max_diff(w, want) for w, _ in out) < 2e-6
