"""The mesh at q = 3 (9 tensor ranks) trains to model.fit's weights, and what each rank
holds as the runtime counts it (`History.memory`): weights and Adam's state in blocks
of 1/q^2 (kernels) and 1/q (biases, alike down a column), activations kept for the
backward in blocks of 1/q^2 inside the region and whole outside it."""

import keras
import numpy as np

import hyparflow
from conftest import max_diff, reference
from hyparflow.engine.local import run_ranks

REGION = ["up", "mid", "down"]


def mlp3():
    """Widths divisible by 3, so every block of the 3x3 mesh is the same size."""
    keras.utils.set_random_seed(4)
    inp = keras.Input((12,))
    h = keras.layers.Dense(18, activation="relu", name="up")(inp)
    g = keras.layers.Dense(24, activation="gelu", name="mid")(h)
    g = keras.layers.Dense(18, name="down")(g)
    r = keras.layers.Add(name="res")([h, g])
    out = keras.layers.Dense(3, name="head")(r)
    model = keras.Model(inp, out)
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    return model


def test_a_3x3_mesh_trains_as_model_fit_and_holds_its_ninth():
    rng = np.random.default_rng(5)
    x = rng.normal(size=(36, 12)).astype("float32")
    y = rng.normal(size=(36, 3)).astype("float32")
    start, want, _ = reference(mlp3, x, y, epochs=1, batch_size=18)

    def body(comm, **layout):
        model = mlp3()
        model.set_weights(start)
        history = hyparflow.fit(model, x, y, epochs=1, batch_size=18, shuffle=False,
                                verbose=0, comm=comm, **layout)
        return model.get_weights(), history.memory

    [(_, whole)] = run_ranks(1, body, timeout=120)
    mesh = run_ranks(9, lambda comm: body(comm, num_tensor=9, tensor_mesh=(3, 3),
                                          tensor_layers=REGION), timeout=300)
    model = mlp3()
    layers = {layer.name: layer for layer in model.layers}
    # Weights per rank: each region kernel's block (1/9), its bias's column block (1/3);
    # the head whole. Bytes of float32.
    region = sum(int(np.prod(layers[n].kernel.shape)) / 9 + layers[n].units / 3 for n in REGION)
    head = int(np.prod(layers["head"].kernel.shape)) + 3
    assert whole["weights"] == 4 * sum(int(np.prod(w.shape)) for w in model.weights)
    # Activations kept per sample: every layer call's input once (x, h, mid's output,
    # down's, the Add's); the head's (the Add's output, gathered for it) whole, the
    # rest in ninths.
    head_input = 18 * 4
    assert whole["kept_per_sample"] == (12 + 18 + 24 + 18 + 18) * 4
    for weights, memory in mesh:
        assert max_diff(weights, want) < 2e-5
        assert memory["weights"] == 4 * (region + head)
        # Adam: two slots per weight, plus the same scalars (its step count, rate).
        assert (memory["optimizer"] - 2 * memory["weights"]
                == whole["optimizer"] - 2 * whole["weights"])
        assert memory["kept_per_sample"] == (whole["kept_per_sample"] - head_input) / 9 + head_input
