"""Sparse (Embedding) gradients with stateful optimizers, against plain Keras.

Keras applies an Embedding's `tf.IndexedSlices` gradient pair by pair: rows a
batch did not touch keep their values and moments, and repeated ids count once
each. Every optimizer below ends where `model.fit` ends only if the pairs reach
it in the global batch's order."""

import keras
import numpy as np
import pytest

from conftest import max_diff, train_ranks
from hyparflow.engine import sparse

VOCAB, SEQ = 50, 6


def embedding_model(optimizer, recurrent=False, dtype=None):
    keras.utils.set_random_seed(11)
    inp = keras.Input((SEQ,), dtype="int32", name="ids")
    h = keras.layers.Embedding(VOCAB, 8, name="embed", dtype=dtype)(inp)
    if recurrent:
        h = keras.layers.LSTM(8, name="lstm", dtype=dtype)(h)
    else:
        h = keras.layers.Dense(8, activation="tanh", name="mix", dtype=dtype)(h)
        h = keras.layers.GlobalAveragePooling1D(name="pool", dtype=dtype)(h)
    h = keras.layers.Dense(8, activation="relu", name="hidden", dtype=dtype)(h)
    out = keras.layers.Dense(3, name="logits", dtype=dtype)(h)
    model = keras.Model(inp, out)
    model.compile(optimizer=keras.optimizers.get(optimizer) if isinstance(optimizer, str) else optimizer(),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def data(n=64):
    rng = np.random.default_rng(5)
    # Ids from a small range, so batches repeat ids and leave most rows untouched.
    return rng.integers(0, 20, (n, SEQ)).astype("int32"), rng.integers(0, 3, n)


OPTIMIZERS = {
    "adam": lambda: keras.optimizers.Adam(0.01),
    "adamw": lambda: keras.optimizers.AdamW(0.01),
    "rmsprop": lambda: keras.optimizers.RMSprop(0.01),
    "adagrad": lambda: keras.optimizers.Adagrad(0.05),
    "momentum": lambda: keras.optimizers.SGD(0.05, momentum=0.9),
}


def check(build, configs, tol=1e-5, epochs=2, batch=16):
    x, y = data()
    model = build()
    start = model.get_weights()
    model.fit(x, y, batch_size=batch, epochs=epochs, shuffle=False, verbose=0)
    expected = model.get_weights()
    for s, r, m in configs:
        results = train_ranks(build, x, y, num_stages=s, num_replicas=r, num_microbatches=m,
                              weights=start, batch_size=batch, epochs=epochs, shuffle=False)
        diff = max(max_diff(w, expected) for w, _ in results)
        assert diff <= tol, f"(S,R,M)={(s, r, m)}: max weight difference {diff:g} > {tol:g}"


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_embedding_with_stateful_optimizers(name):
    check(lambda: embedding_model(OPTIMIZERS[name]),
          [(1, 1, 1), (1, 1, 4), (1, 2, 2), (2, 1, 2), (2, 2, 2), (3, 1, 3), (4, 1, 2)])


def test_embedding_before_an_lstm_one_rank():
    # The case: Embedding + LSTM + Adam on one rank, 8 steps.
    check(lambda: embedding_model(OPTIMIZERS["adam"], recurrent=True), [(1, 1, 1), (2, 2, 1)],
          epochs=2)


def test_float64_layers_under_the_float32_policy():
    """The pairs and sums are float32 (the contract's precision); each variable's
    optimizer step gets its gradient in the variable's own dtype, sharded steps too."""
    check(lambda: embedding_model(OPTIMIZERS["adam"], dtype="float64"), [(1, 2, 2), (2, 1, 2)],
          epochs=1)


def test_untouched_rows_keep_their_values():
    x, y = data()
    build = lambda: embedding_model(OPTIMIZERS["adam"])  # noqa: E731
    model = build()
    start = model.get_weights()
    (weights, _), *_ = train_ranks(build, x, y, num_stages=2, num_replicas=2, num_microbatches=2,
                                   weights=start, batch_size=16, epochs=1, shuffle=False)
    # Ids 20..49 never occur: their embedding rows are where they started.
    np.testing.assert_array_equal(weights[0][20:], start[0][20:])
    assert np.abs(weights[0][:20] - start[0][:20]).max() > 0


def test_exchange_bytes_scale_with_rows_touched():
    """The pairs gathered for a huge table cost the rows a batch touched, not the table."""
    from hyparflow.engine.local import run_ranks

    shape = (200_000, 16)

    def body(comm):
        rng = np.random.default_rng(comm.rank)
        indices = rng.integers(0, 1000, 40)
        values = rng.normal(size=(40, 16)).astype("float32")
        x = sparse.Exchange(comm, {0: (indices, values)}, {0: shape})
        from hyparflow.engine.comm import wait_all
        wait_all([x], 30)
        return x.bytes, x.result()[0], (indices, values)

    results = run_ranks(2, body, timeout=60)
    got = results[0][1]
    # Rank order: rank 0's pairs, then rank 1's, on every rank.
    np.testing.assert_array_equal(got[0], np.concatenate([results[0][2][0], results[1][2][0]]))
    np.testing.assert_array_equal(got[1], np.concatenate([results[0][2][1], results[1][2][1]]))
    np.testing.assert_array_equal(results[1][1][1], got[1])
    assert results[0][0] == 80 * 8 + 80 * 16 * 4  # not 200,000 x 16 x 4


def test_linear_optimizer_reduces_densely_when_the_table_is_smaller():
    from hyparflow.engine.comm import wait_all
    from hyparflow.engine.local import run_ranks

    def body(comm):
        indices = np.array([1, 2, 1, 3] * 10)
        values = np.ones((40, 4), np.float32) * (comm.rank + 1)
        x = sparse.Exchange(comm, {0: (indices, values)}, {0: (5, 4)}, dense_ok=True)
        wait_all([x], 30)
        return x.result()[0]

    table = run_ranks(2, body, timeout=60)[0]
    assert table.shape == (5, 4)
    np.testing.assert_allclose(table[:, 0], [0, 60, 30, 30, 0])


def test_sparse_pairs_with_allreduces_started_in_the_backward(monkeypatch):
    """The early-allreduce hooks let an IndexedSlices gradient pass (it is gathered after
    the backward) while the dense buckets start inside it."""
    monkeypatch.setenv("HYPARFLOW_OVERLAP", "1")
    check(lambda: embedding_model(OPTIMIZERS["adam"]), [(1, 2, 2), (2, 2, 1)])
