"""A training run in which one rank raises mid-step: every rank must stop, quickly."""

import sys

import hyparflow as hf
import keras
import numpy as np

FAIL_RANK, FAIL_STEP = int(sys.argv[1]), int(sys.argv[2])


class FailsOnce(keras.layers.Layer):
    """Identity, except on FAIL_RANK after FAIL_STEP calls (eager only)."""

    calls = 0

    def call(self, x):
        FailsOnce.calls += 1
        if hf.rank() == FAIL_RANK and FailsOnce.calls > FAIL_STEP:
            raise RuntimeError(f"injected failure in {self.name}")
        return x


keras.utils.set_random_seed(0)
inp = keras.Input((16,))
h = keras.layers.Dense(32, activation="relu")(inp)
h = FailsOnce(name="fails_once")(h)
h = keras.layers.Dense(32, activation="relu")(h)
h = FailsOnce(name="fails_twice")(h)
model = keras.Model(inp, keras.layers.Dense(2)(h))
model.compile(optimizer="sgd", loss="mse")
x = np.random.default_rng(0).normal(size=(256, 16)).astype("float32")
y = np.zeros((256, 2), "float32")
hf.fit(model, x, y, batch_size=32, epochs=3, num_stages=2, num_microbatches=2,
       verbose=0, run_eagerly=True)
print("finished without the failure", flush=True)
