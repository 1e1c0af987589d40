"""Forwards whose samples interact are named when R x M > 1 splits the batch
(`hyparflow.engine.coupling`, docs/models.md "Samples that interact"); BatchNorm, Dropout,
ClassBalancedMix and random draws in inference mode are not flagged; no zoo model is."""

import warnings

import keras
import numpy as np
import pytest
from keras import ops

import hyparflow as hf
import zoo
from hyparflow import graph as G
from hyparflow.engine import coupling
from hyparflow.engine.local import run_ranks
from hyparflow import readers as _data

L = keras.layers


class Recommender(keras.Model):
    """keras.io's collaborative-filtering model, shrunk: the score of a (user, movie) id
    pair is `ops.tensordot(user, movie, 2)`, one sum over the whole batch, plus biases."""

    def __init__(self, users=12, movies=9, size=4, **kwargs):
        super().__init__(**kwargs)
        self.users = L.Embedding(users, size, embeddings_initializer="he_normal")
        self.user_bias = L.Embedding(users, 1)
        self.movies = L.Embedding(movies, size, embeddings_initializer="he_normal")
        self.movie_bias = L.Embedding(movies, 1)

    def call(self, inputs):
        ids = ops.cast(inputs, "int32")
        user, movie = self.users(ids[:, 0]), self.movies(ids[:, 1])
        dot = ops.tensordot(user, movie, 2)
        return ops.sigmoid(dot + self.user_bias(ids[:, 0]) + self.movie_bias(ids[:, 1]))


def recommender(ids="int64"):
    keras.utils.set_random_seed(3)
    model = Recommender()
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="binary_crossentropy")
    rng = np.random.default_rng(3)
    x = np.stack([rng.integers(0, 12, 32), rng.integers(0, 9, 32)], axis=1).astype(ids)
    y = rng.random((32, 1)).astype("float32")
    model(x[:2])
    return model, x, y


def centred():
    """A Functional model whose custom layer takes the batch mean off its input."""
    keras.utils.set_random_seed(4)
    inp = keras.Input((5,))
    h = L.Dense(6, activation="relu", name="dense_in")(inp)
    h = L.Lambda(lambda t: t - ops.mean(t, axis=0, keepdims=True), name="centre")(h)
    out = L.Dense(1, name="dense_out")(L.Dense(4, activation="relu")(h))
    model = keras.Model(inp, out)
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    rng = np.random.default_rng(4)
    return model, rng.normal(size=(32, 5)).astype("float32"), rng.normal(size=(32, 1)).astype(
        "float32")


class Noise(L.Layer):
    """A VAE's sampling: draws in inference mode too."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seeds = keras.random.SeedGenerator(1)

    def call(self, x):
        return x + keras.random.normal(ops.shape(x), seed=self.seeds)


def uncoupled():
    """BatchNormalization, Dropout, ClassBalancedMix and a layer that draws noise even in
    inference mode: none of them couples the rows in inference mode."""
    keras.utils.set_random_seed(5)
    inp, labels = keras.Input((6,)), keras.Input((1,))
    h = L.BatchNormalization()(L.Dense(8, activation="relu")(inp))
    h = hf.layers.ClassBalancedMix([0.3, 0.0])([L.Dropout(0.5)(h), labels])
    out = L.Dense(2, activation="softmax")(Noise()(h))
    model = keras.Model([inp, labels], out)
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="sparse_categorical_crossentropy")
    rng = np.random.default_rng(5)
    y = rng.integers(0, 2, 32)
    return model, [rng.normal(size=(32, 6)).astype("float32"), y[:, None].astype("float32")], y


def _found(model, x, y):
    graph = G.from_model(model, [np.shape(a) for a in (x if isinstance(x, list) else [x])])
    return coupling.coupled(model, graph, _data.prepare_data(graph, x, y))


def test_the_layer_where_rows_interact_is_named():
    model, x, y = centred()
    assert _found(model, x, y) == "centre"
    model, x, y = recommender()
    assert _found(model, x, y) == model.name


def test_random_and_per_microbatch_layers_are_not_flagged():
    model, x, y = uncoupled()
    assert _found(model, x, y) is None


@pytest.mark.parametrize("name", sorted(zoo.ZOO))
def test_no_zoo_model_is_flagged(name):
    model, (x, y) = zoo.ZOO[name]()
    if isinstance(x, dict):
        x = [x[k] for k in ("left", "right")]
        y = [y[k] for k in ("p", "q")]
    assert _found(model, x, y) is None


def _run(build, ranks, **kwargs):
    def body(comm):
        model, x, y = build()
        hf.fit(model, x, y, batch_size=8, epochs=1, shuffle=False, verbose=0, comm=comm,
               **kwargs)
        return model.get_weights()

    return run_ranks(ranks, body, timeout=300)


def _fit(build, ranks, **kwargs):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _run(build, ranks, **kwargs)
    return [w for w in caught if issubclass(w.category, hf.BatchCouplingWarning)]


def test_split_batches_warn_once_naming_the_layer_and_the_fix():
    # Ids as float32 in fit: a subclassed model's inputs are float32 until it takes the
    # data's dtypes (issue 62, part 2); the model casts them back to integers.
    said = _fit(lambda: recommender("float32"), 2, num_replicas=2)
    assert len(said) == 1
    text = str(said[0].message)
    assert "'recommender'" in text and "num_replicas=1 and num_microbatches=1" in text
    said = _fit(centred, 2, num_stages=2, num_microbatches=2)
    assert len(said) == 1 and "layer 'centre'" in str(said[0].message)


def test_one_replica_and_one_microbatch_are_not_warned():
    assert _fit(centred, 2, num_stages=2, num_microbatches=1) == []
    assert _fit(uncoupled, 2, num_replicas=2, num_microbatches=2) == []


def test_made_an_error_it_is_a_refusal_on_every_rank():
    with warnings.catch_warnings():
        warnings.simplefilter("error", hf.BatchCouplingWarning)
        with pytest.raises(ValueError, match="depend on the other samples"):
            _run(centred, 2, num_replicas=2)
