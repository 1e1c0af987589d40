"""The optimizer step shared out over replicas (ZeRO-1) over real MPI messages; run
under mpiexec by tests/cluster/test_mpi.py:

    mpiexec -n 2 python -m pytest --with-mpi tests/mpi/test_zero_mpi.py
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import hyparflow as hf  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from mpi4py import MPI  # noqa: E402

from conftest import max_diff, reference  # noqa: E402
from hyparflow.engine import shm  # noqa: E402

SIZE = MPI.COMM_WORLD.Get_size()


def wide_adam():
    """Kernels of 256 x 512 floats: every part and every message far past 64 KB."""
    keras.utils.set_random_seed(9)
    inp = keras.Input((32,))
    h = keras.layers.Dense(256, activation="relu")(inp)
    h = keras.layers.Dense(512, activation="relu")(h)
    h = keras.layers.Dense(256, activation="relu")(h)
    model = keras.Model(inp, keras.layers.Dense(4)(h))
    model.compile(optimizer=keras.optimizers.Adam(0.001), loss="mse")
    return model


def table_adam():
    """An Embedding of 4,000 x 32 (512 KB) whose rows are shared out by the replicas."""
    keras.utils.set_random_seed(10)
    inp = keras.Input((8,), dtype="int32")
    h = keras.layers.Embedding(4000, 32)(inp)
    h = keras.layers.GlobalAveragePooling1D()(h)
    model = keras.Model(inp, keras.layers.Dense(4)(h))
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    return model


def data(kind):
    rng = np.random.default_rng(4)
    x = (rng.integers(0, 4000, (64, 8)).astype("int32") if kind == "table"
         else rng.normal(size=(64, 32)).astype("float32"))
    return x, rng.normal(size=(64, 4)).astype("float32")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("kind", ["wide", "table"])
def test_sharded_optimizer_step_matches_model_fit(kind, monkeypatch):
    """As messages to the owners (the default), and at two ranks through the node's
    shared window too (HYPARFLOW_SHARED_SUMS=1)."""
    monkeypatch.setenv("HYPARFLOW_ZERO", "1")
    build = wide_adam if kind == "wide" else table_adam
    x, y = data(kind)
    start, expected, _ = reference(build, x, y, epochs=2, batch_size=16)
    layouts = {4: [(1, 4, 1, "0"), (2, 2, 2, "0")]}.get(SIZE, [(1, SIZE, 2, "0"),
                                                             (1, SIZE, 2, "1")])
    for s, r, m, window in layouts:
        monkeypatch.setenv("HYPARFLOW_SHARED_SUMS", window)
        model = build()
        model.set_weights(start)
        before = shm.used()
        hf.fit(model, x, y, batch_size=16, epochs=2, num_stages=s, num_replicas=r,
               num_microbatches=m, shuffle=False, verbose=0)
        windowed = shm.used() > before
        diff = max_diff(model.get_weights(), expected)
        # Each rank held only its share of Adam's moments.
        slots = sum(int(np.prod(v.shape)) for v in model.optimizer.variables if len(v.shape))
        whole = 2 * sum(int(np.prod(v.shape)) for v in model.weights)
        if hf.is_main():
            print(f"\nzero {kind} (S,R,M)={(s, r, m)} max weight difference {diff:.3g}, "
                  f"slots {slots} of {whole}, HYPARFLOW_SHARED_SUMS={window}")
        assert diff <= 1e-5, f"{kind} (S,R,M)={(s, r, m)}: {diff}"
        assert slots < whole / s, (slots, whole)
        assert windowed == (window == "1"), (s, r, window, windowed)


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("layout", [dict(num_replicas=4),
                                    dict(num_stages=2, num_replicas=2, num_microbatches=2),
                                    dict(num_tensor=2, num_replicas=2)])
def test_sharded_step_through_the_window_with_stages_or_tensor_ranks(layout, monkeypatch):
    """Four replicas, pairs of replicas of a pipeline stage, or of tensor ranks, sum
    through their node's window (HYPARFLOW_SHARED_SUMS=1): the split layers' parts are
    summed whole there (every rank gets them), the rest by owner."""
    monkeypatch.setenv("HYPARFLOW_ZERO", "1")
    monkeypatch.setenv("HYPARFLOW_SHARED_SUMS", "1")
    x, y = data("wide")
    start, expected, _ = reference(wide_adam, x, y, epochs=2, batch_size=16)
    model = wide_adam()
    model.set_weights(start)
    before = shm.used()
    hf.fit(model, x, y, batch_size=16, epochs=2, shuffle=False, verbose=0, **layout)
    diff = max_diff(model.get_weights(), expected)
    if hf.is_main():
        print(f"\nzero through the window {layout}: max weight difference {diff:.3g}")
    assert diff <= 1e-5, (layout, diff)
    assert shm.used() > before
