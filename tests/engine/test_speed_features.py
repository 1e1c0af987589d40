"""1F1B, eager vs compiled, recomputation and the timeline keep the numerical contract."""

import functools
import json

import pytest

import models
from conftest import max_diff, reference, train_ranks
from hyparflow.engine import timeline as T
from test_rules import bn_data, bn_model



@functools.cache  # one plain Keras run for every option and layout below (tests only read it)
def skip_cnn_reference():
    return reference(models.skip_cnn, *models.skip_cnn_data(), epochs=2)


@pytest.mark.parametrize("options", [
    {"schedule": "1f1b"},
    {"schedule": "1f1b", "recompute": True},
    {"run_eagerly": True},
    {"recompute": True},
])
@pytest.mark.parametrize("config", [(3, 1, 4), (2, 2, 2)])
def test_options_give_plain_keras_weights(options, config):
    x, y = models.skip_cnn_data()
    start, expected, _ = skip_cnn_reference()
    s, r, m = config
    results = train_ranks(models.skip_cnn, x, y, num_stages=s, num_replicas=r, num_microbatches=m,
                          weights=start, batch_size=16, epochs=2, shuffle=False,
                          balance=models.SKIP_CNN_BALANCE[s], **options)
    assert max(max_diff(w, expected) for w, _ in results) <= 1e-5


def test_gpipe_and_1f1b_accumulate_in_the_same_order():
    x, y = models.mlp_data()
    start = models.mlp().get_weights()
    runs = [train_ranks(models.mlp, x, y, num_stages=3, num_replicas=1, num_microbatches=4,
                        weights=start, batch_size=16, epochs=2, shuffle=False, schedule=s)[0][0]
            for s in ("gpipe", "1f1b")]
    assert max_diff(*runs) == 0.0


def test_recompute_updates_batchnorm_statistics_once():
    x, y = bn_data()
    start = bn_model().get_weights()
    plain, again = [train_ranks(bn_model, x, y, num_stages=2, num_replicas=1, num_microbatches=2,
                                weights=start, batch_size=16, epochs=2, shuffle=False,
                                recompute=flag)[0][0] for flag in (False, True)]
    assert max_diff(plain, again) <= 1e-6


def test_trace_records_every_action_on_every_rank(tmp_path):
    x, y = models.mlp_data(64)
    start = models.mlp().get_weights()
    path = tmp_path / "run.json"
    train_ranks(models.mlp, x, y, num_stages=2, num_replicas=2, num_microbatches=4,
                weights=start, batch_size=16, epochs=1, shuffle=False, trace=str(path),
                schedule="gpipe")  # under 1F1B the last stage's forwards fuse with backwards
    trace = json.loads(path.read_text())
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["tid"] for e in events} == {0, 1, 2, 3}
    cats = {e["cat"] for e in events}
    assert {"forward", "backward", "send", "wait", "allreduce", "optimizer", "step"} <= cats
    for rank in range(4):
        mine = [e for e in events if e["tid"] == rank]
        assert sum(e["cat"] == "forward" for e in mine) == 4 * 4   # 4 steps x 4 microbatches
        assert sum(e["cat"] == "backward" for e in mine) == 4 * 4
    assert trace["otherData"]["num_stages"] == 2
    assert 0.0 <= T.bubble(trace) < 1.0
    picture = tmp_path / "run.png"
    T.draw(trace, str(picture))
    assert picture.stat().st_size > 1000


def test_trace_command_prints_the_bubble_and_draws(tmp_path, capsys):
    from hyparflow import cli

    x, y = models.mlp_data(64)
    start = models.mlp().get_weights()
    path = tmp_path / "run.json"
    train_ranks(models.mlp, x, y, num_stages=2, num_replicas=1, num_microbatches=4,
                weights=start, batch_size=16, epochs=1, shuffle=False, trace=str(path))
    assert cli.main(["trace", str(path), "-o", str(tmp_path / "picture.png")]) == 0
    out = capsys.readouterr().out
    assert "measured bubble" in out and "theoretical (S-1)/(M+S-1) = 0.200 (S=2, M=4" in out
    assert (tmp_path / "picture.png").stat().st_size > 1000
    # Without -o it draws too, beside the trace, as its help says.
    assert cli.main(["trace", str(path)]) == 0
    assert f"wrote {tmp_path / 'run.png'}" in capsys.readouterr().out
    assert (tmp_path / "run.png").stat().st_size > 1000


def test_dense_backward_uses_the_kept_transpose():
    """Stages multiply by a kept W^T for every Dense call whose input gradient is wanted
    (not the first layer, whose input is data); its gradients are TensorFlow's, for 2-D
    and 3-D inputs, and a mask on the input is passed on as Dense passes it."""
    import keras
    import numpy as np
    import tensorflow as tf

    from hyparflow import _compat
    from hyparflow.engine import kernels
    from hyparflow.graph import from_model
    from hyparflow.engine.partition import partition
    from hyparflow.engine.stage import Stage

    model = models.mlp()
    graph = from_model(model)
    part = partition(graph, 2, [2, 3])
    first = Stage(graph, part.stages[0], model, part, is_last=False)
    last = Stage(graph, part.stages[1], model, part, is_last=True)
    assert [graph.nodes[i].op.name for i in first.transposed] == ["hidden_1"]
    assert [graph.nodes[i].op.name for i in last.transposed] == ["hidden_2", "hidden_3", "logits"]

    rng = np.random.default_rng(0)
    for shape in [(4, 3), (2, 6, 3)]:
        x = tf.constant(rng.normal(size=shape).astype("float32"))
        layer = keras.layers.Dense(5, activation="tanh")
        layer.build(shape)
        fast = kernels.Transposed(layer)
        with tf.GradientTape(persistent=True) as tape:
            tape.watch(x)
            want, got = layer(x), fast([x], {})
        np.testing.assert_allclose(got, want, rtol=1e-6)
        for a, b in zip(tape.gradient(got, [x, layer.kernel.value, layer.bias.value]),
                        tape.gradient(want, [x, layer.kernel.value, layer.bias.value])):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    mask = tf.constant([[True, False, True, True, True, False]] * 2)
    masked = tf.identity(x)
    _compat.set_mask(masked, mask)
    np.testing.assert_array_equal(_compat.get_mask(fast([masked], {})), mask)


@pytest.mark.parametrize("keep", [True, False])
def test_the_first_step_keeps_each_transpose_only_where_it_pays(keep, monkeypatch):
    """`kernels.pays` decides per kernel at the first step, before the training
    functions are traced: kept or not, training gives model.fit's weights (Adam)."""
    from hyparflow.engine import kernels

    asked = []

    def pays(kernel, rows, uses):
        asked.append((tuple(kernel.shape), rows, uses))
        return keep

    monkeypatch.setattr(kernels, "pays", pays)
    build = lambda: models.mlp("adam")  # noqa: E731
    x, y = models.mlp_data(64)
    start, expected, _ = reference(build, x, y, epochs=2)
    results = train_ranks(build, x, y, num_stages=2, num_replicas=1, num_microbatches=4,
                          weights=start, batch_size=16, epochs=2, shuffle=False)
    assert max(max_diff(w, expected) for w, _ in results) <= 1e-5
    # Asked once per kept-able kernel (hidden_1 .. logits), for 4-row microbatches, 4 a step.
    assert sorted(asked) == sorted([((32, 32), 4, 4), ((32, 24), 4, 4), ((24, 16), 4, 4),
                                    ((16, 4), 4, 4)])


def test_a_transpose_never_pays_without_products():
    import keras

    from hyparflow.engine import kernels

    layer = keras.layers.Dense(64)
    layer.build((None, 64))
    assert not kernels.pays(layer.kernel, 32, 0)


def test_transposed_forced_on_is_not_timed(monkeypatch):
    import keras

    from hyparflow.engine import kernels

    def timed(*args):
        raise AssertionError("HYPARFLOW_TRANSPOSED=1 keeps W^T without timing")

    monkeypatch.setattr(kernels, "_measure", timed)
    monkeypatch.setattr(kernels, "_PAYS", {})
    monkeypatch.setenv("HYPARFLOW_TRANSPOSED", "1")
    layer = keras.layers.Dense(64)
    layer.build((None, 64))
    assert kernels.pays(layer.kernel, 32, 0)


def _jit(build):
    def built():
        model = build()
        model.jit_compile = True   # as model.compile(jit_compile=True) leaves it
        return model
    return built


@pytest.mark.parametrize("build,data,config", [
    (models.skip_cnn, models.skip_cnn_data, (2, 1, 2)),
    (models.mlp, models.mlp_data, (1, 2, 2)),
])
def test_a_model_compiled_for_xla_runs_its_stages_under_xla(build, data, config, recwarn):
    """`model.compile(jit_compile=True)`: the stage functions are XLA-compiled (no
    fallback said) and train to the weights of `model.fit` with XLA."""
    from hyparflow.engine.compiled import XLAOrPlain as _XLAOrPlain

    x, y = data()
    start, expected, _ = reference(_jit(build), x, y, epochs=1)
    s, r, m = config
    before = _XLAOrPlain.runs
    results = train_ranks(_jit(build), x, y, num_stages=s, num_replicas=r, num_microbatches=m,
                          weights=start, batch_size=16, epochs=1, shuffle=False)
    assert _XLAOrPlain.runs > before
    assert not [w for w in recwarn if "XLA could not compile" in str(w.message)]
    assert max(max_diff(w, expected) for w, _ in results) <= 1e-5


@pytest.mark.parametrize("schedule", ["1f1b", "1f1b-w"])
def test_transposes_are_copied_after_the_first_stages_forwards(schedule, monkeypatch, tmp_path):
    """The kept W^T copies of a step wait for the stage's first wait or backward (a first
    stage's warm-up forwards do not read them): on stage 0 they come after F0 and before
    B0 every step, and the backwards still multiply by the step's own weights (model.fit's
    weights after 2 epochs of 4 steps; a stale W^T would be a step behind)."""
    monkeypatch.setenv("HYPARFLOW_TRANSPOSED", "1")
    build = lambda: models.mlp("sgd")  # noqa: E731
    x, y = models.mlp_data(64)
    start, expected, _ = reference(build, x, y, epochs=2)
    trace = str(tmp_path / "t.json")
    results = train_ranks(build, x, y, num_stages=2, num_replicas=1, num_microbatches=4,
                          weights=start, batch_size=16, epochs=2, shuffle=False,
                          schedule=schedule, trace=trace)
    assert max(max_diff(w, expected) for w, _ in results) <= 1e-5
    events = sorted((e for e in json.load(open(trace))["traceEvents"]
                     if e.get("tid") == 0 and e.get("ph") == "X"), key=lambda e: e["ts"])
    steps = [e for e in events if e["cat"] == "step"]
    assert len(steps) == 8
    for step in steps:
        inside = [e["name"] for e in events if e["cat"] != "step"
                  and step["ts"] <= e["ts"] < step["ts"] + step["dur"]]
        assert inside.index("F0") < inside.index("W^T copies") < inside.index("B0"), inside
        assert inside.count("W^T copies") == 1
