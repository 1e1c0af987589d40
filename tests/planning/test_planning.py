"""Balance modes, profiles, speeds, memory limits and plan files."""

import json

import pytest

import hyparflow as hf
import models
from conftest import max_diff, train_ranks
from hyparflow.loop import costs
from hyparflow import graph as G, plan as P
from hyparflow.layout import Layout
from hyparflow.engine.local import run_ranks
from hyparflow.planning.profile import optimizer_slots, profile


def test_profile_measures_every_layer_call():
    model = models.mlp("adam")
    g = G.from_model(model)
    profiles = profile(g, model, batch=16, repeats=2)
    assert [p.name for p in profiles] == [n.name for n in g.nodes]
    assert all(p.seconds > 0 for p in profiles)
    first = profiles[0]
    assert first.param_bytes == (12 * 32 + 32) * 4
    assert first.optimizer_bytes == 2 * first.param_bytes   # Adam: two slots per weight
    assert first.activation_bytes == 32 * 4
    assert optimizer_slots(models.mlp("sgd").optimizer) == 0


@pytest.mark.parametrize("mode", ["estimate", "params", "time", "memory"])
def test_every_balance_mode_trains_to_keras_weights(mode):
    x, y = models.mlp_data()
    reference = models.mlp()
    start = reference.get_weights()
    reference.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    results = train_ranks(models.mlp, x, y, num_stages=3, num_replicas=1, num_microbatches=2,
                          weights=start, batch_size=16, epochs=1, shuffle=False, balance=mode)
    assert max_diff(results[0][0], reference.get_weights()) <= 1e-5


def test_speeds_other_than_measure_or_numbers_are_refused_by_name():
    """A string for `speeds` other than "measure" was taken as one speed per character."""
    model = models.mlp()
    g = G.from_model(model)
    with pytest.raises(ValueError, match="speeds='fast'"):
        run_ranks(1, lambda comm: costs.resolve(g, model, comm, "params", Layout(num_stages=2),
                                                speeds="fast"))


def test_speeds_and_memory_limit_shape_the_cut():
    model = models.mlp()
    g = G.from_model(model)
    resolved = run_ranks(1, lambda comm: costs.resolve(g, model, comm, "params", Layout(num_stages=2), speeds=[3.0, 1.0]))[0]
    from hyparflow.engine.partition import partition

    fast_first = partition(g, 2, resolved).counts
    even = partition(g, 2, costs.resolve(g, model, None, "params", Layout(num_stages=2))).counts
    assert fast_first[0] > even[0]
    with pytest.raises(ValueError, match="memory limit|no cut fits"):
        run_ranks(2, lambda comm: hf.fit(models.mlp(), *models.mlp_data(32), num_stages=2,
                                         balance="memory", memory_limit=100, comm=comm, verbose=0))


def test_plan_file_round_trip(tmp_path):
    x, y = models.mlp_data()
    model = models.mlp()
    g = G.from_model(model)
    path = tmp_path / "plan.json"
    P.write(str(path), g, Layout(num_stages=2, num_replicas=2, num_microbatches=2,
                                 balance=(2, 3)), predicted={"step_s": 0.01})
    data = json.loads(path.read_text())
    assert [e["name"] for e in data["layers"] if e["stage"] == 0] == [n.name for n in g.nodes[:2]]
    start = model.get_weights()

    def body(comm):
        m = models.mlp()
        m.set_weights(start)
        hf.fit(m, x, y, batch_size=16, epochs=1, shuffle=False, verbose=0, plan=str(path), comm=comm)
        return m.get_weights()

    planned = run_ranks(4, body, timeout=300)
    explicit = train_ranks(models.mlp, x, y, num_stages=2, num_replicas=2, num_microbatches=2,
                           weights=start, batch_size=16, epochs=1, shuffle=False, balance=[2, 3],
                           schedule="1f1b")
    assert max_diff(planned[0], explicit[0][0]) == 0.0
    bad = dict(data, layers=[dict(data["layers"][0], name="nope")] + data["layers"][1:])
    path.write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="not this model's"):
        run_ranks(4, body, timeout=300)
