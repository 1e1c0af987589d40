"""Epoch time of keras.io's VAE (784-512-2, dense) through its own train_step
(docs/models.md, "A model's own train_step"): model.fit on one process, or hf.fit
on the ranks mpiexec gives (R = the world size):

    python scripts/bench_own_step.py keras
    HYPARFLOW_INTER_OP_THREADS=1 mpiexec -n 2 python scripts/bench_own_step.py hf
"""
import sys, time
import hyparflow as hf
import keras, numpy as np, tensorflow as tf
from keras import ops

class VAE(keras.Model):
    def __init__(self):
        super().__init__()
        inp = keras.Input((784,))
        h = keras.layers.Dense(512, activation="relu")(inp)
        self.encoder = keras.Model(inp, [keras.layers.Dense(2)(h), keras.layers.Dense(2)(h)])
        z = keras.Input((2,))
        self.decoder = keras.Model(z, keras.layers.Dense(784, activation="sigmoid")(
            keras.layers.Dense(512, activation="relu")(z)))
        self.t = keras.metrics.Mean(name="total_loss")
    @property
    def metrics(self): return [self.t]
    def train_step(self, data):
        x, eps = data[:, :784], data[:, 784:]
        with tf.GradientTape() as tape:
            m, lv = self.encoder(x)
            rec = self.decoder(m + ops.exp(0.5 * lv) * eps)
            r = ops.mean(ops.sum(keras.losses.binary_crossentropy(x[..., None], rec[..., None]), axis=1))
            kl = ops.mean(ops.sum(-0.5 * (1 + lv - ops.square(m) - ops.exp(lv)), axis=1))
            loss = r + kl
        g = tape.gradient(loss, self.trainable_weights)
        self.optimizer.apply_gradients(zip(g, self.trainable_weights))
        self.t.update_state(loss)
        return {"loss": self.t.result()}

keras.utils.set_random_seed(0)
rng = np.random.default_rng(0)
x = np.concatenate([rng.uniform(size=(8192, 784)), rng.normal(size=(8192, 2))], 1).astype("float32")
model = VAE(); model.compile(keras.optimizers.Adam(1e-3))
class T(keras.callbacks.Callback):
    def on_epoch_begin(self, e, logs=None): self.s = time.perf_counter()
    def on_epoch_end(self, e, logs=None): self.times = getattr(self, "times", []) + [time.perf_counter() - self.s]
t = T()
if sys.argv[1] == "keras":
    model.fit(x, batch_size=128, epochs=3, shuffle=False, verbose=0, callbacks=[t])
else:
    hf.fit(model, x, batch_size=128, epochs=3, shuffle=False, verbose=0, callbacks=[t], num_stages=1, num_microbatches=1)
if hf.is_main():
    print(sys.argv[1], hf.size(), "epoch seconds (2nd, 3rd):", [round(v, 2) for v in t.times[1:]], flush=True)
