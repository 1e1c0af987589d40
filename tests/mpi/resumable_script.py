"""A run that checkpoints every 2 steps and reports its progress, for the signal tests.

    mpiexec -n 4 python resumable_script.py CKPT_DIR OUT.npz PROGRESS_DIR [resume]
"""

import os
import sys
import time

# Runs compared bit for bit take the same Dense products: untimed (docs/checkpoints.md).
os.environ.setdefault("HYPARFLOW_TRANSPOSED", "1")

import hyparflow as hf  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

ckpt, out, progress = sys.argv[1:4]
resume = len(sys.argv) > 4 and sys.argv[4] == "resume"
os.makedirs(progress, exist_ok=True)
with open(os.path.join(progress, f"pid-{hf.rank()}"), "w") as f:
    f.write(str(os.getpid()))


class Progress(keras.callbacks.Callback):
    """Writes the step count, and slows steps down so a signal lands mid-run."""

    def on_train_batch_end(self, batch, logs=None):
        time.sleep(0.05)
        # Written whole or not at all: a rank killed while writing (mpiexec ends the
        # others when one dies) must not leave an empty file for the test to read.
        part = os.path.join(progress, f".step-{hf.rank()}")  # outside the tests' "step-*"
        with open(part, "w") as f:
            f.write(str(int(self.model.optimizer.iterations.numpy())))
        os.replace(part, os.path.join(progress, f"step-{hf.rank()}"))


keras.utils.set_random_seed(0)
inp = keras.Input((32,))
h = inp
for _ in range(4):
    h = keras.layers.Dense(64, activation="relu")(h)
model = keras.Model(inp, keras.layers.Dense(4)(h))
model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
rng = np.random.default_rng(0)
x = rng.normal(size=(640, 32)).astype("float32")
y = rng.integers(0, 4, 640)
hf.fit(model, x, y, batch_size=32, epochs=3, num_stages=2, num_microbatches=2, seed=1,
       verbose=0, callbacks=[Progress()], checkpoint_dir=ckpt, checkpoint_every=2,
       resume=resume)
if hf.is_main():
    np.savez(out, *model.get_weights())
    print("finished", flush=True)
