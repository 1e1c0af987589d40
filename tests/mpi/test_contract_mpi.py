"""The numerical contract over real MPI messages; run under mpiexec by tests/test_mpi.py.

    mpiexec -n 2 python -m pytest --with-mpi tests/mpi
    mpiexec -n 4 python -m pytest --with-mpi tests/mpi
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import hyparflow as hf  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from mpi4py import MPI  # noqa: E402

import models  # noqa: E402

SIZE = MPI.COMM_WORLD.Get_size()


def configs():
    return {2: [(2, 1, 4), (1, 2, 1)], 4: [(2, 2, 2), (4, 1, 4)]}.get(SIZE, [(1, SIZE, 1)])


def wide_mlp():
    """Boundary messages of 16 x 1024 floats = 64 KB: past MPICH's eager limit."""
    keras.utils.set_random_seed(7)
    inp = keras.Input((64,))
    h = inp
    for _ in range(4):
        h = keras.layers.Dense(1024, activation="relu")(h)
    model = keras.Model(inp, keras.layers.Dense(4)(h))
    model.compile(optimizer=keras.optimizers.SGD(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


def wide_data():
    rng = np.random.default_rng(3)
    return rng.normal(size=(80, 64)).astype("float32"), rng.integers(0, 4, 80)


CASES = {
    "wide_mlp": (wide_mlp, wide_data, None, 32),
    "skip_cnn": (models.skip_cnn, models.skip_cnn_data, models.SKIP_CNN_BALANCE, 16),
    "two_in_two_out": (models.two_in_two_out, models.two_in_two_out_data, None, 16),
}


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("case", sorted(CASES))
def test_same_weights_as_one_process(case):
    build, data, balance, batch = CASES[case]
    x, y = data()
    reference = build()
    start = reference.get_weights()
    expected_history = reference.fit(x, y, batch_size=batch, epochs=2, shuffle=False, verbose=0).history
    expected = reference.get_weights()
    for s, r, m in configs():
        model = build()
        model.set_weights(start)
        history = hf.fit(model, x, y, batch_size=batch, epochs=2, num_stages=s, num_replicas=r,
                         num_microbatches=m, shuffle=False, verbose=0,
                         balance=balance.get(s) if balance else None)
        diff = max(float(np.abs(a - b).max()) for a, b in zip(model.get_weights(), expected))
        if hf.is_main():
            print(f"\n{case} (S,R,M)={(s, r, m)} max weight difference {diff:.3g}")
        assert diff <= 1e-5, f"{case} (S,R,M)={(s, r, m)}: {diff}"
        everyone = MPI.COMM_WORLD.allgather(history.history)
        assert all(h == everyone[0] for h in everyone)
        for key, values in expected_history.items():
            np.testing.assert_allclose(history.history[key], values, rtol=1e-5, atol=1e-6)


@pytest.mark.mpi(min_size=2)
def test_shuffle_is_agreed_and_seeded():
    x, y = models.mlp_data(64)
    results = []
    for _ in range(2):
        model = models.mlp()
        hf.fit(model, x, y, batch_size=16, epochs=2, num_stages=2, seed=11, verbose=0)
        results.append(model.get_weights())
    for a, b in zip(*results):
        np.testing.assert_array_equal(a, b)
