"""Split backward (B and W) and the zero-bubble schedules ("zb-h1", "zb-batched")
against plain Keras `model.fit`: BatchNorm, a kernel regulariser and a layer called
twice (kernels B computes), deferred Dense kernels (W computes), Adam, recompute,
replicas, tensor splits and tied embeddings."""

import functools

import keras
import numpy as np
import pytest

from conftest import max_diff, reference, train_ranks

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


@functools.cache  # layouts of one microbatch count share it (tests only read it)
def fit_reference(optimizer, micro, bn=True):
    """Plain Keras: batches of one microbatch, one step per `micro` of them."""
    start, end, _ = reference(lambda: build(optimizer, micro if micro > 1 else None, bn),
                              *data(), epochs=EPOCHS, batch_size=BATCH // micro)
    return start, end


CASES = [  # (schedule, S, R, M, extra)
    ("1f1b-w", 2, 1, 4, {}),
    ("1f1b-w", 3, 2, 2, {}),                         # replicas: allreduce after the W
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
    start, expected = fit_reference(optimizer, r * m, bn)
    results = train_ranks(lambda: build(optimizer, bn=bn), x, y, num_stages=s, num_replicas=r,
                          num_microbatches=m, weights=start, batch_size=BATCH, epochs=EPOCHS,
                          shuffle=False, schedule=schedule, **extra)
    for w, _ in results:
        assert max_diff(w, expected) <= tol


@pytest.mark.parametrize("schedule", ["zb-h1", "zb-batched"])
def test_tensor_split_layer_beside_deferred_ones(schedule):
    """T=2: the split layer's kernel gradient comes in B (each rank its part), the
    other Dense kernels in W."""
    x, y = data()
    start, expected = fit_reference("adam", 2)
    results = train_ranks(lambda: build("adam"), x, y, num_stages=2, num_replicas=1,
                          num_microbatches=2, weights=start, batch_size=BATCH, epochs=EPOCHS,
                          shuffle=False, schedule=schedule, num_tensor=2, tensor_layers=["d1"])
    for w, _ in results:
        assert max_diff(w, expected) <= 1e-4


@pytest.mark.parametrize("schedule,stages", [("zb-batched", 2), ("zb-h1", 3), ("zb-batched", 4)])
def test_tied_embeddings(schedule, stages):
    import test_tied

    x, y = test_tied.data()
    x, y = x[:64], y[:64]
    start, expected = test_tied.fit_reference(64, 1)
    results = train_ranks(test_tied.build, x, y, num_stages=stages, num_replicas=1,
                          num_microbatches=2, weights=start, batch_size=32, epochs=1,
                          shuffle=False, schedule=schedule)
    for w, _ in results:
        assert max_diff(w, expected) <= 1e-4


def test_deferred_kernels_are_the_plain_dense_calls_read_once():
    from hyparflow.engine import kernels
    from hyparflow.graph import from_model

    graph = from_model(build())
    names = [graph.nodes[i].op.name for i, _ in kernels.deferred_nodes(graph, range(len(graph.nodes)))]
    # Not "shared" (called twice) nor "reg" (its regulariser's gradient comes in B).
    assert names == ["d0", "d1", "d2", "logits"]


def einsum_model():
    """EinsumDense projections over a sequence (as attention's), one with an
    ellipsis over the batch and positions."""
    keras.utils.set_random_seed(5)
    inp = keras.Input((6, 8), name="tokens")
    h = L.EinsumDense("abc,cd->abd", (6, 12), bias_axes="d", activation="relu", name="e0")(inp)
    h = L.EinsumDense("abd,de->abe", (6, 8), name="e1")(h)
    h = L.Permute((2, 1))(h)
    h = L.EinsumDense("...b,bc->...c", 4, bias_axes="c", name="e2")(h)
    h = L.Flatten()(h)
    out = L.Dense(3, name="logits")(h)
    model = keras.Model(inp, out)
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


@pytest.mark.parametrize("schedule,stages", [("zb-batched", 2), ("1f1b-w", 3)])
def test_deferred_einsum_dense(schedule, stages):
    from hyparflow.engine import kernels
    from hyparflow.graph import from_model

    graph = from_model(einsum_model())
    deferred = [graph.nodes[i].op.name
                for i, _ in kernels.deferred_nodes(graph, range(len(graph.nodes)))]
    assert deferred == ["e0", "e1", "e2", "logits"]
    rng = np.random.default_rng(2)
    x, y = rng.normal(size=(64, 6, 8)).astype("float32"), rng.integers(0, 3, 64)
    start, want, _ = reference(einsum_model, x, y, epochs=EPOCHS, batch_size=BATCH)
    results = train_ranks(einsum_model, x, y, num_stages=stages, num_replicas=1,
                          num_microbatches=2, weights=start, batch_size=BATCH, epochs=EPOCHS,
                          shuffle=False, schedule=schedule)
    for w, _ in results:
        assert max_diff(w, want) <= 1e-5


def test_auto_tries_each_schedule_then_keeps_the_fastest(monkeypatch):
    from hyparflow.engine import executor as ex

    chosen = []
    tried = []
    original = ex.Executor._try

    def noting(self, seconds):
        tried.append(self.schedule)
        original(self, seconds)
        if self.chosen is not None and not self._trials and len(chosen) < self.comm.size:
            chosen.append(self.chosen)

    monkeypatch.setattr(ex.Executor, "_try", noting)
    x, y = data()
    start, expected = fit_reference("sgd", 4)
    results = train_ranks(lambda: build("sgd"), x, y, num_stages=2, num_replicas=1,
                          num_microbatches=4, weights=start, batch_size=BATCH, epochs=EPOCHS,
                          shuffle=False, schedule="auto")
    for w, _ in results:
        assert max_diff(w, expected) <= 1e-5
    # Each rank tried every candidate twice, then all agreed on one.
    assert sorted(tried) == sorted([name for name in ex.AUTO for _ in range(2)] * 2)
    assert len(chosen) == 2 and chosen[0] == chosen[1] and chosen[0] in ex.AUTO


def test_unknown_schedule_is_refused_with_the_choices():
    x, y = data()
    with pytest.raises(ValueError, match=r"'zb-h1'.*'auto'.*schedule='zb'"):
        train_ranks(build, x, y, num_stages=2, num_replicas=1, num_microbatches=2,
                    weights=build().get_weights(), batch_size=BATCH, schedule="zb")


def test_trace_shows_b_and_w_apart(tmp_path):
    import json

    x, y = data()
    trace = str(tmp_path / "t.json")
    train_ranks(build, x[:32], y[:32], num_stages=2, num_replicas=1, num_microbatches=4,
                weights=build().get_weights(), batch_size=BATCH, epochs=1, shuffle=False,
                schedule="zb-batched", trace=trace)
    events = json.load(open(trace))["traceEvents"]
    weights = [e for e in events if e.get("cat") == "weight"]
    assert weights and all(e["args"]["layers"] >= 1 for e in weights)
    # Each rank computes every microbatch's weights once per step (2 steps, M = 4),
    # some in one call of several (where its wait was filled, or at the end).
    for rank in (0, 1):
        mine = [e for e in weights if e["tid"] == rank]
        assert sum(e["args"]["count"] for e in mine) == 2 * 4
        assert any(e["args"]["count"] >= 2 for e in mine)
    assert any(e.get("cat") == "backward" and e["name"].startswith("B") for e in events)


@pytest.mark.parametrize("schedule", ["zb-batched", "zb-h1"])
def test_deferred_convolutions(schedule, monkeypatch):
    """HYPARFLOW_DEFER_CONV=1: Conv2D kernels (with bias and activation) wait for W too,
    with a skip connection crossing two stages."""
    import models

    monkeypatch.setenv("HYPARFLOW_DEFER_CONV", "1")
    from hyparflow.engine import kernels
    from hyparflow.graph import from_model

    graph = from_model(models.skip_cnn())
    kinds = {type(graph.nodes[i].op).__name__
             for i, _ in kernels.deferred_nodes(graph, range(len(graph.nodes)))}
    assert kinds == {"Conv2D", "Dense"}
    x, y = models.skip_cnn_data(48)
    model = models.skip_cnn()
    start = model.get_weights()
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    for s in (2, 3):
        results = train_ranks(models.skip_cnn, x, y, num_stages=s, num_replicas=1,
                              num_microbatches=4, weights=start, batch_size=BATCH, epochs=1,
                              shuffle=False, schedule=schedule,
                              balance=models.SKIP_CNN_BALANCE[s])
        for w, _ in results:
            assert max_diff(w, model.get_weights()) <= 1e-5
