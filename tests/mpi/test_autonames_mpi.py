"""Keras's auto-names differ between ranks when rank 0 built one more model before
`hf.fit` (an evaluation copy, a reference): the set-up check compares such layer calls by
position and class (engine/prepare.py `identities`), the names the user gave by name.
Run under mpiexec by tests/cluster/test_mpi.py:

    mpiexec -n 4 python -m pytest --with-mpi tests/mpi/test_autonames_mpi.py
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

WORLD = MPI.COMM_WORLD


def block():
    """Tokens [batch, 4, 8]: a feed-forward pair the user named ("up", "down"), then an
    auto-named residual, LayerNormalization, pooling and head."""
    keras.utils.set_random_seed(5)
    inp = keras.Input((4, 8))
    h = keras.layers.Dense(16, activation="gelu", name="up")(inp)
    h = keras.layers.Dense(8, name="down")(h)
    h = keras.layers.Add()([inp, h])
    h = keras.layers.LayerNormalization()(h)
    h = keras.layers.GlobalAveragePooling1D()(h)
    model = keras.Model(inp, keras.layers.Dense(3)(h))
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    return model


def _fit_after_an_extra_model_on_rank_0(**layout):
    rng = np.random.default_rng(7)
    x = rng.normal(size=(16, 4, 8)).astype("float32")
    y = rng.normal(size=(16, 3)).astype("float32")
    start, expected, _ = reference(block, x, y, batch_size=8, epochs=2)
    if WORLD.Get_rank() == 0:
        block()   # the evaluation copy: rank 0's next auto-names are 'add_2', not 'add_1'
    model = block()
    names = WORLD.allgather([layer.name for layer in model.layers])
    assert names[0] != names[1], names   # the case under test: the auto-names differ
    model.set_weights(start)
    hf.fit(model, x, y, batch_size=8, epochs=2, num_microbatches=2, shuffle=False,
           verbose=0, **layout)
    diff = max_diff(model.get_weights(), expected)
    if hf.is_main():
        print(f"\nauto-names differing between ranks, {layout}: max weight difference "
              f"{diff:.3g}")
    assert diff <= 2e-5


@pytest.mark.mpi(min_size=2)
def test_auto_names_differing_between_ranks_with_tensor_layers():
    _fit_after_an_extra_model_on_rank_0(num_tensor=2, num_replicas=WORLD.Get_size() // 2,
                                        tensor_layers=["up", "down"])


@pytest.mark.mpi(min_size=2)
def test_auto_names_differing_between_ranks_in_a_pipeline():
    _fit_after_an_extra_model_on_rank_0(num_stages=2, num_replicas=WORLD.Get_size() // 2)


@pytest.mark.mpi(min_size=4)
def test_auto_names_differing_between_ranks_on_a_2x2_mesh():
    """The mesh region carries the auto-named Add and LayerNormalization after the
    named pair: those were compared by their names, numbered otherwise on rank 0."""
    _fit_after_an_extra_model_on_rank_0(num_tensor=4, tensor_mesh=(2, 2),
                                        num_replicas=WORLD.Get_size() // 4,
                                        tensor_layers=["up", "down"])
