"""Allreduces that start inside the last backward keep the numerical contract."""

import functools
import json
import threading

import keras
import numpy as np

import pytest
from keras import layers as L

import models
from conftest import max_diff, reference, train_ranks
from hyparflow.engine import overlap


@pytest.fixture
def small_buckets(monkeypatch):
    # On (by default only when ranks span nodes), with buckets of a few hundred
    # bytes: every layer gets its own, so some start while earlier layers are
    # still in backward.
    monkeypatch.setenv("HYPARFLOW_OVERLAP", "1")
    monkeypatch.setattr(overlap, "BUCKET_BYTES", 600)



def allreduces(path):
    trace = json.loads(path.read_text())
    return [e for e in trace["traceEvents"] if e["ph"] == "X" and e["cat"] == "allreduce"]


@functools.cache  # one plain Keras run for every layout below (tests only read it)
def adam_reference():
    return reference(lambda: models.mlp(optimizer="adam"), *models.mlp_data())


@pytest.mark.parametrize("config,options", [
    ((1, 2, 2), {}),                                  # one stage: fused forward+backward
    ((2, 2, 2), {}),                                  # first stage: taped backward
    ((2, 2, 3), {"schedule": "gpipe"}),
    ((2, 2, 2), {"recompute": True}),                 # backward replays the forward
    ((1, 3, 1), {"run_eagerly": True}),
])
def test_early_buckets_give_plain_keras_weights(small_buckets, tmp_path, config, options):
    x, y = models.mlp_data()
    start, expected, _ = adam_reference()
    s, r, m = config
    path = tmp_path / "run.json"
    results = train_ranks(lambda: models.mlp("adam"), x, y, num_stages=s, num_replicas=r,
                          num_microbatches=m, weights=start, batch_size=16, epochs=3,
                          shuffle=False, trace=str(path), **options)
    assert max(max_diff(w, expected) for w, _ in results) <= 1e-5
    for w, _ in results[1:]:
        assert max_diff(w, results[0][0]) == 0.0
    events = allreduces(path)
    assert len(events) == 3 * 7 * s * r  # 3 epochs of 100 samples in batches of 16
    for rank in range(s * r):
        first, *later = [e["args"] for e in events if e["tid"] == rank]
        # Every gradient is made in each step's last backward here. At the first
        # step every bucket starts from inside it; after, all but the last (which
        # would start at the end anyway: its gradients are not reported).
        assert first["buckets"] >= 2 and first["inside"] == first["buckets"], first
        for step in later:
            assert step["buckets"] >= 2 and step["inside"] == step["buckets"] - 1, step


def tied_model(accumulate=None):
    """A weight used by both stages (so its gradient is summed across them, and
    the hooked backward runs with one replica), with BatchNorm statistics, a weight
    regulariser, an activity loss and a metric: all the state Keras updates in a
    forward, checked against one process."""
    keras.utils.set_random_seed(40)
    inp = keras.Input((6,))
    tied = L.Dense(12, activation="tanh", name="tied")
    x = L.Dense(12, kernel_regularizer=keras.regularizers.L2(0.01), name="first")(inp)
    x = L.BatchNormalization(momentum=0.8, name="bn_a")(x)
    x = tied(x)
    x = L.ActivityRegularization(l1=0.01, name="activity")(x)
    x = L.Dense(12, name="middle")(x)
    x = L.BatchNormalization(momentum=0.8, name="bn_b")(x)
    x = tied(x)
    out = L.Dense(3, activation="softmax", name="out")(x)
    model = keras.Model(inp, out)
    opt = keras.optimizers.SGD(0.05, momentum=0.9, gradient_accumulation_steps=accumulate) \
        if accumulate else keras.optimizers.SGD(0.05, momentum=0.9)
    model.compile(optimizer=opt, loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


@pytest.mark.parametrize("recompute", [False, True])
def test_hooked_backward_keeps_batchnorm_statistics_losses_and_metrics(small_buckets, recompute):
    rng = np.random.default_rng(40)
    x, y = (rng.normal(size=(64, 6)) * 2 + 1).astype("float32"), rng.integers(0, 3, 64)
    micro = 2
    reference_model = tied_model(accumulate=micro)
    start = reference_model.get_weights()
    # One process: microbatches of 8, one update per 2 of them (BatchNorm sees 8).
    history = reference_model.fit(x, y, batch_size=16 // micro, epochs=2, shuffle=False,
                                  verbose=0)
    expected = reference_model.get_weights()
    results = train_ranks(tied_model, x, y, num_stages=2, num_replicas=1,
                          num_microbatches=micro, weights=start, batch_size=16, epochs=2,
                          shuffle=False, balance=[4, 4], recompute=recompute)
    for w, got in results:
        assert max_diff(w, expected) <= 1e-5  # moving statistics included
        np.testing.assert_allclose(got["accuracy"], history.history["accuracy"], atol=1e-6)


def test_buckets_follow_the_order_gradients_arrived_in_on_rank_0(small_buckets, monkeypatch):
    x, y = models.mlp_data(32)
    start = models.mlp().get_weights()
    arrived, learned = {}, {}
    arrive, learn = overlap.Buckets.arrive, overlap.Buckets.learn

    noting = threading.Lock()

    def noting_arrive(self, k):
        # TensorFlow may run two hooks at once (tests give it 8 inter-op threads):
        # note each arrival and hand it on in one step, so the notes keep its order.
        with noting:
            arrived.setdefault(id(self), []).append(self.stage.trainable[k].path)
            arrive(self, k)

    def noting_learn(self):
        first = list(arrived[id(self)])
        learn(self)
        learned[id(self)] = (first, [[self.stage.trainable[k].path for k in b]
                                     for _, b in self.buckets])

    monkeypatch.setattr(overlap.Buckets, "arrive", noting_arrive)
    monkeypatch.setattr(overlap.Buckets, "learn", noting_learn)
    train_ranks(models.mlp, x, y, num_stages=1, num_replicas=2, num_microbatches=2,
                weights=start, batch_size=16, epochs=1, shuffle=False)
    (first_a, layout_a), (first_b, layout_b) = learned.values()
    assert layout_a == layout_b  # one layout for both replicas
    order = [p for bucket in layout_a for p in bucket]
    assert order in (first_a, first_b)  # the arrival order of one of them (rank 0)
    assert sorted(order) == sorted(first_a) and len(first_a) == 10  # 5 kernels, 5 biases


def test_off_by_default_on_one_node(monkeypatch, tmp_path):
    monkeypatch.delenv("HYPARFLOW_OVERLAP", raising=False)
    monkeypatch.setattr(overlap, "BUCKET_BYTES", 600)
    x, y = models.mlp_data(32)
    start = models.mlp().get_weights()
    path = tmp_path / "run.json"
    train_ranks(models.mlp, x, y, num_stages=1, num_replicas=2, num_microbatches=1,
                weights=start, batch_size=16, epochs=1, shuffle=False, trace=str(path))
    assert all(e["args"]["inside"] == 0 for e in allreduces(path))
    assert overlap.enabled(default=True) and not overlap.enabled(default=False)
    monkeypatch.setenv("HYPARFLOW_OVERLAP", "0")
    assert not overlap.enabled(default=True)


def test_waiting_tests_every_request_each_round():
    """A ring allreduce posts its next round only inside its own test(): waiting on
    several must test all of them, not stop at the first unfinished one."""
    from hyparflow.engine.comm import wait_all
    from hyparflow.engine.local import run_ranks

    def body(comm):
        bufs = [np.full(1000, comm.rank + k, np.float32) for k in range(3)]
        requests = [comm.iallreduce(b) for b in bufs]
        finished = []

        class Last:
            """The first request finishes only after the others (as a ring's first
            bucket may need rounds that the others' tests drive)."""

            def __init__(self, k):
                self.k = k

            def test(self):
                done = requests[self.k].test() and (self.k > 0 or len(finished) == 2)
                if done and self.k not in finished:
                    finished.append(self.k)
                return done

        # Stopping at the first unfinished request would never finish: a timeout.
        wait_all([Last(k) for k in range(3)], timeout=10)
        return bufs, finished

    for bufs, finished in run_ranks(2, body, timeout=60):
        assert [float(b[0]) for b in bufs] == [1.0, 3.0, 5.0]
        assert sorted(finished[:2]) == [1, 2] and finished[2] == 0
