"""The quick cost model of a node's ranks x threads (hyparflow/nodecost.py) and fit's
warning of a layout it predicts slow (hyparflow/loop/slow.py), on rates given here;
under mpiexec with the rates measured: tests/mpi/test_slow_layout_mpi.py."""

import keras

from hyparflow import graph as _graph, nodecost
from hyparflow.layout import resolve
from hyparflow.loop import slow

RATES = nodecost.Rates(madds_per_s=2e10, bytes_per_s=1e10)


def wide():
    """Many weights, little compute per sample: the gradient sums and the optimizer
    step every replica repeats are most of a step."""
    inp = keras.Input((2048,))
    h = keras.layers.Dense(2048)(inp)
    return keras.Model(inp, keras.layers.Dense(2048)(h))


def conv():
    """Few weights, much compute per sample."""
    inp = keras.Input((32, 32, 16))
    h = keras.layers.Conv2D(16, 3, padding="same")(inp)
    h = keras.layers.Conv2D(16, 3, padding="same")(h)
    return keras.Model(inp, keras.layers.Flatten()(h))


def test_the_terms_of_a_step():
    one = nodecost.Shape(1, 2)
    two = nodecost.Shape(2, 1, replicas=2)
    compute = 3 * 1e6 * 10 / (2 * RATES.madds_per_s)
    assert nodecost.step_seconds(one, 1e6, 0.0, 10, RATES) == compute
    sums = 2 * (1 / 2) * 4e6 * nodecost.SUM_PASSES / RATES.bytes_per_s
    assert abs(nodecost.step_seconds(two, 1e6, 4e6, 10, RATES, passes=7)
               - (compute + sums + 7 * 4e6 / RATES.bytes_per_s)) < 1e-12
    # A pipeline of 2 stages idles (S - 1) / (M + S - 1) of its compute.
    pipe = nodecost.Shape(2, 1, stages=2, microbatches=4)
    assert abs(nodecost.step_seconds(pipe, 1e6, 0.0, 10, RATES, passes=0)
               - compute * 5 / 4) < 1e-12
    assert nodecost.shapes(16) == [2, 4, 8, 16] and nodecost.shapes(1) == []


def test_warns_of_a_layout_predicted_slow_naming_both_and_the_command():
    layout = resolve(world_size=2, num_replicas=2)
    text = slow.warning(_graph.from_model(wide()), layout, 8, 2, 2, 2, RATES, 7, "train.py")
    assert text is not None
    assert "2 ranks on the node x 1 thread (S=1 T=1 R=2 M=1)" in text
    assert "1 rank on the node x 2 threads" in text
    assert "hyparflow run -n 1 --threads-per-rank 2 train.py" in text
    assert "HYPARFLOW_LAYOUT_WARNING=0" in text


def test_silent_on_a_layout_predicted_fast():
    layout = resolve(world_size=2, num_replicas=2)
    assert slow.warning(_graph.from_model(conv()), layout, 64, 2, 2, 2, RATES, 7) is None
