"""ZeRO stage 1 (`hyparflow.zero`): each replica steps the optimizer for its own rows
of the shared variables and holds only their optimizer state; the weights must
still end where `model.fit` ends, for stateful optimizers, sparse gradients,
pipelines, tensor splits, and through checkpoints."""

import os

import keras
import numpy as np
import pytest

from conftest import max_diff, reference, train_ranks
from hyparflow.engine import checkpoint as C
from hyparflow.kinds import zero
from hyparflow.engine.local import run_ranks
import hyparflow
import hyparflow.graph

OPTIMIZERS = {
    "adam": lambda: keras.optimizers.Adam(0.01),
    "adamw": lambda: keras.optimizers.AdamW(0.01, weight_decay=0.05),
    "rmsprop": lambda: keras.optimizers.RMSprop(0.01),
    "momentum": lambda: keras.optimizers.SGD(0.05, momentum=0.9),
}


def mlp(optimizer, seed=3):
    keras.utils.set_random_seed(seed)
    inp = keras.Input((12,))
    h = keras.layers.Dense(16, activation="tanh", name="a")(inp)
    h = keras.layers.Dense(24, activation="relu", name="b")(h)
    h = keras.layers.Dense(16, activation="tanh", name="c")(h)
    out = keras.layers.Dense(3, name="out")(h)
    model = keras.Model(inp, out)
    model.compile(optimizer=optimizer(), loss="mse")
    return model


def data(n=64):
    rng = np.random.default_rng(7)
    return rng.normal(size=(n, 12)).astype("float32"), rng.normal(size=(n, 3)).astype("float32")


def expected(build, x, y, epochs=2, batch=16):
    return reference(build, x, y, epochs=epochs, batch_size=batch)[:2]


def slot_elements(model):
    return sum(int(np.prod(v.shape)) for v in model.optimizer.variables if len(v.shape))


def fit_ranks(build, x, y, size, **kwargs):
    """hf.fit on `size` thread-ranks; per rank (weights, optimizer slot elements)."""
    start = kwargs.pop("weights")

    def body(comm):
        model = build()
        model.set_weights(start)
        hyparflow.fit(model, x, y, comm=comm, verbose=0, **kwargs)
        return model.get_weights(), slot_elements(model)

    return run_ranks(size, body, timeout=300)


def test_ownership_balances_elements_cutting_at_rows():
    shapes = [(12, 16), (16,), (16, 24), (24,), (24, 3), (3,), ()]
    for n in (1, 2, 3, 4):
        parts = zero.ownership(shapes, n)
        owned = [0] * n
        for shape, cut in zip(shapes, parts):
            rows = shape[0] if shape else 1
            # Every row has exactly one owner, in contiguous ranges.
            assert [a for _, a, _ in cut][0] == 0 and cut[-1][2] == rows
            assert all(cut[j][2] == cut[j + 1][1] for j in range(len(cut) - 1))
            width = int(np.prod(shape[1:])) if shape else 1
            for r, a, b in cut:
                owned[r] += (b - a) * width
        total = sum(int(np.prod(s)) for s in shapes)
        assert sum(owned) == total
        assert max(owned) - min(owned) <= 24 + 1, (n, owned)  # one row of the widest


def test_ownership_counts_a_cost_per_variable():
    # Many small variables (a ResNet's batch norms) and a few large ones: ranks share
    # elements plus a fixed cost per variable part, so the rank with the small ones
    # holds fewer elements; with large variables the elements dominate again.
    shapes = [(16,)] * 200 + [(3, 3, 64, 64)] * 4
    fixed = 4096
    for n in (2, 3):
        parts = zero.ownership(shapes, n, fixed)
        cost = [0] * n
        for shape, cut in zip(shapes, parts):
            width = int(np.prod(shape[1:]))
            for r, a, b in cut:
                cost[r] += fixed + (b - a) * width
        total = sum(cost)
        assert max(cost) - min(cost) <= fixed + 3 * 64 * 64 + 1, (n, cost)
        assert abs(max(cost) - total / n) < total / n * 0.1
    big = [(1024, 1024), (1024,)] * 8
    owned = [0] * 2
    for shape, cut in zip(big, zero.ownership(big, 2, zero.VARIABLE_COST)):
        width = int(np.prod(shape[1:]))
        for r, a, b in cut:
            owned[r] += (b - a) * width
    assert max(owned) <= sum(owned) / 2 * 1.02, owned
    # One table alone (a stage holding only an Embedding) is still cut in halves.
    assert zero.ownership([(4000, 32)], 2, zero.VARIABLE_COST) == [[(0, 0, 2000), (1, 2000, 4000)]]


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_sharded_step_matches_model_fit(name, monkeypatch):
    monkeypatch.setenv("HYPARFLOW_ZERO", "1")
    build = lambda: mlp(OPTIMIZERS[name])  # noqa: E731
    x, y = data()
    start, want = expected(build, x, y)
    full = slot_elements(build()) or None
    for r in (2, 3):
        got = fit_ranks(build, x, y, r, num_stages=1, num_replicas=r, num_microbatches=2,
                        weights=start, batch_size=16, epochs=2, shuffle=False)
        diff = max(max_diff(w, want) for w, _ in got)
        assert diff <= 1e-5, f"R={r}: max weight difference {diff:g}"
        slots = [s for _, s in got]
        model = build()
        model.optimizer.build(model.trainable_variables)
        whole = slot_elements(model)
        # The optimizer state is shared out: every element once, on some rank (this
        # model's variables are small, so the cost per variable decides who holds
        # how much: test_ownership_counts_a_cost_per_variable).
        assert sum(slots) == whole and max(slots) < whole, (r, slots, whole)
    del full


def test_sharded_step_counts_what_it_sends(monkeypatch):
    """`History.exchanges` counts ZeRO's rows to the owners and back: at R = 2 a
    variable's non-owned rows out and its owned rows back are its whole size, what
    the ring of the unsharded sum sends (less the ring's flag and alignment: up to 16
    floats per variable)."""
    build = lambda: mlp(OPTIMIZERS["adam"])  # noqa: E731
    x, y = data()
    sent = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("HYPARFLOW_ZERO", flag)

        def body(comm):
            model = build()
            history = hyparflow.fit(model, x, y, comm=comm, verbose=0, num_replicas=2,
                                    batch_size=16, epochs=2, shuffle=False)
            return history.exchanges["replicas"]["bytes"]

        sent[flag] = run_ranks(2, body, timeout=300)
    steps = 2 * -(-len(x) // 16)
    padding = 64 * len(build().trainable_variables) * steps
    for ring, shared in zip(sent["0"], sent["1"]):
        assert shared > 0 and 0 <= ring - shared <= padding, (ring, shared, padding)


def test_sharding_off_keeps_whole_state(monkeypatch):
    monkeypatch.setenv("HYPARFLOW_ZERO", "0")
    build = lambda: mlp(OPTIMIZERS["adam"])  # noqa: E731
    x, y = data()
    start, want = expected(build, x, y)
    got = fit_ranks(build, x, y, 2, num_stages=1, num_replicas=2, num_microbatches=1,
                    weights=start, batch_size=16, epochs=2, shuffle=False)
    model = build()
    model.optimizer.build(model.trainable_variables)
    assert all(s == slot_elements(model) for _, s in got)
    assert max(max_diff(w, want) for w, _ in got) <= 1e-5


def test_auto_shards_where_it_pays(monkeypatch):
    """Unset: a Dense model steps whole on every replica (sharding measured slower);
    a model with an Embedding table shares the step out (the table's Adam step
    dominates); both still end where `model.fit` ends."""
    monkeypatch.delenv("HYPARFLOW_ZERO", raising=False)
    for build, (x, y), sharded in [(lambda: mlp(OPTIMIZERS["adam"]), data(), False),
                                   (lambda: embedding_model(OPTIMIZERS["adam"]),
                                    embedding_data(), True)]:
        start, want = expected(build, x, y)
        got = fit_ranks(build, x, y, 2, num_stages=1, num_replicas=2, num_microbatches=1,
                        weights=start, batch_size=16, epochs=2, shuffle=False)
        model = build()
        model.optimizer.build(model.trainable_variables)
        whole = slot_elements(model)
        assert [s < whole for _, s in got] == [sharded] * 2, ([s for _, s in got], whole)
        assert max(max_diff(w, want) for w, _ in got) <= 1e-5


def test_auto_shards_large_optimizer_state(monkeypatch):
    """The other reason to shard by default: the stage's weights and optimizer state
    would take more than 1/8 of a rank's share of the machine's memory."""
    model = mlp(OPTIMIZERS["adam"])
    graph = hyparflow.graph.from_model(model)

    class Stage:  # what `pays` reads of a stage
        trainable = model.trainable_variables
        cut = type("StageCut", (), {"nodes": range(len(graph.nodes))})()

    Stage.graph = graph
    state = 4 * sum(int(np.prod(v.shape)) for v in model.trainable_variables) * 3  # + 2 slots
    monkeypatch.setattr(zero, "_memory", lambda: state * 8 * 2 - 1)
    assert zero.pays(Stage, model.optimizer, ranks_on_node=2)
    assert not zero.pays(Stage, model.optimizer, ranks_on_node=1)
    monkeypatch.setattr(zero, "_memory", lambda: None)
    assert not zero.pays(Stage, model.optimizer)


def check(build, x, y, configs, tol=1e-5, batch=16, epochs=2, **kwargs):
    start, want = expected(build, x, y, epochs=epochs, batch=batch)
    for s, r, m, *t in configs:
        t = t[0] if t else 1
        got = train_ranks(build, x, y, num_stages=s, num_replicas=r, num_microbatches=m,
                          num_tensor=t, weights=start, batch_size=batch, epochs=epochs,
                          shuffle=False, **kwargs)
        diff = max(max_diff(w, want) for w, _ in got)
        assert diff <= tol, f"(S,R,M,T)={(s, r, m, t)}: max weight difference {diff:g}"


def test_pipeline_of_replicas_and_a_learning_rate_schedule(monkeypatch):
    """S=2 x R=2: each stage's replicas share out that stage's step; the schedule
    follows the iteration counter, which every rank advances once per step."""
    monkeypatch.setenv("HYPARFLOW_ZERO", "1")
    schedule = lambda: keras.optimizers.schedules.ExponentialDecay(0.02, 2, 0.5)  # noqa: E731
    build = lambda: mlp(lambda: keras.optimizers.Adam(schedule()))  # noqa: E731
    x, y = data()
    check(build, x, y, [(2, 2, 2), (1, 4, 1)])


def embedding_model(optimizer):
    keras.utils.set_random_seed(11)
    inp = keras.Input((6,), dtype="int32")
    h = keras.layers.Embedding(50, 8, name="embed")(inp)
    h = keras.layers.GlobalAveragePooling1D()(h)
    h = keras.layers.Dense(8, activation="relu", name="hidden")(h)
    out = keras.layers.Dense(3, name="logits")(h)
    model = keras.Model(inp, out)
    model.compile(optimizer=optimizer(), loss="mse")
    return model


def embedding_data(n=64):
    rng = np.random.default_rng(5)
    # Ids from part of the table: batches repeat ids and leave rows untouched.
    return (rng.integers(0, 30, (n, 6)).astype("int32"),
            rng.normal(size=(n, 3)).astype("float32"))


@pytest.mark.parametrize("name", ["adam", "momentum"])
def test_embedding_rows_are_stepped_by_their_owner(name, monkeypatch):
    """The table's (row, value) pairs reach each row's owner in the batch's order."""
    monkeypatch.setenv("HYPARFLOW_ZERO", "1")
    x, y = embedding_data()
    check(lambda: embedding_model(OPTIMIZERS[name]), x, y, [(1, 2, 2), (1, 3, 1), (2, 2, 2)])


def test_tensor_split_with_replicas(monkeypatch):
    """T=2 x R=2: the split layers' parts are stepped whole on each replica, the
    rest is sharded."""
    monkeypatch.setenv("HYPARFLOW_ZERO", "1")
    x, y = data()
    build = lambda: mlp(OPTIMIZERS["adam"])  # noqa: E731
    check(build, x, y, [(1, 2, 2, 2)], tensor_layers=["b", "c"], tol=1e-4)


def test_global_clipnorm_falls_back_to_the_whole_step(monkeypatch):
    monkeypatch.setenv("HYPARFLOW_ZERO", "1")
    opt = lambda: keras.optimizers.Adam(0.05, global_clipnorm=0.1)  # noqa: E731
    assert "global_clipnorm" in zero.why_not(opt(), [])
    build = lambda: mlp(opt)  # noqa: E731
    x, y = data()
    start, want = expected(build, x, y)
    got = fit_ranks(build, x, y, 2, num_stages=1, num_replicas=2, num_microbatches=1,
                    weights=start, batch_size=16, epochs=2, shuffle=False)
    assert max(max_diff(w, want) for w, _ in got) <= 1e-5
    model = build()
    model.optimizer.build(model.trainable_variables)
    assert all(s == slot_elements(model) for _, s in got)  # every rank holds all of it


def test_reasons_not_to_shard():
    assert zero.why_not(keras.optimizers.Adam(), []) is None
    assert "clipnorm" in zero.why_not(keras.optimizers.Adam(clipnorm=1.0), [])
    assert "Adafactor" in zero.why_not(keras.optimizers.Adafactor(), [])
    # Element-wise: each owner keeps its rows' averages (tests/loop/test_optimizer_contract.py).
    assert zero.why_not(keras.optimizers.SGD(use_ema=True), []) is None
    v = keras.Variable(np.ones((2, 2)))
    v.constraint = keras.constraints.NonNeg()  # as Layer.add_weight sets it
    assert "constraint" in zero.why_not(keras.optimizers.SGD(), [v])


def test_bad_setting_is_named(monkeypatch):
    monkeypatch.setenv("HYPARFLOW_ZERO", "yes")
    with pytest.raises(ValueError, match="HYPARFLOW_ZERO must be 1, 0 or auto"):
        zero.enabled()


def test_checkpoint_holds_whole_state_and_reshards(tmp_path, monkeypatch):
    """Written at R=2 (each rank holding half the Adam state), the checkpoint holds
    every slot whole; resumed at R=3 and then R=1 the run ends where model.fit ends."""
    monkeypatch.setenv("HYPARFLOW_ZERO", "1")
    build = lambda: mlp(OPTIMIZERS["adam"])  # noqa: E731
    x, y = data(96)
    start, want = expected(build, x, y, epochs=3)
    d = str(tmp_path)
    for r, epochs in ((2, 1), (3, 2), (1, 3)):
        got = fit_ranks(build, x, y, r, num_stages=1, num_replicas=r, num_microbatches=1,
                        weights=start, batch_size=16, epochs=epochs, shuffle=False,
                        checkpoint_dir=d, resume=True, seed=3)
        if r == 2:
            path = C.list_checkpoints(d)[-1]
            with np.load(os.path.join(path, "stage-0.npz")) as npz:
                slots = {k: npz[k].shape for k in npz.files if k.startswith("slot/")}
            model = build()
            shapes = [tuple(v.shape) for v in model.weights]
            assert len(slots) == 2 * len(shapes)  # Adam: two slots per variable, whole
            for key, shape in slots.items():
                assert shape == shapes[int(key.split("/")[1])], key
    assert max_diff(got[0][0], want) <= 1e-5
