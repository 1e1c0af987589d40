"""hf.layers.ClassBalancedMix: its mixing against NumPy, and under hyparflow.fit the
documented semantics against plain Keras: at one microbatch it mixes within the whole
batch (model.fit's weights), at several within each microbatch, as BatchNorm's
statistics are (model.fit on the microbatches with gradient accumulation)."""

import keras
import numpy as np
import pytest

import hyparflow as hf
from conftest import max_diff, train_ranks

pytestmark = pytest.mark.timeout(300)

RATES = [0.6, 0.3, 0.0]


def test_mixing_against_numpy():
    rng = np.random.default_rng(0)
    features = rng.normal(size=(5, 3, 2)).astype("float32")
    labels = np.array([0, 2, 1, 0, 2])
    layer = hf.layers.ClassBalancedMix(RATES, shift=2)
    mixed = np.asarray(layer([features, labels[:, None]], training=True))
    partner = np.roll(features, 2, axis=0)  # sample i mixes with sample i - 2
    rate = np.array(RATES, "float32")[labels][:, None, None]
    np.testing.assert_allclose(mixed, (1 - rate) * features + rate * partner, rtol=1e-6)
    # One-hot labels pick the same classes; inference passes the features unchanged.
    one_hot = np.eye(3, dtype="float32")[labels]
    np.testing.assert_array_equal(np.asarray(layer([features, one_hot], training=True)), mixed)
    np.testing.assert_array_equal(np.asarray(layer([features, labels], training=False)), features)


def test_rates_from_counts_and_bad_rates():
    layer = hf.layers.ClassBalancedMix.from_counts([100, 50, 10], strength=0.5)
    np.testing.assert_allclose(layer.rates, [0.45, 0.4, 0.0])
    with pytest.raises(ValueError, match=r"class 1 rate 1\.0"):
        hf.layers.ClassBalancedMix([0.2, 1.0])
    with pytest.raises(ValueError, match="shift"):
        hf.layers.ClassBalancedMix([0.2], shift=0)
    config = hf.layers.ClassBalancedMix([0.1, 0.0], shift=3).get_config()
    assert hf.layers.ClassBalancedMix.from_config(config).rates == [0.1, 0.0]


def mixed_model(accumulate=None):
    keras.utils.set_random_seed(5)
    x = keras.Input((10,), name="x")
    label = keras.Input((1,), dtype="int32", name="label")
    h = keras.layers.Dense(12, activation="tanh", name="features")(x)
    h = hf.layers.ClassBalancedMix(RATES, name="mix")([h, label])
    h = keras.layers.Dense(8, activation="tanh", name="head")(h)
    out = keras.layers.Dense(3, name="logits")(h)
    model = keras.Model([x, label], out)
    model.compile(optimizer=keras.optimizers.SGD(0.2, gradient_accumulation_steps=accumulate),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def mixed_data(n=64):
    rng = np.random.default_rng(4)
    y = rng.choice(3, n, p=[0.6, 0.3, 0.1])
    x = (rng.normal(size=(n, 10)) + y[:, None]).astype("float32")
    return [x, y[:, None].astype("int32")], y


@pytest.mark.parametrize("s,r,m", [(2, 1, 1), (2, 1, 2), (1, 2, 2)])
def test_mixing_per_microbatch_is_model_fit_on_the_microbatches(s, r, m):
    """S=2 M=1: model.fit's weights (the partner from the whole batch). R x M > 1:
    model.fit(batch_size=B // (R*M)) accumulating R*M gradients per step."""
    x, y = mixed_data()
    batch, parts = 16, r * m
    reference = mixed_model(parts if parts > 1 else None)
    start = reference.get_weights()
    reference.fit(x, y, batch_size=batch // parts, epochs=2, shuffle=False, verbose=0)
    results = train_ranks(mixed_model, x, y, num_stages=s, num_replicas=r, num_microbatches=m,
                          weights=start, batch_size=batch, epochs=2, shuffle=False)
    for weights, _ in results:
        assert max_diff(weights, reference.get_weights()) <= 1e-5
    if parts > 1:
        # ... and not model.fit's on whole batches, whose partners differ.
        whole = mixed_model()
        whole.set_weights(start)
        whole.fit(x, y, batch_size=batch, epochs=2, shuffle=False, verbose=0)
        assert max_diff(results[0][0], whole.get_weights()) > 1e-4
