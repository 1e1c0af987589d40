"""2D tensor parallelism (`tensor_mesh`, kinds/mesh): a stage's q x q tensor ranks run
Dense layers by SUMMA with activations in blocks; every layout trains to plain
`model.fit`'s weights."""

import os

os.environ.setdefault("HYPARFLOW_INTER_OP_THREADS", "4")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import hyparflow  # noqa: E402
from conftest import max_diff, reference, train_ranks  # noqa: E402

pytestmark = pytest.mark.timeout(300) if hasattr(pytest.mark, "timeout") else []

REGION = ["up", "mid", "down"]


def mlp(optimizer="sgd"):
    """A Dense chain with ReLU, a residual Add inside the region and a head outside it."""
    keras.utils.set_random_seed(1)
    inp = keras.Input((12,))
    h = keras.layers.Dense(16, activation="relu", name="up")(inp)
    g = keras.layers.Dense(18, name="mid")(h)
    g = keras.layers.Activation("gelu", name="act")(g)
    g = keras.layers.Dense(16, name="down")(g)
    r = keras.layers.Add(name="res")([h, g])
    r = keras.layers.ReLU(name="relu")(r)
    out = keras.layers.Dense(3, name="head")(r)
    model = keras.Model(inp, out)
    opt = keras.optimizers.SGD(0.05) if optimizer == "sgd" else keras.optimizers.Adam(1e-2)
    model.compile(optimizer=opt, loss="mse")
    return model


def data(n=32):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 12)).astype("float32"), rng.normal(size=(n, 3)).astype("float32")


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_mlp_on_a_2x2_mesh_trains_as_model_fit(optimizer):
    x, y = data()
    build = lambda: mlp(optimizer)  # noqa: E731
    start, want, _ = reference(build, x, y, epochs=2, batch_size=16)
    got = train_ranks(build, x, y, num_stages=1, num_replicas=1, num_microbatches=2,
                      weights=start, num_tensor=4, tensor_mesh=(2, 2), tensor_layers=REGION,
                      epochs=2, batch_size=16, shuffle=False)
    for weights, _ in got:
        assert max_diff(weights, want) < 2e-5
