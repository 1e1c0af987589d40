"""BatchNormalization through TensorFlow's fused kernel (`engine/norms.py`): the weights
and moving statistics of plain Keras, the path taken where it may be and Keras's own call
everywhere else."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from conftest import max_diff, train_ranks
from hyparflow.engine import norms

L = keras.layers


def model(accumulate):
    """Every shape the path takes: images (NHWC), rows, sequences; without centre, scale,
    with a small epsilon; one BatchNormalization over axis 1 (Keras's call) and one
    frozen (Keras's call: it normalizes by its moving statistics). No bias before a
    normalization: Adam would turn the round-off of its zero gradient into steps."""
    keras.utils.set_random_seed(40)
    image = keras.Input((6, 6, 2))
    x = L.Conv2D(4, 3, padding="same", use_bias=False)(image)
    x = L.Activation("relu")(L.BatchNormalization(momentum=0.8)(x))
    x = L.BatchNormalization(axis=1)(x)
    x = L.Conv2D(3, 3, strides=2, use_bias=False)(x)
    x = L.BatchNormalization(center=False, epsilon=1e-6)(x)
    x = L.Flatten()(x)
    frozen = L.BatchNormalization()
    frozen.trainable = False
    x = frozen(L.Dense(8, use_bias=False)(x))
    x = L.BatchNormalization(scale=False)(L.Dense(10, use_bias=False)(x))
    x = L.Activation("relu")(L.Reshape((5, 2))(x))
    x = L.BatchNormalization(momentum=0.9)(L.Dense(6, use_bias=False)(x))
    out = L.Dense(3)(L.Flatten()(x))
    m = keras.Model(image, out)
    # Adam's epsilon above the square roots of round-off: one kernel entry's gradient
    # here is near zero, and Keras's own path moved it by 4e-5 between layouts.
    m.compile(optimizer=keras.optimizers.Adam(0.01, epsilon=1e-5,
                                              gradient_accumulation_steps=accumulate),
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return m


def data():
    rng = np.random.default_rng(40)
    return (rng.normal(size=(48, 6, 6, 2)) * 2 + 0.5).astype("float32"), rng.integers(0, 3, 48)


def split(weights, like):
    moving = ["moving" in v.path for v in like.weights]
    return ([w for w, m in zip(weights, moving) if not m],
            [w for w, m in zip(weights, moving) if m])


@pytest.mark.parametrize("stages,replicas,micro", [(1, 1, 1), (2, 1, 2), (1, 2, 2)])
def test_fused_batchnorm_trains_to_model_fits_weights(stages, replicas, micro, monkeypatch):
    calls = []
    plain = norms.Fused._takes

    def counted(self, x, mask):
        calls.append(plain(self, x, mask))
        return calls[-1]

    monkeypatch.setattr(norms.Fused, "_takes", counted)
    x, y = data()
    slices = replicas * micro
    # One process, each microbatch normalized by its own statistics: B / (R*M) rows a
    # batch, one update per R*M of them.
    reference = model(slices if slices > 1 else None)
    start = reference.get_weights()
    reference.fit(x, y, batch_size=16 // slices, epochs=2, shuffle=False, verbose=0)
    want, want_moving = split(reference.get_weights(), reference)
    results = train_ranks(lambda: model(None), x, y, num_stages=stages, num_replicas=replicas,
                          num_microbatches=micro, weights=start, batch_size=16, epochs=2,
                          shuffle=False)
    for weights, _ in results:
        got, moving = split(weights, reference)
        assert max_diff(got, want) <= 1e-5
        if replicas == 1:
            assert max_diff(moving, want_moving) <= 1e-5
        assert max_diff(weights, results[0][0]) == 0.0
    # Four of the six normalizations take the path (not axis 1, not the frozen one),
    # each wherever its stage traces its training call.
    assert calls.count(True) >= 4 and True in calls


def test_only_plain_trainable_last_axis_calls_take_the_path(monkeypatch):
    m = model(None)
    found = [layer for layer in m.layers if isinstance(layer, L.BatchNormalization)]
    assert [norms.eligible(layer, "float32") for layer in found] == [
        True, False, True, True, True, True]
    assert not norms.eligible(found[0], "float64")
    frozen = norms.Fused(found[3])  # eligible by kind, refused at its call: not trainable
    assert not frozen._takes(tf.zeros((2, 8)), None)
    monkeypatch.setenv("HYPARFLOW_FUSED_NORM", "0")
    assert not norms.eligible(found[0], "float32")


def test_a_masked_call_is_kerass_own():
    """With a Keras mask the statistics leave the padding out: Keras's call, not the
    kernel, whatever the layer."""
    keras.utils.set_random_seed(41)
    ids = keras.Input((5,), dtype="int32")
    x = L.Embedding(9, 4, mask_zero=True)(ids)
    normed = L.BatchNormalization()
    x = normed(x)
    m = keras.Model(ids, L.GlobalAveragePooling1D()(x))
    ids_value = np.array([[1, 2, 0, 0, 0], [3, 4, 5, 0, 0]], "int32")
    fused = norms.Fused(normed)
    embedded = m.layers[1](ids_value)
    mask = embedded._keras_mask
    assert not fused._takes(embedded, mask)
    want = normed(embedded, training=True, mask=mask)
    got = fused([embedded], {"mask": mask})
    assert np.array_equal(np.asarray(got), np.asarray(want))


def late_model(accumulate):
    """Two late BatchNormalizations on 1x1 maps: with microbatches of 4 each normalises 4
    values per channel, where keras.applications models at 32x32 amplify round-off
    (docs/models.md). Adam with its default epsilon; no bias before a normalization."""
    keras.utils.set_random_seed(42)
    image = keras.Input((4, 4, 3))
    x = L.Conv2D(8, 3, strides=2, padding="same", use_bias=False)(image)
    x = L.Activation("relu")(L.BatchNormalization()(x))
    x = L.Conv2D(8, 2, use_bias=False)(x)                       # a 1x1 map from here
    x = L.Activation("relu")(L.BatchNormalization()(x))
    x = L.Conv2D(6, 1, use_bias=False)(x)
    x = L.Activation("relu")(L.BatchNormalization(epsilon=1.001e-5)(x))
    out = L.Dense(3)(L.Flatten()(x))
    m = keras.Model(image, out)
    m.compile(optimizer=keras.optimizers.Adam(0.01, gradient_accumulation_steps=accumulate),
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return m


def test_four_values_per_channel_train_to_model_fits_weights(monkeypatch):
    """S=2 M=2 on batches of 8: the last two normalizations see 4 values per channel,
    through the fused kernel, and training ends at model.fit's weights (microbatches of
    4, two accumulated) to round-off."""
    calls = []
    plain = norms.Fused._takes

    def counted(self, x, mask):
        calls.append((plain(self, x, mask), x.shape[1:3]))
        return calls[-1][0]

    monkeypatch.setattr(norms.Fused, "_takes", counted)
    rng = np.random.default_rng(42)
    x = rng.uniform(0, 4, (32, 4, 4, 3)).astype("float32")
    y = rng.integers(0, 3, 32)
    reference = late_model(2)
    start = reference.get_weights()
    reference.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    want = reference.get_weights()
    results = train_ranks(lambda: late_model(None), x, y, num_stages=2, num_replicas=1,
                          num_microbatches=2, weights=start, batch_size=8, epochs=2,
                          shuffle=False)
    for weights, _ in results:
        # Measured: 8.9e-7 (Keras's own, inputs moved by 1e-7: 5.1e-7; the update 0.33).
        # The kernel's epsilon 1 % off would end 6.9e-5 away.
        assert max_diff(weights, want) <= 1e-5
    assert (True, (1, 1)) in calls   # a 1x1 map's normalization took the fused path
