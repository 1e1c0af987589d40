"""fit and evaluate with verbose="auto" on 2 stages: rank 0's progress only, Keras's bar on
a terminal (the launcher's), one line per epoch otherwise."""

import hyparflow as hf
import keras
import numpy as np

keras.utils.set_random_seed(0)
inp = keras.Input((8,))
model = keras.Model(inp, keras.layers.Dense(3)(keras.layers.Dense(16, activation="relu")(inp)))
model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
rng = np.random.default_rng(0)
x, y = rng.normal(size=(64, 8)).astype("float32"), rng.integers(0, 3, 64)
hf.fit(model, x, y, batch_size=16, epochs=2, num_stages=2)
hf.evaluate(model, x, y, batch_size=16, num_stages=2)
