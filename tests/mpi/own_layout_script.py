"""A script that chooses its own stages (replicas left to the default): it must train to
plain model.fit's weights however it is launched (mpiexec, hyparflow run, srun, sbatch)."""

import os

import hyparflow as hf
import keras
import numpy as np


def build():
    keras.utils.set_random_seed(0)
    inp = keras.Input((8,))
    h = keras.layers.Dense(16, activation="relu")(inp)
    h = keras.layers.Dense(16, activation="relu")(h)
    model = keras.Model(inp, keras.layers.Dense(3)(h))
    model.compile(optimizer="adam",
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


rng = np.random.default_rng(0)
x, y = rng.normal(size=(64, 8)).astype("float32"), rng.integers(0, 3, 64)
reference = build()
reference.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
model = build()
hf.fit(model, x, y, batch_size=16, epochs=2, shuffle=False, verbose=0, num_stages=2)
diff = max(float(np.max(np.abs(a - b)))
           for a, b in zip(model.get_weights(), reference.get_weights()))
exported = sorted(k for k in os.environ if k.startswith("HYPARFLOW_NUM_"))
if hf.is_main():
    print(f"own layout: {hf.size()} ranks, max weight difference {diff:.2e}, "
          f"environment {exported}", flush=True)
assert diff < 1e-5, diff
