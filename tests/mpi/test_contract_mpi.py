"""The numerical contract over real MPI messages; run under mpiexec by tests/cluster/test_mpi.py.

    mpiexec -n 2 python -m pytest --with-mpi tests/mpi
    mpiexec -n 4 python -m pytest --with-mpi tests/mpi
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import hyparflow as hf  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from mpi4py import MPI  # noqa: E402

import models  # noqa: E402
from conftest import max_diff  # noqa: E402

SIZE = MPI.COMM_WORLD.Get_size()


def configs():
    return {2: [(2, 1, 4), (1, 2, 1)], 4: [(2, 2, 2), (4, 1, 4)]}.get(SIZE, [(1, SIZE, 1)])


def wide_mlp():
    """Boundary messages of 16 x 1024 floats = 64 KB: past MPICH's eager limit."""
    keras.utils.set_random_seed(7)
    inp = keras.Input((64,))
    h = inp
    for _ in range(4):
        h = keras.layers.Dense(1024, activation="relu")(h)
    model = keras.Model(inp, keras.layers.Dense(4)(h))
    model.compile(optimizer=keras.optimizers.SGD(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


def wide_data():
    rng = np.random.default_rng(3)
    return rng.normal(size=(80, 64)).astype("float32"), rng.integers(0, 4, 80)


CASES = {
    "wide_mlp": (wide_mlp, wide_data, None, 32),
    "skip_cnn": (models.skip_cnn, models.skip_cnn_data, models.SKIP_CNN_BALANCE, 16),
    "two_in_two_out": (models.two_in_two_out, models.two_in_two_out_data, None, 16),
}


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("case", sorted(CASES))
def test_same_weights_as_one_process(case):
    build, data, balance, batch = CASES[case]
    x, y = data()
    reference = build()
    start = reference.get_weights()
    expected_history = reference.fit(x, y, batch_size=batch, epochs=2, shuffle=False, verbose=0).history
    expected = reference.get_weights()
    for s, r, m in configs():
        model = build()
        model.set_weights(start)
        history = hf.fit(model, x, y, batch_size=batch, epochs=2, num_stages=s, num_replicas=r,
                         num_microbatches=m, shuffle=False, verbose=0,
                         balance=balance.get(s) if balance else None)
        diff = max(float(np.abs(a - b).max()) for a, b in zip(model.get_weights(), expected))
        if hf.is_main():
            print(f"\n{case} (S,R,M)={(s, r, m)} max weight difference {diff:.3g}")
        assert diff <= 1e-5, f"{case} (S,R,M)={(s, r, m)}: {diff}"
        everyone = MPI.COMM_WORLD.allgather(history.history)
        assert all(h == everyone[0] for h in everyone)
        for key, values in expected_history.items():
            np.testing.assert_allclose(history.history[key], values, rtol=1e-5, atol=1e-6)


@pytest.mark.mpi(min_size=2)
def test_allreduces_started_inside_the_backward(monkeypatch):
    """Buckets of 1 MB (the ring) and less (MPI's Iallreduce) started from inside
    the compiled backward, on a TensorFlow thread, in the learned order."""
    from hyparflow.engine import overlap

    monkeypatch.setenv("HYPARFLOW_OVERLAP", "1")
    monkeypatch.setattr(overlap, "BUCKET_BYTES", 1 << 20)
    x, y = wide_data()
    reference = wide_mlp()
    start = reference.get_weights()
    reference.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    expected = reference.get_weights()
    for s, r, m in {2: [(1, 2, 2)], 4: [(2, 2, 2), (1, 4, 1)]}.get(SIZE, [(1, SIZE, 1)]):
        model = wide_mlp()
        model.set_weights(start)
        hf.fit(model, x, y, batch_size=32, epochs=2, num_stages=s, num_replicas=r,
               num_microbatches=m, shuffle=False, verbose=0)
        diff = max(float(np.abs(a - b).max()) for a, b in zip(model.get_weights(), expected))
        if hf.is_main():
            print(f"\nearly allreduces (S,R,M)={(s, r, m)} max weight difference {diff:.3g}")
        assert diff <= 1e-5, f"(S,R,M)={(s, r, m)}: {diff}"


@pytest.mark.mpi(min_size=2)
def test_shuffle_is_agreed_and_seeded():
    x, y = models.mlp_data(64)
    results = []
    for _ in range(2):
        model = models.mlp()
        hf.fit(model, x, y, batch_size=16, epochs=2, num_stages=2, seed=11, verbose=0)
        results.append(model.get_weights())
    for a, b in zip(*results):
        np.testing.assert_array_equal(a, b)


@pytest.mark.mpi(min_size=2)
def test_keras_loop_over_mpi(tmp_path_factory):
    """Validation, a writer callback on rank 0, evaluate, predict and tf.data, over MPI."""
    import tensorflow as tf

    import zoo

    model, (x, y) = zoo.multi_io()
    start = model.get_weights()
    val = ({k: v[:20] for k, v in x.items()}, {k: v[:20] for k, v in y.items()})
    expected = model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0,
                         validation_data=val).history
    expected_eval = model.evaluate(x, y, batch_size=8, verbose=0, return_dict=True)
    expected_pred = model.predict(x, batch_size=8, verbose=0)
    directory = MPI.COMM_WORLD.bcast(str(tmp_path_factory.mktemp("cb")) if hf.is_main() else None)
    mine = zoo.multi_io()[0]
    mine.set_weights(start)
    history = hf.fit(mine, x, y, batch_size=8, epochs=2, shuffle=False, verbose=0,
                     validation_data=val, num_stages=2, num_microbatches=2,
                     callbacks=[keras.callbacks.CSVLogger(os.path.join(directory, "log.csv"))])
    for key, values in expected.items():
        np.testing.assert_allclose(history.history[key], values, rtol=1e-5, atol=1e-6)
    MPI.COMM_WORLD.Barrier()
    assert os.path.exists(os.path.join(directory, "log.csv"))
    ev = hf.evaluate(mine, x, y, batch_size=8, num_stages=2, return_dict=True)
    for key, value in expected_eval.items():
        np.testing.assert_allclose(ev[key], value, rtol=1e-5, atol=1e-6)
    pred = hf.predict(mine, x, batch_size=8, num_stages=2)
    for key in expected_pred:
        np.testing.assert_allclose(pred[key], expected_pred[key], rtol=1e-5, atol=1e-6)
    # tf.data: each element one global batch, the same weights as numpy input.
    again = zoo.multi_io()[0]
    again.set_weights(start)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)
    hf.fit(again, dataset, epochs=2, verbose=0, num_stages=2, num_microbatches=2)
    fresh = zoo.multi_io()[0]
    fresh.set_weights(start)
    hf.fit(fresh, x, y, batch_size=8, epochs=2, shuffle=False, verbose=0, num_stages=2,
           num_microbatches=2)
    for a, b in zip(again.get_weights(), fresh.get_weights()):
        np.testing.assert_array_equal(a, b)


def tensor_configs():
    return {2: [(1, 2, 1, 2)], 4: [(2, 2, 1, 2), (1, 2, 2, 2)]}.get(SIZE, [])


@pytest.mark.mpi(min_size=2)
def test_tensor_parallel_same_weights_as_one_process():
    """num_tensor=2: wide_mlp's Dense(1024) layers paired (column, row) and split,
    64 KB sums and gathers between the tensor ranks; then evaluate and predict."""
    x, y = wide_data()
    reference = wide_mlp()
    start = reference.get_weights()
    expected_history = reference.fit(x, y, batch_size=32, epochs=2, shuffle=False,
                                     verbose=0).history
    expected = reference.get_weights()
    expected_eval = reference.evaluate(x, y, batch_size=32, verbose=0, return_dict=True)
    expected_pred = reference.predict(x, batch_size=32, verbose=0)
    for s, t, r, m in tensor_configs():
        model = wide_mlp()
        model.set_weights(start)
        history = hf.fit(model, x, y, batch_size=32, epochs=2, num_stages=s, num_tensor=t,
                         num_replicas=r, num_microbatches=m, shuffle=False, verbose=0)
        diff = max(float(np.abs(a - b).max()) for a, b in zip(model.get_weights(), expected))
        if hf.is_main():
            print(f"\nwide_mlp (S,T,R,M)={(s, t, r, m)} max weight difference {diff:.3g}")
        assert diff <= 1e-5, f"(S,T,R,M)={(s, t, r, m)}: {diff}"
        for key, values in expected_history.items():
            np.testing.assert_allclose(history.history[key], values, rtol=1e-5, atol=1e-6)
        ev = hf.evaluate(model, x, y, batch_size=32, num_stages=s, num_tensor=t,
                         return_dict=True)
        for key, value in expected_eval.items():
            np.testing.assert_allclose(ev[key], value, rtol=1e-5, atol=1e-6)
        pred = hf.predict(model, x, batch_size=32, num_stages=s, num_tensor=t)
        np.testing.assert_allclose(pred, expected_pred, rtol=1e-5, atol=1e-5)


@pytest.mark.mpi(min_size=2)
def test_tensor_parallel_checkpoint_resumes_in_another_layout(tmp_path_factory):
    """T=2 with measured shares writes a checkpoint (parts and Adam state gathered over
    MPI); it resumes with every rank a replica (T=1), and the weights are Keras's."""
    def build():
        model = wide_mlp()
        # Adam's default epsilon (1e-7) turns float32 round-off in a near-zero gradient
        # into a whole learning-rate step: some measured shares (516:508 columns) moved
        # one ReLU unit by 1e-3 against Keras while SGD agreed to 1e-8. With 1e-4 every
        # share agrees to ~3e-8, and a lost Adam slot still moves weights by >= 1e-3.
        model.compile(optimizer=keras.optimizers.Adam(1e-3, epsilon=1e-4),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    x, y = wide_data()
    reference = build()
    start = reference.get_weights()
    reference.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    directory = MPI.COMM_WORLD.bcast(str(tmp_path_factory.mktemp("tp")) if hf.is_main() else None)
    model = build()
    model.set_weights(start)
    hf.fit(model, x, y, batch_size=32, epochs=1, num_tensor=2, tensor_shares="measure",
           shuffle=False, verbose=0, checkpoint_dir=directory)
    again = build()
    again.set_weights(start)
    hf.fit(again, x, y, batch_size=32, epochs=2, shuffle=False, verbose=0,
           checkpoint_dir=directory, resume=True)
    diff = max(float(np.abs(a - b).max()) for a, b in zip(again.get_weights(),
                                                          reference.get_weights()))
    if hf.is_main():
        print(f"\nwide_mlp T=2 checkpoint resumed with T=1: max weight difference {diff:.3g}")
    assert diff <= 1e-5


@pytest.mark.mpi(min_size=2)
def test_variable_lengths_and_sparse_gradients_over_mpi():
    """Batches of different sequence lengths (a header before each boundary tensor,
    messages of 8 x 90..130 x 64 floats: past MPICH's 64 KB eager limit), the padding
    mask beside them, and the Embedding's sparse pairs gathered over replicas, with
    Adam: the weights of model.fit."""
    import tensorflow as tf

    def build():
        keras.utils.set_random_seed(23)
        ids = keras.Input((None,), dtype="int32")
        h = keras.layers.Embedding(300, 64, mask_zero=True)(ids)
        a = keras.layers.MultiHeadAttention(4, 16)(h, h)
        h = keras.layers.LayerNormalization()(keras.layers.Add()([h, a]))
        h = keras.layers.Dense(64, activation="relu")(h)
        out = keras.layers.Dense(3)(keras.layers.GlobalAveragePooling1D()(h))
        model = keras.Model(ids, out)
        model.compile(optimizer=keras.optimizers.Adam(1e-3),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    rng = np.random.default_rng(9)
    data = []
    for length in (90, 130, 110):
        x = np.zeros((8, length), np.int32)
        for row in range(8):
            n = int(rng.integers(length // 2, length + 1))
            x[row, :n] = rng.integers(1, 300, n)
        data.append((x, rng.integers(0, 3, 8)))

    def dataset():
        return tf.data.Dataset.from_generator(lambda: iter(data), output_signature=(
            tf.TensorSpec((None, None), tf.int32), tf.TensorSpec((None,), tf.int64))).apply(
            tf.data.experimental.assert_cardinality(len(data)))

    reference = build()
    start = reference.get_weights()
    reference.fit(dataset(), epochs=2, verbose=0)
    expected = reference.get_weights()
    for s, r, m in {2: [(2, 1, 2), (1, 2, 2)], 4: [(2, 2, 2), (4, 1, 2)]}.get(SIZE, [(1, SIZE, 1)]):
        model = build()
        model.set_weights(start)
        hf.fit(model, dataset(), epochs=2, num_stages=s, num_replicas=r, num_microbatches=m,
               verbose=0)
        diff = max(float(np.abs(a - b).max()) for a, b in zip(model.get_weights(), expected))
        if hf.is_main():
            print(f"\nvariable lengths (S,R,M)={(s, r, m)} max weight difference {diff:.3g}")
        assert diff <= 1e-4, f"(S,R,M)={(s, r, m)}: {diff}"


@pytest.mark.mpi(min_size=2)
def test_ema_and_global_clipnorm_over_stages():
    """Adam(use_ema=True, global_clipnorm) at S=2 (and replicas at 4 ranks): one norm
    summed over the stages' ranks by MPI (an Embedding's pairs counted per lookup),
    and the averages installed at the end of fit, which evaluate then sees."""
    def build():
        keras.utils.set_random_seed(4)
        ids = keras.Input((6,), dtype="int32")
        h = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(40, 8)(ids))
        h = keras.layers.Dense(32, activation="tanh")(h)
        h = keras.layers.Dense(16, activation="tanh")(h)
        model = keras.Model(ids, keras.layers.Dense(3)(h))
        model.compile(optimizer=keras.optimizers.Adam(0.05, global_clipnorm=0.05, use_ema=True,
                                                      ema_momentum=0.9), loss="mse")
        return model

    rng = np.random.default_rng(0)
    x = rng.integers(0, 40, (64, 6)).astype("int32")
    x[:, :3] = rng.integers(0, 4, (64, 3))
    y = rng.normal(size=(64, 3)).astype("float32")
    reference = build()
    start = reference.get_weights()
    reference.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    expected = reference.get_weights()
    expected_loss = reference.evaluate(x, y, batch_size=16, verbose=0)
    s, r, m = {2: (2, 1, 2), 4: (2, 2, 2)}.get(SIZE, (1, SIZE, 1))
    model = build()
    model.set_weights(start)
    hf.fit(model, x, y, batch_size=16, epochs=2, num_stages=s, num_replicas=r,
           num_microbatches=m, shuffle=False, verbose=0)
    diff = max_diff(model.get_weights(), expected)
    if hf.is_main():
        print(f"\nEMA + global_clipnorm (S,R,M)={(s, r, m)} max weight difference {diff:.3g}")
    assert diff <= 1e-5, f"(S,R,M)={(s, r, m)}: {diff}"
    loss = hf.evaluate(model, x, y, batch_size=16, num_stages=s)
    np.testing.assert_allclose(loss, expected_loss, rtol=1e-5)
