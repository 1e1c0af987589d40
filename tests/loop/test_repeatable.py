"""Runs repeat as `model.fit` runs repeat: after `keras.utils.set_random_seed`, `hf.fit`
with the default `seed=None` shuffles as `model.fit(shuffle=True)` does and draws the
same random masks twice."""

import keras
import numpy as np
from keras import layers as L

import hyparflow as hf
import models
from conftest import max_diff, train_ranks


def test_shuffled_epochs_train_to_model_fits_weights():
    """shuffle=True (the default), seed=None: the permutation of every epoch is the one
    model.fit draws, so 2 stages x 2 replicas x 2 microbatches end where model.fit
    ends (Adam, 3 epochs, a short last batch)."""
    x, y = models.mlp_data(44)
    reference = models.mlp("adam")        # seeds Keras (set_random_seed(1)) as it builds
    start = reference.get_weights()
    reference.fit(x, y, batch_size=8, epochs=3, shuffle=True, verbose=0)
    results = train_ranks(lambda: models.mlp("adam"), x, y, num_stages=2, num_replicas=2,
                          num_microbatches=2, weights=start, batch_size=8, epochs=3)
    unshuffled = models.mlp("adam")
    unshuffled.set_weights(start)
    unshuffled.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0)
    assert max_diff(reference.get_weights(), unshuffled.get_weights()) > 1e-3  # order matters
    for weights, _ in results:
        assert max_diff(weights, reference.get_weights()) <= 1e-5


def _dropout_model():
    inp = keras.Input((10,))
    h = L.Dense(16, activation="relu")(inp)
    h = L.Dropout(0.3)(h)
    h = L.Dense(16, activation="relu")(h)
    model = keras.Model(inp, L.Dense(3)(h))
    model.compile(optimizer=keras.optimizers.Adam(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def test_set_random_seed_repeats_a_run():
    """Two runs of the same script (set_random_seed(0), build, hf.fit without a seed) give
    the same weights, Dropout and shuffling included; another Keras seed, others."""
    rng = np.random.default_rng(3)
    x, y = rng.normal(size=(48, 10)).astype("float32"), rng.integers(0, 3, 48)

    def run(keras_seed):
        keras.utils.set_random_seed(keras_seed)
        model = _dropout_model()
        hf.fit(model, x, y, batch_size=16, epochs=2, verbose=0)
        return model.get_weights()

    first = run(0)
    assert max_diff(first, run(0)) == 0.0
    assert max_diff(first, run(5)) > 1e-3
