"""A mistake in the user's own data or compile: `python user_error_script.py KIND keras`
shows what model.fit prints; under mpiexec with `hyparflow`, what hyparflow.fit prints.

KIND: shape (inputs of the wrong width), labels (a class id past the outputs), loss (a
loss that does not match the output); newcomers' first mistakes in hf.fit's own arguments
(hyparflow only): ranks (num_stages=3 on 2 ranks), schedule (an unknown one), keyword (a
mistyped keyword, num_stage=2)."""

import sys

import hyparflow as hf
import keras
import numpy as np

KIND, WHO = sys.argv[1], sys.argv[2]
rng = np.random.default_rng(0)
x = rng.normal(size=(64, 5 if KIND == "shape" else 8)).astype("float32")
y = rng.integers(0, 4, 64)
if KIND == "labels":
    y[3] = 6   # the only label past the 4 outputs, in the first batch (no shuffling)
keras.utils.set_random_seed(0)
inp = keras.Input((8,))
h = keras.layers.Dense(16, activation="relu")(inp)
model = keras.Model(inp, keras.layers.Dense(4)(h))
loss = "categorical_crossentropy" if KIND == "loss" else "sparse_categorical_crossentropy"
model.compile(optimizer="sgd", loss=loss)
MISTAKES = {"ranks": dict(num_stages=3), "schedule": dict(num_stages=2, schedule="1fb1"),
            "keyword": dict(num_stage=2)}
if WHO == "keras":
    model.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
elif KIND in MISTAKES:
    hf.fit(model, x, y, batch_size=16, epochs=1, verbose=0, shuffle=False, **MISTAKES[KIND])
else:
    hf.fit(model, x, y, batch_size=16, epochs=1, verbose=0, num_stages=2, shuffle=False)
print("finished without the error", flush=True)
