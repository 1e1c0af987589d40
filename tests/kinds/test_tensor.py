"""Tensor parallelism (num_tensor=T) against plain Keras on one process: the split
layers' parts, the pairing of Dense layers, uneven shares and the set-up errors."""

import keras
import numpy as np
import pytest

import hyparflow as hf
from conftest import max_diff, reference, train_ranks
from hyparflow.kinds import tensor as hft
from hyparflow.graph import from_model

L = keras.layers
EPOCHS, BATCH = 2, 16


def dense_model(optimizer="sgd"):
    keras.utils.set_random_seed(3)
    inp = keras.Input((12,))
    x = L.Dense(24, activation="relu", name="up")(inp)
    x = L.Dense(10, activation="tanh", name="down")(x)      # pairs with "up"
    x = L.Dense(9, activation="relu", name="alone")(x)       # alone: column split, gathered
    out = L.Dense(4, activation="softmax", name="head")(x)
    model = keras.Model(inp, out)
    model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    return model


def dense_data(n=64):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 12)).astype("float32"), rng.integers(0, 4, n)


def conv_model():
    keras.utils.set_random_seed(4)
    inp = keras.Input((8, 8, 3))
    x = L.Conv2D(7, 3, padding="same", activation="relu", name="conv_a")(inp)
    x = L.Conv2D(5, 3, strides=2, activation="tanh", name="conv_b")(x)
    x = L.GlobalAveragePooling2D()(x)
    out = L.Dense(3, name="head")(x)
    model = keras.Model(inp, out)
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    return model


def conv_data(n=48):
    rng = np.random.default_rng(1)
    return rng.normal(size=(n, 8, 8, 3)).astype("float32"), rng.normal(size=(n, 3)).astype("float32")


def embedding_model(optimizer=None):
    keras.utils.set_random_seed(5)
    inp = keras.Input((6,), dtype="int32")
    x = L.Embedding(50, 8, name="table")(inp)
    x = L.GlobalAveragePooling1D()(x)
    out = L.Dense(2, name="head")(x)
    model = keras.Model(inp, out)
    model.compile(optimizer=optimizer or keras.optimizers.SGD(0.1, momentum=0.9), loss="mse")
    return model


def embedding_data(n=48):
    rng = np.random.default_rng(2)
    return rng.integers(0, 50, (n, 6)).astype("int32"), rng.normal(size=(n, 2)).astype("float32")



def check(build, data, layers, configs, tol=1e-5, shares=None):
    x, y = data
    start, expected, expected_history = reference(build, x, y, epochs=EPOCHS, batch_size=BATCH)
    for s, t, r, m in configs:
        results = train_ranks(build, x, y, num_stages=s, num_replicas=r, num_microbatches=m,
                              num_tensor=t, tensor_layers=layers, tensor_shares=shares,
                              weights=start, batch_size=BATCH, epochs=EPOCHS, shuffle=False)
        diff = max(max_diff(w, expected) for w, _ in results)
        print(f"(S,T,R,M)={(s, t, r, m)} shares={shares}: max weight difference {diff:.2e}")
        assert diff <= tol, f"(S,T,R,M)={(s, t, r, m)}: max weight difference {diff:g}"
        for w, h in results[1:]:
            assert max_diff(w, results[0][0]) == 0.0
            assert h == results[0][1]
        for key, values in expected_history.items():
            np.testing.assert_allclose(results[0][1][key], values, rtol=1e-5, atol=1e-6,
                                       err_msg=key)


def test_dense_column_row_pair_and_alone():
    check(dense_model, dense_data(), ["up", "down", "alone"],
          [(1, 2, 1, 1), (1, 2, 2, 2), (2, 2, 1, 2)])


def test_dense_uneven_shares_adam():
    check(lambda: dense_model(keras.optimizers.Adam(0.01)), dense_data(), ["up", "down", "alone"],
          [(1, 2, 1, 2)], tol=1e-4, shares=[3, 1])


@pytest.mark.parametrize("shares", [None, [2, 1]])
def test_conv2d_filter_split(shares):
    check(conv_model, conv_data(), ["conv_a", "conv_b"], [(1, 2, 1, 2)], shares=shares)


def test_conv2d_with_pipeline_and_replicas():
    check(conv_model, conv_data(), ["conv_a", "conv_b"], [(2, 2, 2, 1)])


@pytest.mark.parametrize("shares", [None, [1, 3]])
def test_embedding_row_split(shares):
    check(embedding_model, embedding_data(), ["table"], [(1, 2, 1, 2)], shares=shares)


def test_embedding_row_split_keeps_sparse_pairs_for_adam():
    """The parts' sparse gradients ((row, value) pairs of each rank's own ids, in the
    batch's order) step Adam as one process steps the whole table."""
    check(lambda: embedding_model(keras.optimizers.Adam(0.01)), embedding_data(), ["table"],
          [(1, 2, 1, 2), (1, 2, 2, 1)], tol=1e-4, shares=[1, 3])


def test_choose_pairs_dense_layers_megatron_style():
    model = dense_model()
    graph = from_model(model)
    splits = hft.choose(graph, range(len(graph.nodes)), 2, ["up", "down", "alone"])
    kinds = {graph.nodes[i].op.name: (sp.kind, sp.gather) for i, sp in splits.items()}
    assert kinds == {"up": ("column", False), "down": ("row", True), "alone": ("column", True)}
    # By size: only layers with at least min_params weights.
    auto = hft.choose(graph, range(len(graph.nodes)), 2, None, min_params=200)
    assert {graph.nodes[i].op.name for i in auto} == {"up", "down"}


def test_split_sizes_follow_shares():
    assert hft.split_sizes(10, [0.5, 0.5]) == [5, 5]
    assert hft.split_sizes(7, [2 / 3, 1 / 3]) == [5, 2]
    assert hft.split_sizes(3, [0.98, 0.01, 0.01]) == [1, 1, 1]
    assert sum(hft.split_sizes(1000, hft.shares_of([1, 2, 3], 3))) == 1000
    with pytest.raises(ValueError, match="tensor_shares"):
        hft.shares_of([1, 0], 2)


def run_error(build, ranks=2, **kwargs):
    x, y = dense_data()
    errors = []

    def body(comm):
        try:
            hf.fit(build(), x, y, batch_size=BATCH, comm=comm, verbose=0, **kwargs)
        except (ValueError, NotImplementedError) as exc:
            errors.append(str(exc))
            return
        raise AssertionError("no error")

    from hyparflow.engine.local import run_ranks
    run_ranks(ranks, body, timeout=120)
    assert len(errors) == ranks and len(set(errors)) == 1
    return errors[0]


def test_errors_name_the_value_and_the_fix():
    assert "mpiexec -n 4" in run_error(dense_model, ranks=2, num_stages=2, num_tensor=2,
                                       num_replicas=1)
    assert "tensor_layers=[...]" in run_error(dense_model, num_tensor=2)  # all below MIN_PARAMS
    assert "does not have" in run_error(dense_model, num_tensor=2, tensor_layers=["nope"])

    def shared():
        inp = keras.Input((12,))
        layer = L.Dense(12, name="twice")
        model = keras.Model(inp, L.Dense(4, name="head")(layer(layer(inp))))
        model.compile("sgd", "sparse_categorical_crossentropy")
        return model

    assert "more than once" in run_error(shared, num_tensor=2, tensor_layers=["twice"])

    def clipped():
        model = dense_model()
        model.compile(keras.optimizers.SGD(clipnorm=1.0), "sparse_categorical_crossentropy")
        return model

    assert "clipvalue" in run_error(clipped, num_tensor=2, tensor_layers=["up"])


def test_plan_file_carries_the_tensor_axis(tmp_path):
    from hyparflow import plan as P
    from hyparflow.layout import Layout

    x, y = dense_data()
    start, expected, _ = reference(dense_model, x, y, epochs=EPOCHS, batch_size=BATCH)
    graph = from_model(dense_model())
    path = str(tmp_path / "plan.json")
    P.write(path, graph, Layout(num_microbatches=2, schedule="gpipe", num_tensor=2,
                                balance=(len(graph.nodes),), tensor_layers=("up", "down")))
    results = train_ranks(dense_model, x, y, num_stages=None, num_replicas=None,
                          num_microbatches=None, num_tensor=2, plan=path, weights=start,
                          batch_size=BATCH, epochs=EPOCHS, shuffle=False)
    assert max(max_diff(w, expected) for w, _ in results) <= 1e-5


def test_checkpoints_gather_the_parts_and_reshape(tmp_path):
    """Adam's state of the split layers is saved whole: a checkpoint written with T=2
    (uneven 3:1) resumes as S=2, T=1 and then as T=2 with even shares, and the
    result is one-process Keras's; a crash-and-resume at T=2 is bit-exact."""
    from hyparflow.engine import checkpoint as C
    from hyparflow.engine.local import run_ranks

    build = lambda: dense_model(keras.optimizers.Adam(0.01))  # noqa: E731
    x, y = dense_data(96)
    reference = build()
    start = reference.get_weights()
    reference.fit(x, y, batch_size=BATCH, epochs=3, shuffle=False, verbose=0)

    def fit(ranks, epochs, directory, callbacks=(), **kwargs):
        def body(comm):
            model = build()
            model.set_weights(start)
            hf.fit(model, x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0,
                   comm=comm, checkpoint_dir=directory, callbacks=list(callbacks), **kwargs)
            return model.get_weights()

        return run_ranks(ranks, body, timeout=300)

    layers = ["up", "down", "alone"]
    d = str(tmp_path / "a")
    fit(2, 1, d, num_tensor=2, tensor_layers=layers, tensor_shares=[3, 1], num_microbatches=2)
    fit(2, 2, d, num_stages=2, resume=True)
    final = fit(2, 3, d, num_tensor=2, tensor_layers=layers, resume=True)
    assert max(max_diff(w, reference.get_weights()) for w in final) <= 1e-4

    whole = fit(2, 3, str(tmp_path / "b"), num_tensor=2, tensor_layers=layers,
                checkpoint_every=4)[0]

    class Crash(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if self.model.optimizer.iterations.numpy() == 10:
                raise KeyboardInterrupt("simulated crash after step 10")

    with pytest.raises(KeyboardInterrupt):
        fit(2, 3, str(tmp_path / "c"), [Crash()], num_tensor=2, tensor_layers=layers,
            checkpoint_every=4)
    assert C.latest_valid(str(tmp_path / "c"))[1]["global_step"] == 8
    resumed = fit(2, 3, str(tmp_path / "c"), num_tensor=2, tensor_layers=layers,
                  checkpoint_every=4, resume=True)[0]
    assert max_diff(resumed, whole) == 0.0


def test_measured_shares_train_the_same():
    """tensor_shares="measure": a calibration on every rank sets the shares (they differ
    run to run); the weights are still one-process Keras's."""
    check(dense_model, dense_data(), ["up", "down", "alone"], [(1, 2, 1, 2)], shares="measure")


def ffn_model():
    """A Transformer-style feed-forward block on a sequence (3-D tensors), with a residual."""
    keras.utils.set_random_seed(6)
    inp = keras.Input((6, 16))
    h = L.Dense(64, activation="gelu", name="ffn_up")(inp)
    h = L.Dense(16, name="ffn_down")(h)
    x = L.LayerNormalization()(L.Add()([inp, h]))
    out = L.Dense(3, name="head")(L.Flatten()(x))
    model = keras.Model(inp, out)
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    return model


def test_sequence_feed_forward_pair():
    rng = np.random.default_rng(7)
    data = rng.normal(size=(48, 6, 16)).astype("float32"), rng.normal(size=(48, 3)).astype("float32")
    check(ffn_model, data, ["ffn_up", "ffn_down"], [(1, 2, 1, 2), (2, 2, 1, 2)], tol=1e-4,
          shares=[1, 2])
