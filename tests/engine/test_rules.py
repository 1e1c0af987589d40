"""The stated rules for state (BatchNorm), randomness (Dropout) and mixed precision."""

import keras
import numpy as np
import pytest

from conftest import max_diff, train_ranks

L = keras.layers


def bn_model(accumulate=None):
    keras.utils.set_random_seed(30)
    inp = keras.Input((6,))
    x = L.Dense(12)(inp)
    x = L.BatchNormalization(momentum=0.8)(x)
    x = L.Activation("relu")(x)
    x = L.Dense(12)(x)
    x = L.BatchNormalization(momentum=0.8)(x)
    out = L.Dense(3, activation="softmax")(L.Activation("relu")(x))
    model = keras.Model(inp, out)
    opt = keras.optimizers.SGD(0.05, gradient_accumulation_steps=accumulate) if accumulate else keras.optimizers.SGD(0.05)
    model.compile(optimizer=opt, loss="sparse_categorical_crossentropy")
    return model


def bn_data():
    rng = np.random.default_rng(30)
    return (rng.normal(size=(64, 6)) * 2 + 1).astype("float32"), rng.integers(0, 3, 64)


def moving_stats(weights_of_model, model):
    names = [v.path for v in model.weights]
    return [w for w, n in zip(weights_of_model, names) if "moving" in n]


@pytest.mark.parametrize("stages,replicas,micro", [(1, 1, 2), (3, 1, 4), (2, 2, 2)])
def test_batchnorm_matches_gradient_accumulation_over_the_same_slices(stages, replicas, micro):
    x, y = bn_data()
    slices = replicas * micro
    reference = bn_model(accumulate=slices)
    start = reference.get_weights()
    # One process: batches of B / (R*M) contiguous samples, one update per R*M of them.
    reference.fit(x, y, batch_size=16 // slices, epochs=2, shuffle=False, verbose=0)
    expected = reference.get_weights()
    trainable = [not ("moving" in v.path) for v in reference.weights]
    results = train_ranks(bn_model, x, y, num_stages=stages, num_replicas=replicas,
                          num_microbatches=micro, weights=start, batch_size=16, epochs=2,
                          shuffle=False)
    for w, _ in results:
        got = [a for a, t in zip(w, trainable) if t]
        want = [a for a, t in zip(expected, trainable) if t]
        assert max_diff(got, want) <= 1e-5
        # Every rank holds one agreed value of the moving statistics.
        assert max_diff(w, results[0][0]) == 0.0
    if replicas == 1:
        # One replica updates the statistics microbatch by microbatch, as one process does.
        got = [a for a, t in zip(results[0][0], trainable) if not t]
        want = [a for a, t in zip(expected, trainable) if not t]
        assert max_diff(got, want) <= 1e-5


def dropout_model():
    keras.utils.set_random_seed(31)
    inp = keras.Input((10,))
    x = L.Dense(16, activation="relu")(inp)
    x = L.Dropout(0.3)(x)
    x = L.Dense(16, activation="relu")(x)
    x = L.GaussianNoise(0.2)(x)
    x = L.Dense(16, activation="relu")(x)
    x = L.Dropout(0.5)(x)
    out = L.Dense(3, activation="softmax")(x)
    model = keras.Model(inp, out)
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="sparse_categorical_crossentropy")
    return model


def test_dropout_is_reproducible_and_independent_of_the_number_of_stages():
    rng = np.random.default_rng(31)
    x, y = rng.normal(size=(64, 10)).astype("float32"), rng.integers(0, 3, 64)
    start = dropout_model().get_weights()

    def run(stages, seed):
        results = train_ranks(dropout_model, x, y, num_stages=stages, num_replicas=1,
                              num_microbatches=2, weights=start, batch_size=16, epochs=2,
                              seed=seed)
        return results[0][0]

    one = run(1, seed=5)
    assert max_diff(one, run(1, seed=5)) == 0.0            # reproducible
    assert max_diff(one, run(3, seed=5)) <= 1e-6           # the same with 3 stages
    assert max_diff(one, run(7, seed=5)) <= 1e-6           # and with one stage per layer call
    assert max_diff(one, run(1, seed=6)) > 1e-4            # the seed matters
    assert max_diff(one, start) > 1e-4                     # it trained


def test_mixed_bfloat16_trains_with_bfloat16_boundaries():
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        keras.utils.set_random_seed(32)

        def build():
            keras.utils.set_random_seed(32)
            inp = keras.Input((8,))
            x = L.Dense(32, activation="relu")(inp)
            x = L.Dense(32, activation="relu")(x)
            out = L.Dense(3, activation="softmax", dtype="float32")(x)
            model = keras.Model(inp, out)
            model.compile(optimizer=keras.optimizers.SGD(0.05), loss="sparse_categorical_crossentropy")
            return model

        rng = np.random.default_rng(32)
        x, y = rng.normal(size=(64, 8)).astype("float32"), rng.integers(0, 3, 64)
        reference = build()
        start = reference.get_weights()
        assert all(w.dtype == np.float32 for w in start)  # variables stay float32
        reference.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
        from hyparflow.graph import from_model
        from hyparflow.engine.partition import partition
        g = from_model(reference)
        part = partition(g, 3)
        assert {g.tensors[e.tensor].dtype for e in part.edges} == {"bfloat16"}
        results = train_ranks(build, x, y, num_stages=3, num_replicas=1, num_microbatches=2,
                              weights=start, batch_size=16, epochs=2, shuffle=False)
        # bfloat16 keeps 8 bits of mantissa: agreement to its round-off, not float32's.
        assert max_diff(results[0][0], reference.get_weights()) <= 2e-2
        assert max_diff(results[0][0], start) > 1e-3
    finally:
        keras.mixed_precision.set_global_policy("float32")
