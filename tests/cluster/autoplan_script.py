"""A training script that fixes no layout, for `hyparflow run` without -n
(tests/cluster/test_run_plans.py): a small MLP, so that planning the node takes
seconds, not minutes; rank 0 says how it ran and the weights' distance to model.fit's."""

import hyparflow as hf
import keras
import numpy as np

from hyparflow import _env


def build():
    keras.utils.set_random_seed(3)
    inp = keras.Input((16,))
    h = keras.layers.Dense(32, activation="relu")(inp)
    model = keras.Model(inp, keras.layers.Dense(4)(h))
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    return model


rng = np.random.default_rng(0)
x = rng.normal(size=(64, 16)).astype("float32")
y = rng.normal(size=(64, 4)).astype("float32")
reference = build()   # plain Keras first: rank 0's auto-names differ from the capture's
start = reference.get_weights()
reference.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
model = build()
model.set_weights(start)
hf.fit(model, x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
diff = max(float(np.max(np.abs(a - b))) for a, b in zip(model.get_weights(),
                                                        reference.get_weights()))
if hf.is_main():
    print(f"trained: {hf.size()} ranks x {_env.configured_threads()} threads, max weight "
          f"difference {diff:.3g}", flush=True)
