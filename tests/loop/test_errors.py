"""Bad input gets a clear error naming the value and the fix, and trains nothing."""

import keras
import numpy as np
import pytest

import hyparflow as hf
import models
from hyparflow.engine.local import run_ranks


def fit_on(size, build, x, y, **kwargs):
    def body(comm):
        return hf.fit(build(), x, y, comm=comm, verbose=0, **kwargs)

    return run_ranks(size, body, timeout=120)


def test_world_size_not_stages_times_replicas():
    x, y = models.mlp_data(32)
    with pytest.raises(ValueError, match=r"num_replicas=2 \(this script's argument\) = 4 ranks, but 3 were launched"):
        fit_on(3, models.mlp, x, y, num_stages=2, num_replicas=2)
    with pytest.raises(ValueError, match=r"does not divide"):
        fit_on(3, models.mlp, x, y, num_stages=2)


def test_more_stages_than_layer_calls():
    x, y = models.mlp_data(32)
    with pytest.raises(ValueError, match=r"num_stages=7 is larger than the number of layer calls in the model \(5\)"):
        fit_on(7, models.mlp, x, y, num_stages=7)


def test_batch_smaller_than_replicas_times_microbatches():
    x, y = models.mlp_data(32)
    with pytest.raises(ValueError, match=r"batch_size=4 is smaller than num_replicas x num_microbatches = 2 x 4"):
        fit_on(2, models.mlp, x, y, num_stages=1, num_microbatches=4, batch_size=4)


def test_uncompiled_model():
    x, y = models.mlp_data(32)

    def build():
        inp = keras.Input((12,))
        return keras.Model(inp, keras.layers.Dense(2)(inp))

    with pytest.raises(ValueError, match=r"is not compiled: call model.compile"):
        fit_on(1, build, x, y)


def test_x_and_y_lengths_differ():
    x, y = models.mlp_data(32)
    with pytest.raises(ValueError, match=r"same number of samples.*'y\[0\]': 31"):
        fit_on(1, models.mlp, x, y[:31])


def test_balance_does_not_sum():
    x, y = models.mlp_data(32)
    with pytest.raises(ValueError, match=r"`balance` must sum to the number of layer calls in the model \(5\). Received: balance=\[1, 2\]"):
        fit_on(2, models.mlp, x, y, num_stages=2, balance=[1, 2])
    with pytest.raises(ValueError, match=r"one count per stage"):
        fit_on(2, models.mlp, x, y, num_stages=2, balance=[5])


class Subclassed(keras.Model):
    def __init__(self):
        super().__init__()
        self.a = keras.layers.Dense(8, activation="relu")
        self.b = keras.layers.Dense(4)

    def call(self, x):
        return self.b(self.a(x))


def build_subclassed():
    keras.utils.set_random_seed(5)
    model = Subclassed()
    model(np.zeros((1, 12), "float32"))
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def test_subclassed_model_cannot_be_pipelined_but_trains_data_parallel():
    x, y = models.mlp_data(40)
    with pytest.raises(ValueError, match=r"subclassed keras.Model.*num_stages=1.*Functional"):
        fit_on(2, build_subclassed, x, y, num_stages=2)
    # S=1: plain data parallelism, and the same weights as one process.
    reference = build_subclassed()
    start = reference.get_weights()
    reference.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)

    def body(comm):
        model = build_subclassed()
        model.set_weights(start)
        hf.fit(model, x, y, comm=comm, batch_size=8, epochs=2, shuffle=False, verbose=0)
        return model.get_weights()

    for weights in run_ranks(2, body, timeout=120):
        for a, b in zip(weights, reference.get_weights()):
            np.testing.assert_allclose(a, b, atol=1e-5)


def test_ranks_that_disagree_are_told_so():
    x, y = models.mlp_data(32)

    def body(comm):
        n = 32 if comm.rank == 0 else 30
        return hf.fit(models.mlp(), x[:n], y[:n], comm=comm, verbose=0, num_stages=2)

    with pytest.raises(ValueError, match=r"Ranks disagree on the set-up.*samples"):
        run_ranks(2, body, timeout=120)


def test_error_in_one_rank_stops_the_others():
    """A layer that fails on one rank mid-training: every rank stops, none hangs."""
    x, y = models.mlp_data(64)

    def body(comm):
        model = models.mlp()
        if comm.rank == 1:
            def failing(*args, **kwargs):
                raise RuntimeError("injected failure on rank 1")

            model.optimizer.apply = failing
            model.optimizer.apply_gradients = failing
        return hf.fit(model, x, y, comm=comm, verbose=0, num_stages=2, batch_size=16)

    with pytest.raises(RuntimeError, match="injected failure on rank 1"):
        run_ranks(2, body, timeout=120)



def test_stage_and_microbatch_defaults_come_from_the_environment(monkeypatch):
    x, y = models.mlp_data(32)
    monkeypatch.setenv("HYPARFLOW_NUM_STAGES", "2")
    monkeypatch.setenv("HYPARFLOW_NUM_MICROBATCHES", "4")
    with pytest.raises(ValueError, match=r"num_replicas x num_microbatches = 1 x 4"):
        fit_on(2, models.mlp, x, y, batch_size=2)
    monkeypatch.setenv("HYPARFLOW_NUM_STAGES", "two")
    with pytest.raises(ValueError, match=r"HYPARFLOW_NUM_STAGES must be an integer"):
        fit_on(1, models.mlp, x, y)


def test_fit_arguments_win_over_the_environment(monkeypatch):
    """What `hyparflow run --stages/--replicas` exports is a default; the script's own
    argument wins, and a replica count given for another S says where it came from."""
    x, y = models.mlp_data(32)
    monkeypatch.setenv("HYPARFLOW_NUM_STAGES", "1")
    monkeypatch.setenv("HYPARFLOW_NUM_MICROBATCHES", "4")
    history = fit_on(2, models.mlp, x, y, batch_size=8, num_stages=2, num_microbatches=1)
    assert len(history[0].history["loss"]) == 1
    monkeypatch.setenv("HYPARFLOW_NUM_REPLICAS", "2")
    with pytest.raises(ValueError, match=r"num_stages=2 \(this script's argument\) x "
                       r"num_replicas=2 \(\$HYPARFLOW_NUM_REPLICAS, from `hyparflow run` or a "
                       r"job script\) = 4 ranks, but 2 were launched. Leave --replicas out"):
        fit_on(2, models.mlp, x, y, batch_size=8, num_stages=2)
    fit_on(2, models.mlp, x, y, batch_size=8, num_stages=2, num_replicas=1)   # given: fine


def test_an_argument_overriding_the_launcher_is_said_once(monkeypatch):
    """`hyparflow run --stages 1` beside `num_stages=2` in the script: the argument wins
    (as documented), with one warning naming both sources, not one per call or rank."""
    import warnings

    from hyparflow import layout

    x, y = models.mlp_data(32)
    monkeypatch.setenv("HYPARFLOW_NUM_STAGES", "1")
    monkeypatch.setattr(layout, "_WARNED", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit_on(2, models.mlp, x, y, batch_size=8, num_stages=2)
        fit_on(2, models.mlp, x, y, batch_size=8, num_stages=2)
        fit_on(2, models.mlp, x, y, batch_size=8, num_stages=1)   # agrees: nothing to say
    said = [str(w.message) for w in caught if "launcher" in str(w.message)]
    assert said == [
        "num_stages=2 (this script's argument) overrides num_stages=1 from the launcher "
        "($HYPARFLOW_NUM_STAGES, set by `hyparflow run --stages` or a job script). To take "
        "the launcher's, leave num_stages out of the call (or pass None)."], said


def test_a_mistyped_keyword_is_told_what_it_meant():
    x, y = models.mlp_data(32)
    with pytest.raises(TypeError, match=r"hf.fit\(\) got an unexpected keyword argument "
                                        r"'num_stage'. Did you mean 'num_stages'\?"):
        fit_on(2, models.mlp, x, y, num_stage=2)
    with pytest.raises(TypeError, match=r"hf.evaluate\(\) got an unexpected keyword argument "
                                        r"'epochs'\.(\n|$)"):  # no suggestion
        run_ranks(2, lambda comm: hf.evaluate(models.mlp(), x, y, epochs=2, comm=comm),
                  timeout=120)


def test_optimizers_that_would_train_differently_are_refused():
    x, y = models.mlp_data(32)

    def clipped():
        model = models.mlp()
        model.compile(optimizer=keras.optimizers.SGD(global_clipnorm=1.0),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    # One norm summed over the stages (engine.clipping; tests/loop/test_optimizer_contract.py).
    fit_on(2, clipped, x, y, num_stages=2)
    fit_on(1, clipped, x, y)

    def scaled():
        model = models.mlp()
        model.compile(optimizer=keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD()),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    with pytest.raises(NotImplementedError, match="LossScaleOptimizer"):
        fit_on(1, scaled, x, y)


def test_python_control_flow_on_a_tensor_fails_as_under_model_fit():
    """Keras traces its train step without AutoGraph (`do_not_convert`), so a layer's
    Python `if` on a tensor is an error under model.fit; hyparflow traces as Keras
    does, so the model that fails there fails here too, not trains differently."""
    import tensorflow as tf

    class Sign(keras.layers.Layer):
        def call(self, x):
            if tf.reduce_sum(x) > 0:   # Python control flow on a tensor
                return x
            return -x

        def compute_output_spec(self, x):   # so the model builds without calling `call`
            return keras.KerasTensor(x.shape, x.dtype)

    def build():
        inp = keras.Input((4,))
        model = keras.Model(inp, keras.layers.Dense(2)(Sign()(keras.layers.Dense(4)(inp))))
        model.compile(optimizer="sgd", loss="mse")
        return model

    x = np.ones((8, 4), "float32")
    y = np.zeros((8, 2), "float32")
    build()   # builds
    with pytest.raises(tf.errors.OperatorNotAllowedInGraphError):
        build().fit(x, y, batch_size=4, verbose=0)
    with pytest.raises(tf.errors.OperatorNotAllowedInGraphError):
        fit_on(2, build, x, y, num_stages=2, batch_size=4)
