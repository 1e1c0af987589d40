"""A collective call made on some ranks only: `python collective_script.py KIND` under
`mpiexec -n 2`, started by tests/cluster/test_mpi.py.

KIND: main_only (hf.fit on every rank, then hf.evaluate on rank 0 only; rank 1's script
ends), different (hf.fit, then rank 0 in hf.evaluate while rank 1 is in hf.predict)."""

import sys

import hyparflow as hf
import keras
import numpy as np

KIND = sys.argv[1]
rng = np.random.default_rng(0)
x, y = rng.normal(size=(64, 8)).astype("float32"), rng.integers(0, 4, 64)
keras.utils.set_random_seed(0)
inp = keras.Input((8,))
model = keras.Model(inp, keras.layers.Dense(4)(keras.layers.Dense(16, activation="relu")(inp)))
model.compile(optimizer="sgd",
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
hf.fit(model, x, y, batch_size=16, epochs=1, verbose=0)
if KIND == "main_only":
    if hf.is_main():
        hf.evaluate(model, x, y, verbose=0)     # the mistake: rank 1 never comes
elif hf.is_main():
    hf.evaluate(model, x, y, verbose=0)
else:
    hf.predict(model, x, verbose=0)
print(f"rank {hf.rank()} finished without the error", flush=True)
