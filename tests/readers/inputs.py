"""The input forms model.fit takes, built alike for the in-process and mpiexec tests:
each gives the same global batches as `x[i:i+B], y[i:i+B], w[i:i+B]` in order."""

import itertools

import keras
import numpy as np

N, B, FEATURES = 96, 16, 6


def arrays(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 255, size=(N, FEATURES)).astype(np.uint8)
    y = rng.integers(0, 3, N)
    w = rng.uniform(0.5, 2.0, N).astype(np.float32)
    return x, y, w


def mlp():
    keras.utils.set_random_seed(7)
    inp = keras.Input((FEATURES,))
    h = keras.layers.Rescaling(1 / 255.0)(inp)
    h = keras.layers.Dense(16, activation="tanh", name="hidden")(h)
    h = keras.layers.Dense(12, activation="relu", name="middle")(h)
    model = keras.Model(inp, keras.layers.Dense(3, name="logits")(h))
    model.compile(optimizer=keras.optimizers.Adam(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


class Batches(keras.utils.PyDataset):
    """A PyDataset that reads its batches by index, and counts the reads and epoch ends
    (a thread or process worker's count stays in that worker)."""

    def __init__(self, x, y, w, **kwargs):
        super().__init__(**kwargs)
        self.x, self.y, self.w = x, y, w
        self.reads, self.ends = [], 0

    def __len__(self):
        return len(self.x) // B

    def __getitem__(self, i):
        self.reads.append(i)
        s = slice(i * B, (i + 1) * B)
        return self.x[s], self.y[s], self.w[s]

    def on_epoch_end(self):
        self.ends += 1


def generator(x, y, w, repeat=True):
    """The batches in order, again and again (`repeat`), or once."""
    rounds = itertools.count() if repeat else range(1)
    for _ in rounds:
        for i in range(len(x) // B):
            s = slice(i * B, (i + 1) * B)
            yield x[s], y[s], w[s]


def memmap(path, x):
    """`x` written to a file and mapped: read by rows, never loaded whole."""
    m = np.lib.format.open_memmap(str(path), mode="w+", dtype=x.dtype, shape=x.shape)
    m[:] = x
    m.flush()
    return np.load(str(path), mmap_mode="r")


def h5(path, x):
    import h5py

    f = h5py.File(str(path), "w")
    f.create_dataset("x", data=x)
    f.close()
    return h5py.File(str(path), "r")["x"]
