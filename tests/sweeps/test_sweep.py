"""hf.sweep: every member trains to the weights (and History) its own plain `model.fit`
gives, for N = 1, 3 and 8 of an MLP, a BatchNorm CNN and a small transformer, with
different learning rates, momenta, Adam betas, dropout rates and seeds; on two
in-process ranks (groups and replicas); a member stopped early; clear errors."""

import os
import re
import subprocess
import sys
import threading

import keras
import numpy as np
import pytest

import hyparflow as hf
from hyparflow import _compat
from hyparflow.engine.local import run_ranks
from hyparflow.sweeps.fuse import MismatchError

import sweep_models as sm

EPOCHS, BATCH = 2, 16
TOLERANCE = {"sgd": 1e-5, "adam": 1e-4, "adamw": 1e-4, "rmsprop": 1e-4}


def alone(build, config, x, y, **kwargs):
    """The member's own plain model.fit: (weights, optimizer variables, history)."""
    model = build(dict(config))
    history = model.fit(x, y, batch_size=BATCH, epochs=kwargs.pop("epochs", EPOCHS), verbose=0,
                        **kwargs)
    return model.get_weights(), [v.numpy() for v in model.optimizer.variables], history.history


def diff(a, b):
    return max(float(np.max(np.abs(np.asarray(u) - np.asarray(v)))) for u, v in zip(a, b))


def check(result, expected, configs):
    models, histories = result
    assert len(models) == len(histories) == len(configs)
    for p, (config, model, history) in enumerate(zip(configs, models, histories)):
        weights, optimizer, logs = expected[p]
        tolerance = TOLERANCE[config.get("optimizer", "sgd")]
        assert diff(model.get_weights(), weights) <= tolerance, (p, config)
        assert diff([v.numpy() for v in model.optimizer.variables], optimizer) <= tolerance, p
        assert sorted(history.history) == sorted(logs), (p, sorted(history.history))
        for key, values in logs.items():
            np.testing.assert_allclose(history.history[key], values, rtol=1e-4, atol=1e-5,
                                       err_msg=f"member {p} {key}")


_REFERENCES = {}


def references(case, n):
    """The case's first `n` configs' own model.fit, each computed once for all N (in
    this worker: pytest-xdist may send N=1 and N=8 to different ones)."""
    build, data, configs = sm.CASES[case]
    done = _REFERENCES.setdefault(case, [])
    if len(done) < n:
        x, y = data()
        done += [alone(build, c, x, y) for c in configs[len(done):n]]
    return done[:n]


@pytest.mark.parametrize("n", [1, 3, 8])
@pytest.mark.parametrize("case", sorted(sm.CASES))
def test_every_member_trains_as_its_own_fit(case, n):
    build, data, configs = sm.CASES[case]
    x, y = data()
    result = hf.sweep(build, configs[:n], x, y, batch_size=BATCH, epochs=EPOCHS, verbose=0)
    check(result, references(case, n), configs[:n])


_CONV_REFERENCES = {}


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("case", sorted(sm.CONV_CASES))
def test_conv_stacks_train_as_their_own_fit(case, n):
    """Convolutions straight after each other (VGG-style Conv2D stacks, Conv1D stacks
    with causal, dilated and strided ones, Conv3D), depthwise and separable ones: each
    member as its own fit, with Adam. A strided SeparableConv2D with oneDNN on is
    refused, naming the layer and the fix (the separable stack trains in
    test_conv_stacks_without_onednn)."""
    build, data = sm.CONV_CASES[case]
    x, y = data()
    configs = sm.CONV_CONFIGS[:n]
    if case == "separable" and _compat.onednn():
        with pytest.raises(NotImplementedError,
                           match=r"SeparableConv2D with strides \(2, 2\).*TF_ENABLE_ONEDNN_OPTS=0"):
            hf.sweep(build, configs, x, y, batch_size=BATCH, epochs=EPOCHS, verbose=0)
        return
    if case not in _CONV_REFERENCES:
        _CONV_REFERENCES[case] = [alone(build, c, x, y) for c in sm.CONV_CONFIGS]
    result = hf.sweep(build, configs, x, y, batch_size=BATCH, epochs=EPOCHS, verbose=0)
    check(result, _CONV_REFERENCES[case][:n], configs)


@pytest.mark.timeout(600)
@pytest.mark.skipif(os.environ.get("TF_ENABLE_ONEDNN_OPTS") == "0",
                    reason="already the run without oneDNN")
def test_conv_stacks_without_onednn():
    """The same, in a fresh process with oneDNN off (TF_ENABLE_ONEDNN_OPTS=0, as on
    builds without it), where TensorFlow's CPU filter gradient has no groups: a grouped
    convolution of the members failed at the first step ("filter_size does not have
    enough elements"), so each layer's grouped convolution is tried first. The strided
    separable stack, refused with oneDNN on, trains here."""
    env = dict(os.environ, TF_ENABLE_ONEDNN_OPTS="0")
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
         f"{__file__}::test_conv_stacks_train_as_their_own_fit", "-k",
         "vgg-2 or conv1d-2 or separable-2"],   # 4 members take the same paths as 2
        capture_output=True, text=True, timeout=540, env=env,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "3 passed" in out.stdout, out.stdout[-2000:]


def test_optimizers_with_schedules_clipping_and_weight_decay():
    """RMSprop (momentum, centered per member, clipnorm, a learning-rate schedule) and
    AdamW (weight decay per member): each as its own fit, with validation logs."""
    x, y = sm.mlp_data()
    vx, vy = x[:20], y[:20]
    decayed = keras.optimizers.schedules.ExponentialDecay(0.02, decay_steps=3, decay_rate=0.5)
    cases = [
        [dict(seed=1, lr=0.01, optimizer="rmsprop", clipnorm=1.0),
         dict(seed=2, lr=decayed, optimizer="rmsprop", momentum=0.9, centered=True, clipnorm=0.1),
         dict(seed=3, lr=0.005, optimizer="rmsprop", rho=0.8, clipnorm=0.5)],
        [dict(seed=1, lr=0.01, optimizer="adamw", weight_decay=0.1),
         dict(seed=2, lr=0.02, optimizer="adamw", weight_decay=0.004, beta_1=0.8)],
    ]
    for configs in cases:
        result = hf.sweep(sm.mlp, configs, x, y, batch_size=BATCH, epochs=EPOCHS, verbose=0,
                          validation_data=(vx, vy))
        check(result, [alone(sm.mlp, c, x, y, validation_data=(vx, vy)) for c in configs],
              configs)


def test_a_member_stopped_early_leaves_and_the_others_go_on():
    """Member 1's EarlyStopping stops it after its second epoch, as it stops its own fit;
    members 0 and 2 train all three epochs."""
    x, y = sm.mlp_data()
    configs = sm.MLP_CONFIGS[:3]

    def stopper():
        return keras.callbacks.EarlyStopping(monitor="loss", patience=0, min_delta=10.0)

    result = hf.sweep(sm.mlp, configs, x, y, batch_size=BATCH, epochs=3, verbose=0,
                      callbacks=lambda i, config: [stopper()] if i == 1 else [])
    expected = [alone(sm.mlp, c, x, y, epochs=3, callbacks=[stopper()] if p == 1 else [])
                for p, c in enumerate(configs)]
    assert [len(h.epoch) for h in result.histories] == [3, 2, 3]
    check(result, expected, configs)


def test_a_layer_without_fused_kind_runs_once_per_member(capsys):
    """A custom layer (own weights) runs once per member inside the array, the run says
    which, and every member still trains as its own fit."""

    class Scale(keras.layers.Layer):
        def build(self, shape):
            self.scale = self.add_weight(shape=(shape[-1],), initializer="ones")

        def call(self, x):
            return x * self.scale

    def build(config):
        keras.utils.set_random_seed(config["seed"])
        inp = keras.Input((12,))
        h = Scale(name="scale")(keras.layers.Dense(8, activation="relu")(inp))
        model = keras.Model(inp, keras.layers.Dense(4)(h))
        model.compile(keras.optimizers.SGD(config["lr"]),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    x, y = sm.mlp_data()
    configs = [dict(seed=1, lr=0.1), dict(seed=2, lr=0.05)]
    result = hf.sweep(build, configs, x, y, batch_size=BATCH, epochs=EPOCHS, verbose=2)
    assert "layer 'scale' (Scale) runs once per member: no fused kind for it" in \
        capsys.readouterr().out
    check(result, [alone(build, c, x, y) for c in configs], configs)


_BUILD_LOCK = threading.Lock()


def _locked(build):
    """Thread ranks share Keras's global seeds: one build at a time."""
    def locked(config):
        with _BUILD_LOCK:
            return build(config)
    return locked


@pytest.mark.parametrize("layout", ["groups", "replicas"])
def test_two_ranks_in_process(layout):
    """Two thread ranks: two groups (members 0, 1 | 2), or one group of two replicas
    (each half of every batch: dropout masks cut from the whole batch's, an Embedding's
    pairs gathered); with sample weights, every rank returns every member as its own fit
    trains it."""
    if layout == "groups":
        build, (x, y), configs, replicas = sm.mlp, sm.mlp_data(), sm.MLP_CONFIGS[1:4], 1
    else:
        build, (x, y), configs, replicas = (sm.transformer, sm.transformer_data(),
                                            [sm.TRANSFORMER_CONFIGS[1],
                                             dict(seed=9, lr=0.01, optimizer="adam",
                                                  dropout=0.4)], 2)

    weights = np.random.default_rng(5).uniform(0.5, 1.5, len(x)).astype("float32")

    def body(comm):
        models, histories = hf.sweep(_locked(build), configs, x, y, batch_size=BATCH,
                                     epochs=EPOCHS, verbose=0, shuffle=False,
                                     num_replicas=replicas, comm=comm, sample_weight=weights)
        return [m.get_weights() for m in models], [h.history for h in histories]

    ranks = run_ranks(2, body, timeout=300)
    expected = [alone(build, c, x, y, shuffle=False, sample_weight=weights) for c in configs]
    for weights, histories in ranks:
        for p, config in enumerate(configs):
            assert diff(weights[p], expected[p][0]) <= TOLERANCE[config.get("optimizer", "sgd")]
            for key, values in expected[p][2].items():
                np.testing.assert_allclose(histories[p][key], values, rtol=1e-4, atol=1e-5)


def _error(build, configs, **kwargs):
    x, y = sm.mlp_data(16)
    with pytest.raises((ValueError, TypeError, NotImplementedError)) as info:
        hf.sweep(build, configs, x, y, batch_size=8, verbose=0, **kwargs)
    return info


def test_mismatched_graphs_are_named():
    info = _error(sm.mlp, [dict(seed=1, lr=0.1), dict(seed=2, lr=0.1, width=32)])
    assert isinstance(info.value, MismatchError)
    message = str(info.value)
    assert message.startswith("The sweep's models differ: member 1 ({seed=2, lr=0.1, width=32})")
    assert re.search(r"has layer '\w+' \(call 0 of the graph\) with output shape \(None, 32\) "
                     r"where member 0's '\w+' gives \(None, 24\)", message), message


def test_a_config_key_the_model_does_not_use_is_named():
    info = _error(sm.mlp, [dict(seed=1, lr=0.1), dict(seed=2, lr=0.1, betta_1=0.8)])
    assert "member 1 ({seed=2, lr=0.1, betta_1=0.8}): build(config) never read the config key " \
           "'betta_1'" in str(info.value)


def test_unfusable_models_are_refused_with_the_reason():
    def masked(config):
        keras.utils.set_random_seed(config["seed"])
        ids = keras.Input((12,), dtype="int32")
        h = keras.layers.Embedding(10, 4, mask_zero=True, name="tokens")(ids)
        model = keras.Model(ids, keras.layers.Dense(4)(keras.layers.GlobalAveragePooling1D()(h)))
        model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    info = _error(masked, [dict(seed=1), dict(seed=2)])
    assert "Layer 'tokens' gives a Keras mask" in str(info.value)

    class Custom(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(4)

        def call(self, x):
            return self.dense(x)

    def subclassed(config):
        model = Custom()
        model.compile("sgd", "mse")
        return model

    message = str(_error(subclassed, [{}, {}]).value)
    assert re.match(r"member 0's model '\w+' is a subclassed keras.Model, whose call a sweep "
                    r"cannot read", message), message

    def other_optimizer(config):
        model = sm.mlp(dict(config))
        if config["seed"] == 2:
            model.compile(keras.optimizers.Adagrad(0.1),
                          keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    info = _error(other_optimizer, [dict(seed=1, lr=0.1), dict(seed=2, lr=0.1)])
    assert "member 1 ({seed=2, lr=0.1})'s optimizer is Adagrad where member 0's is SGD" in \
        str(info.value)


def test_loss_weights_per_member_on_two_outputs():
    """Two inputs (a dict), two outputs with their own losses and metrics; the config sets
    the regression output's loss weight."""
    import models

    def build(config):
        model = models.two_in_two_out()
        model.compile(optimizer=keras.optimizers.SGD(config["lr"]),
                      loss={"cls": "sparse_categorical_crossentropy", "reg": "mse"},
                      loss_weights={"cls": 1.0, "reg": config["reg_weight"]},
                      metrics={"cls": ["accuracy"], "reg": ["mae"]})
        return model

    x, y = models.two_in_two_out_data(48)
    configs = [dict(lr=0.05, reg_weight=0.5), dict(lr=0.1, reg_weight=2.0)]
    result = hf.sweep(build, configs, x, y, batch_size=BATCH, epochs=EPOCHS, verbose=0)
    check(result, [alone(build, c, x, y) for c in configs], configs)


def test_a_member_stopped_within_an_epoch_ends_that_epoch_as_its_fit_does():
    """A batch-level callback stops member 1 after its second batch: as in its own fit,
    that epoch ends there (its logs and validation from those batches) and it trains no
    more; the others go on, and every member's batch logs come each step."""

    class StopAtBatch(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.seen = []

        def on_train_batch_end(self, batch, logs=None):
            self.seen.append(round(logs["loss"], 4))
            if batch == 1:
                self.model.stop_training = True

    x, y = sm.mlp_data()
    vx, vy = x[:20], y[:20]
    configs = sm.MLP_CONFIGS[:3]
    stoppers = {1: StopAtBatch()}
    result = hf.sweep(sm.mlp, configs, x, y, batch_size=BATCH, epochs=2, verbose=0,
                      validation_data=(vx, vy),
                      callbacks=lambda i, config: [stoppers[i]] if i in stoppers else [])
    alone_stopper = StopAtBatch()
    expected = [alone(sm.mlp, c, x, y, validation_data=(vx, vy),
                      callbacks=[alone_stopper] if p == 1 else []) for p, c in enumerate(configs)]
    assert [len(h.epoch) for h in result.histories] == [2, 1, 2]
    assert stoppers[1].seen == alone_stopper.seen and len(alone_stopper.seen) == 2
    check(result, expected, configs)
