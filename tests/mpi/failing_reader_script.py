"""A run whose generator fails on its third batch (on rank 0, the rank that reads it):
every rank must stop, quickly, with the error named."""

import hyparflow as hf
import keras
import numpy as np


def batches():
    rng = np.random.default_rng(0)
    for _ in range(2):
        yield rng.normal(size=(8, 4)).astype("float32"), rng.integers(0, 2, 8)
    raise OSError("injected: the data's disk is gone")


keras.utils.set_random_seed(0)
inp = keras.Input((4,))
model = keras.Model(inp, keras.layers.Dense(2)(keras.layers.Dense(8)(inp)))
model.compile(optimizer="adam",
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
hf.fit(model, batches(), steps_per_epoch=5, epochs=1, verbose=0)
print("finished without the failure", flush=True)
