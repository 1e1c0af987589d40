"""Every graph shape in the zoo trains hybrid-parallel to plain Keras's weights."""

import pytest

import zoo
from conftest import max_diff, train_ranks
from hyparflow import graph as G
from hyparflow.engine.partition import partition

CONFIGS = [(3, 1, 3), (4, 1, 2), (2, 2, 2)]


@pytest.mark.parametrize("name", sorted(zoo.ZOO))
def test_zoo_model_matches_one_process_keras(name):
    build = lambda: zoo.ZOO[name]()[0]  # noqa: E731
    model, (x, y) = zoo.ZOO[name]()
    start = model.get_weights()
    model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    expected = model.get_weights()
    nodes = len(G.from_model(model).nodes)
    report = {}
    for s, r, m in CONFIGS:
        if s > nodes:
            continue
        results = train_ranks(build, x, y, num_stages=s, num_replicas=r, num_microbatches=m,
                              weights=start, batch_size=16, epochs=2, shuffle=False)
        report[(s, r, m)] = max(max_diff(w, expected) for w, _ in results)
    print(name, report)
    assert report and max(report.values()) <= 2e-5, report


def test_tied_weights_are_used_on_two_stages():
    model, _ = zoo.tied()
    g = G.from_model(model)
    part = partition(g, 3, balance=[1, 2, 2])
    kernel = model.get_layer("tied").kernel
    assert part.users[id(kernel)] == (0, 2)


def test_tied_copies_stay_identical_after_every_step():
    """The tied layer lives on stages 0 and 2; both copies must take the same step."""
    import keras
    import numpy as np

    from hyparflow.engine.local import run_ranks
    import hyparflow as hf

    model, (x, y) = zoo.tied()
    start = model.get_weights()
    model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    expected = model.get_weights()

    class Record(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.kernels = []

        def on_train_batch_end(self, batch, logs=None):
            self.kernels.append(self.model.get_layer("tied").kernel.numpy().copy())

    def body(comm):
        m, _ = zoo.tied()
        m.set_weights(start)
        rec = Record()
        hf.fit(m, x, y, batch_size=16, epochs=2, shuffle=False, verbose=0, num_stages=3,
               num_microbatches=2, balance=[1, 2, 2], callbacks=[rec], comm=comm)
        return m.get_weights(), rec.kernels

    results = run_ranks(3, body, timeout=120)
    steps0, steps2 = results[0][1], results[2][1]
    assert len(steps0) == len(steps2) == 6
    for a, b in zip(steps0, steps2):
        np.testing.assert_array_equal(a, b)
    assert max_diff(results[0][0], expected) <= 1e-6
