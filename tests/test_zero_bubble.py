"""Split backward (B and W) and the zero-bubble schedules ("zb-h1", "zb-batched")
against plain Keras `model.fit`: BatchNorm, a kernel regulariser and a layer called
twice (kernels B computes), deferred Dense kernels (W computes), Adam, recompute,
replicas, tensor splits and tied embeddings."""

import keras
import numpy as np
import pytest

import hyparflow as hf
from conftest import max_diff, train_ranks
from hyparflow import schedule as sched

L = keras.layers
BATCH, EPOCHS = 16, 2


def build(optimizer="sgd", accumulate=None, bn=True):
    """`accumulate`: the reference's optimizer steps once per that many batches (so
    that its BatchNorm sees a microbatch, as a stage does)."""
    keras.utils.set_random_seed(7)
    inp = keras.Input((10,), name="features")
    h = L.Dense(24, activation="relu", name="d0")(inp)
    if bn:
        h = L.BatchNormalization(momentum=0.8, name="bn")(h)
    h = L.Dense(24, activation="tanh", name="d1")(h)
    shared = L.Dense(24, activation="relu", name="shared")  # called twice: B sums its kernel
    h = shared(shared(h))
    h = L.Dense(16, activation="relu", name="reg", kernel_regularizer=keras.regularizers.L2(1e-3))(h)
    h = L.Dense(16, activation="relu", name="d2")(h)
    out = L.Dense(3, name="logits")(h)
    model = keras.Model(inp, out)
    kwargs = {"gradient_accumulation_steps": accumulate} if accumulate else {}
    optimizer = {"sgd": keras.optimizers.SGD(0.05, **kwargs),
                 "adam": keras.optimizers.Adam(1e-3, **kwargs)}[optimizer]
    model.compile(optimizer=optimizer,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def data(n=64):
    rng = np.random.default_rng(3)
    return rng.normal(size=(n, 10)).astype("float32"), rng.integers(0, 3, n)


def reference(optimizer, micro, bn=True):
    """Plain Keras: batches of one microbatch, one step per `micro` of them."""
    x, y = data()
    model = build(optimizer, micro if micro > 1 else None, bn)
    start = model.get_weights()
    model.fit(x, y, batch_size=BATCH // micro, epochs=EPOCHS, shuffle=False, verbose=0)
    return start, model.get_weights()


CASES = [  # (schedule, S, R, M, extra)
    ("zb-h1", 2, 1, 4, {}),
    ("zb-batched", 2, 1, 4, {}),
    ("zb-h1", 3, 1, 4, {}),
    ("zb-batched", 3, 1, 4, {}),
    ("zb-batched", 4, 1, 4, {}),
    ("zb-h1", 4, 1, 2, {}),
    ("zb-batched", 2, 2, 2, {}),                     # replicas: allreduce after the W's
    ("zb-batched", 2, 1, 4, {"recompute": True}),
    ("zb-h1", 3, 1, 2, {"recompute": True}),
]


@pytest.mark.parametrize("optimizer,tol", [("sgd", 1e-5), ("adam", 1e-4)])
@pytest.mark.parametrize("schedule,s,r,m,extra", CASES)
def test_matches_model_fit(schedule, s, r, m, extra, optimizer, tol):
    x, y = data()
    bn = r == 1  # replicas each keep their own BatchNorm statistics
    start, expected = reference(optimizer, r * m, bn)
    results = train_ranks(lambda: build(optimizer, bn=bn), x, y, num_stages=s, num_replicas=r,
                          num_microbatches=m, weights=start, batch_size=BATCH, epochs=EPOCHS,
                          shuffle=False, schedule=schedule, **extra)
    for w, _ in results:
        assert max_diff(w, expected) <= tol
