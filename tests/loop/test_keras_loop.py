"""hf.fit behaves like model.fit: validation, callbacks, History; evaluate, predict, tf.data."""

import csv
import os
import re

import keras
import numpy as np
import pytest
import tensorflow as tf

import hyparflow as hf
import models
import zoo
from conftest import max_diff
from hyparflow.engine.local import run_ranks


def run(size, build, start, fn):
    """fn(model, comm) on `size` thread-ranks, each with its own copy of the model."""

    def body(comm):
        model = build()
        model.set_weights(start)
        return fn(model, comm)

    return run_ranks(size, body, timeout=300)


def close(a, b, tol=1e-5):
    assert sorted(a) == sorted(b), (sorted(a), sorted(b))
    for k in a:
        np.testing.assert_allclose(a[k], b[k], rtol=tol, atol=1e-6, err_msg=k)


@pytest.mark.parametrize("use_split", [False, True])
def test_validation_metrics_match_keras(use_split):
    model, (x, y) = zoo.multi_io()      # dict I/O, per-output losses, accuracy and AUC
    start = model.get_weights()
    kwargs = {"validation_split": 0.2} if use_split else {
        "validation_data": ({k: v[:20] for k, v in x.items()}, {k: v[:20] for k, v in y.items()})}
    expected = model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0, **kwargs).history
    results = run(4, lambda: zoo.multi_io()[0], start, lambda m, comm: hf.fit(
        m, x, y, batch_size=8, epochs=2, shuffle=False, verbose=0, num_stages=2,
        num_microbatches=2, comm=comm, **kwargs).history)
    assert any(k.startswith("val_") for k in expected) and "val_q_auc" in expected
    for history in results:
        close(history, expected)


def test_callbacks_behave_as_on_one_process(tmp_path):
    x, y = models.mlp_data(96)
    xv, yv = models.mlp_data(32)
    start = models.mlp().get_weights()

    def callbacks(directory):
        return [
            keras.callbacks.ModelCheckpoint(os.path.join(directory, "best.keras"),
                                            monitor="val_loss", save_best_only=True),
            keras.callbacks.CSVLogger(os.path.join(directory, "log.csv")),
            keras.callbacks.LearningRateScheduler(lambda epoch, lr: 0.05 / (1 + epoch)),
            keras.callbacks.EarlyStopping(monitor="val_loss", patience=1, min_delta=10.0,
                                          restore_best_weights=True),
            keras.callbacks.TerminateOnNaN(),
        ]

    ref_dir = tmp_path / "keras"
    ref_dir.mkdir()
    reference = models.mlp()
    reference.set_weights(start)
    expected = reference.fit(x, y, batch_size=16, epochs=6, shuffle=False, verbose=0,
                             validation_data=(xv, yv), callbacks=callbacks(str(ref_dir))).history

    def fit(model, comm):
        directory = tmp_path / f"hf{comm.rank}"
        directory.mkdir()
        history = hf.fit(model, x, y, batch_size=16, epochs=6, shuffle=False, verbose=0,
                         validation_data=(xv, yv), num_stages=2, num_microbatches=2,
                         callbacks=callbacks(str(directory)), comm=comm)
        return history.history, model.get_weights(), float(np.asarray(model.optimizer.learning_rate))

    results = run(4, models.mlp, start, fit)
    # EarlyStopping: patience 1 with an impossible min_delta stops after epoch 2, everywhere.
    assert len(expected["loss"]) == 2
    for history, weights, lr in results:
        close(history, expected)
        assert max_diff(weights, reference.get_weights()) <= 1e-5  # restored best, every stage
        assert lr == pytest.approx(float(np.asarray(reference.optimizer.learning_rate)))
    # Writers ran on rank 0 only, and wrote what Keras writes.
    assert (tmp_path / "hf0" / "best.keras").exists()
    assert not any((tmp_path / f"hf{r}" / "log.csv").exists() for r in (1, 2, 3))
    with open(tmp_path / "hf0" / "log.csv") as f, open(ref_dir / "log.csv") as g:
        ours, theirs = list(csv.DictReader(f)), list(csv.DictReader(g))
    assert [row["epoch"] for row in ours] == [row["epoch"] for row in theirs]
    for a, b in zip(ours, theirs):
        np.testing.assert_allclose(float(a["val_loss"]), float(b["val_loss"]), rtol=1e-5)
    saved = keras.saving.load_model(tmp_path / "hf0" / "best.keras")
    reference_saved = keras.saving.load_model(ref_dir / "best.keras")
    assert max_diff(saved.get_weights(), reference_saved.get_weights()) <= 1e-5


def test_user_callback_sees_global_logs_on_every_rank():
    x, y = models.mlp_data(64)
    start = models.mlp().get_weights()

    class Spy(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.seen = []

        def on_train_batch_end(self, batch, logs=None):
            self.seen.append(("batch", batch, round(logs["loss"], 6)))

        def on_epoch_end(self, epoch, logs=None):
            assert self.model.name == "functional" or self.model is not None
            self.seen.append(("epoch", epoch, round(logs["loss"], 6), round(logs["accuracy"], 6)))

    def fit(model, comm):
        spy = Spy()
        hf.fit(model, x, y, batch_size=16, epochs=2, verbose=0, num_stages=2, shuffle=False,
               callbacks=[spy], comm=comm)
        assert spy.model is model
        return spy.seen

    seen = run(4, models.mlp, start, fit)
    assert all(s == seen[0] for s in seen) and len(seen[0]) == 2 * 4 + 2


def test_reduce_lr_on_plateau_changes_every_stage():
    x, y = models.mlp_data(64)
    start = models.mlp().get_weights()
    cb = lambda: keras.callbacks.ReduceLROnPlateau(monitor="loss", factor=0.5, patience=0, min_delta=10.0)  # noqa
    reference = models.mlp()
    reference.set_weights(start)
    reference.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0, callbacks=[cb()])
    results = run(2, models.mlp, start, lambda m, comm: (hf.fit(
        m, x, y, batch_size=16, epochs=3, shuffle=False, verbose=0, num_stages=2, callbacks=[cb()],
        comm=comm), m.get_weights(), float(np.asarray(m.optimizer.learning_rate)))[1:])
    for weights, lr in results:
        assert lr == pytest.approx(0.01 * 0.25)
        assert max_diff(weights, reference.get_weights()) <= 1e-5


def test_terminate_on_nan_stops_all_ranks():
    x, y = models.mlp_data(64)
    weights = np.ones(64, "float32")
    weights[20] = np.nan  # the second batch's loss is NaN (ReLU would swallow a NaN input)
    start = models.mlp().get_weights()

    def fit(model, comm):
        history = hf.fit(model, x, y, batch_size=16, epochs=5, verbose=0, num_stages=2,
                         shuffle=False, check_finite=False, sample_weight=weights,
                         callbacks=[keras.callbacks.TerminateOnNaN()], comm=comm)
        return len(history.history["loss"]), bool(model.stop_training), int(
            model.optimizer.iterations.numpy())

    results = run(2, models.mlp, start, fit)
    # Both ranks stop after the second step of the first epoch, as Keras would.
    assert results[0] == results[1] == (1, True, 2)


@pytest.mark.parametrize("config", [(1, 1, 1), (2, 2, 2), (3, 1, 3)])
def test_evaluate_and_predict_match_keras(config):
    s, r, m = config
    model, (x, y) = zoo.multi_io()
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    trained = model.get_weights()
    expected_eval = model.evaluate(x, y, batch_size=8, verbose=0, return_dict=True)
    expected_pred = model.predict(x, batch_size=8, verbose=0)

    def body(mdl, comm):
        ev = hf.evaluate(mdl, x, y, batch_size=8, num_stages=s, num_replicas=r, num_microbatches=m,
                         return_dict=True, comm=comm)
        pr = hf.predict(mdl, x, batch_size=8, num_stages=s, num_replicas=r, num_microbatches=m,
                        comm=comm)
        main_only = hf.predict(mdl, x, batch_size=8, num_stages=s, num_replicas=r,
                               num_microbatches=m, gather="main", comm=comm)
        return ev, pr, main_only

    results = run(s * r, lambda: zoo.multi_io()[0], trained, body)
    for rank, (ev, pr, main_only) in enumerate(results):
        close(ev, expected_eval)
        assert sorted(pr) == sorted(expected_pred)
        for k in pr:
            np.testing.assert_allclose(pr[k], expected_pred[k], rtol=1e-5, atol=1e-6)
        assert (main_only is None) == (rank != 0)


def test_evaluate_returns_what_keras_returns():
    x, y = models.mlp_data(40)
    model = models.mlp()
    expected = model.evaluate(x, y, batch_size=8, verbose=0)
    got = run_ranks(1, lambda comm: hf.evaluate(model, x, y, batch_size=8, comm=comm))[0]
    np.testing.assert_allclose(got, expected, rtol=1e-6)
    loss_only = keras.Model(model.inputs, model.outputs)
    loss_only.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    scalar = run_ranks(1, lambda comm: hf.evaluate(loss_only, x, y, batch_size=8, comm=comm))[0]
    assert isinstance(scalar, float)


def test_tf_data_input_equals_numpy_input():
    x, y = models.mlp_data(100)
    start = models.mlp().get_weights()
    sw = np.linspace(0.5, 1.5, 100).astype("float32")
    dataset = tf.data.Dataset.from_tensor_slices((x, y, sw)).batch(16)
    numpy_run = run(4, models.mlp, start, lambda m, comm: (hf.fit(
        m, x, y, sample_weight=sw, batch_size=16, epochs=2, shuffle=False, verbose=0,
        num_stages=2, num_microbatches=2, comm=comm).history, m.get_weights()))
    data_run = run(4, models.mlp, start, lambda m, comm: (hf.fit(
        m, dataset, epochs=2, verbose=0, num_stages=2, num_microbatches=2, comm=comm).history,
        m.get_weights()))
    for (h1, w1), (h2, w2) in zip(numpy_run, data_run):
        close(h1, h2, tol=1e-6)
        assert max_diff(w1, w2) == 0.0


def test_initial_epoch_and_steps_per_epoch():
    x, y = models.mlp_data(96)
    start = models.mlp().get_weights()
    results = run(2, models.mlp, start, lambda m, comm: hf.fit(
        m, x, y, batch_size=16, epochs=4, initial_epoch=1, steps_per_epoch=3, verbose=0,
        num_stages=2, comm=comm).history)
    assert len(results[0]["loss"]) == 3 and results[0] == results[1]


class Recorder(keras.callbacks.Callback):
    """Every callback event, with its logs (predict's outputs as arrays)."""

    def __init__(self):
        super().__init__()
        self.events = []

    def _add(self, name, batch=None, logs=None):
        logs = dict(logs or {})
        if "outputs" in logs:
            logs["outputs"] = np.asarray(logs["outputs"])
        self.events.append((name, batch, logs))

    def on_test_begin(self, logs=None):
        self._add("test_begin")

    def on_test_batch_begin(self, batch, logs=None):
        self._add("test_batch_begin", batch)

    def on_test_batch_end(self, batch, logs=None):
        self._add("test_batch_end", batch, logs)

    def on_test_end(self, logs=None):
        self._add("test_end", None, logs)

    def on_predict_begin(self, logs=None):
        self._add("predict_begin")

    def on_predict_batch_begin(self, batch, logs=None):
        self._add("predict_batch_begin", batch)

    def on_predict_batch_end(self, batch, logs=None):
        self._add("predict_batch_end", batch, logs)

    def on_predict_end(self, logs=None):
        self._add("predict_end")


def same_events(got, expected):
    assert [(n, b) for n, b, _ in got] == [(n, b) for n, b, _ in expected]
    for (_, _, a), (_, _, b) in zip(got, expected):
        assert sorted(a) == sorted(b)
        for k in a:
            np.testing.assert_allclose(a[k], b[k], rtol=1e-5, atol=1e-6)


def test_evaluate_and_predict_take_keras_arguments_and_callbacks(capsys):
    x, y = models.mlp_data(40)
    model = models.mlp()
    start = model.get_weights()
    sw = np.linspace(0.5, 1.5, 40).astype("float32")
    keras_eval, keras_pred = Recorder(), Recorder()
    expected = model.evaluate(x, y, batch_size=8, verbose=0, sample_weight=sw, steps=4,
                              callbacks=[keras_eval], return_dict=True)
    expected_pred = model.predict(x, batch_size=8, verbose=0, callbacks=[keras_pred])
    capsys.readouterr()

    def body(mdl, comm):
        ev_cb, pr_cb = Recorder(), Recorder()
        got = hf.evaluate(mdl, x, y, batch_size=8, verbose=0, sample_weight=sw, steps=4,
                          callbacks=[ev_cb], return_dict=True, num_stages=2,
                          num_microbatches=2, comm=comm)
        pred = hf.predict(mdl, x, batch_size=8, verbose=0, callbacks=[pr_cb], num_stages=2,
                          num_microbatches=2, comm=comm)
        return got, pred, ev_cb.events, pr_cb.events

    for got, pred, ev_events, pr_events in run(2, models.mlp, start, body):
        close(got, expected)
        np.testing.assert_allclose(pred, expected_pred, rtol=1e-5, atol=1e-6)
        same_events(ev_events, keras_eval.events)
        same_events(pr_events, keras_pred.events)
    assert capsys.readouterr().out == ""   # verbose=0 prints nothing, on any rank


class Terminal(__import__("io").StringIO):
    def isatty(self):
        return True


def _without_times(text):
    return re.sub(r" - \d+s - \d+m?s/step", " - T", text)


def test_progress_of_evaluate_and_predict_as_keras(monkeypatch, capsys):
    x, y = models.mlp_data(40)
    model = models.mlp()
    start = model.get_weights()
    model.evaluate(x, y, batch_size=8, verbose=2)
    model.predict(x, batch_size=8, verbose=2)
    keras_lines = _without_times(capsys.readouterr().out)
    assert keras_lines.count("\n") == 2 and "\x1b" not in keras_lines

    def body(mdl, comm):
        hf.evaluate(mdl, x, y, batch_size=8, num_stages=2, comm=comm)   # verbose="auto"
        hf.predict(mdl, x, batch_size=8, num_stages=2, comm=comm)

    # Output that is not a terminal: "auto" prints Keras's one-line style, rank 0 only.
    run(2, models.mlp, start, body)
    assert _without_times(capsys.readouterr().out) == keras_lines
    # On a terminal, "auto" is Keras's bar (escape codes and all), still on rank 0 only.
    terminal = Terminal()
    monkeypatch.setattr("sys.stdout", terminal)
    run(2, models.mlp, start, body)
    bars = terminal.getvalue()
    assert "\x1b[" in bars and bars.count("\n") == 2, bars   # two finished bars, one rank


class Unbuilt(keras.Model):
    """A subclassed model whose variables exist only once it has seen a batch."""

    def __init__(self):
        super().__init__(name="net")
        seeded = keras.initializers.GlorotUniform
        self.a = keras.layers.Dense(16, activation="relu", kernel_initializer=seeded(seed=1))
        self.b = keras.layers.Dense(4, kernel_initializer=seeded(seed=2))

    def call(self, x):
        return self.b(self.a(x))


def unbuilt(kind):
    if kind == "subclassed":
        model = Unbuilt()
    else:   # a Sequential without an Input: also built by model.fit from the first batch
        seeded = keras.initializers.GlorotUniform
        model = keras.Sequential([
            keras.layers.Dense(16, activation="relu", kernel_initializer=seeded(seed=1)),
            keras.layers.Dense(16, activation="relu", kernel_initializer=seeded(seed=3)),
            keras.layers.Dense(4, kernel_initializer=seeded(seed=2))], name="net")
    model.compile(optimizer="adam",
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    assert not model.built
    return model


@pytest.mark.parametrize("kind,stages", [("subclassed", 1), ("sequential", 2)])
def test_an_unbuilt_model_is_built_as_model_fit_builds_it(kind, stages):
    x, y = models.mlp_data(48)
    reference = unbuilt(kind)
    expected = reference.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0).history

    def body(comm):
        model = unbuilt(kind)
        history = hf.fit(model, x, y, batch_size=8, epochs=2, shuffle=False, verbose=0,
                         num_stages=stages, comm=comm)
        return model.get_weights(), history.history

    for weights, history in run_ranks(2, body, timeout=300):   # S=1 x R=2, or S=2
        assert max_diff(weights, reference.get_weights()) < 1e-5
        close(history, expected)
    # evaluate builds an unbuilt model too, as model.evaluate does (same seeded start).
    expected_eval = unbuilt(kind).evaluate(x, y, batch_size=8, verbose=0)
    for got in run_ranks(2, lambda comm: hf.evaluate(unbuilt(kind), x, y, batch_size=8,
                                                     verbose=0, num_stages=stages, comm=comm),
                         timeout=300):
        np.testing.assert_allclose(got, expected_eval, rtol=1e-5)
