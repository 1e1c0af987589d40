"""Cost of the global loss normaliser (docs/models.md, "Losses over the whole batch"): a
per-token model trained with its padding mask reaching the loss (the normaliser, GPipe's
order) and the same model without the mask (1F1B, the last stage fused); prints the
median step time.

    mpiexec -n 2 python benchmarks/normaliser_cost.py mask 1 2    # S=1, R=2
    mpiexec -n 2 python benchmarks/normaliser_cost.py plain 1 2
    mpiexec -n 2 python benchmarks/normaliser_cost.py mask 2 1    # S=2, R=1
"""
import sys, time
import hyparflow as hf, keras, numpy as np
mask = sys.argv[1] == "mask"  # "mask" or "plain"; then num_stages, num_replicas
keras.utils.set_random_seed(1)
inp = keras.Input((32,), dtype="int32")
h = keras.layers.Embedding(1000, 128, mask_zero=mask)(inp)
for _ in range(4):
    h = keras.layers.Dense(256, activation="relu")(h)
out = keras.layers.Dense(32)(h)
model = keras.Model(inp, out)
model.compile(keras.optimizers.SGD(0.01), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
rng = np.random.default_rng(0)
x = rng.integers(1, 1000, (64 * 24, 32)).astype("int32"); x[:, 20:] = 0
y = rng.integers(0, 32, x.shape)
times = []
class T(keras.callbacks.Callback):
    def on_train_batch_end(self, b, logs=None):
        times.append(time.perf_counter())
hf.fit(model, x, y, batch_size=64, epochs=1, num_stages=int(sys.argv[2]), num_replicas=int(sys.argv[3]), num_microbatches=4, shuffle=False, verbose=0, callbacks=[T()])
if hf.is_main():
    d = np.diff(times)[4:]
    print(f"{sys.argv[1:]} median step {1000*np.median(d):.1f} ms")
