"""Replicas that step on their own (replica_sync=hf.LocalSGD / hf.LeaderSGD), in one
process: LocalSGD(every=1) against plain Keras, the LSGD update rule against a NumPy
transcription of the paper's equations, leaders agreed on every rank, and a resumed
checkpoint going on from each replica's own weights and optimizer state."""

import keras
import numpy as np
import pytest

import hyparflow as hf
import models
from conftest import max_diff, reference, train_ranks
from hyparflow.engine.local import run_ranks

pytestmark = pytest.mark.timeout(300)


# -- LocalSGD(every=1) is model.fit ------------------------------------------------

@pytest.mark.parametrize("s,r,m,weighted,extra", [
    (1, 2, 1, False, {}),
    (2, 2, 2, True, {}),
    # Split layers (each tensor rank averages its parts) and model chunks.
    (1, 2, 1, False, {"num_tensor": 2, "tensor_layers": ["hidden_1", "hidden_2"]}),
    (2, 2, 2, False, {"schedule": "interleaved", "num_chunks": 2}),
])
def test_local_sgd_every_step_trains_as_model_fit(s, r, m, weighted, extra):
    """Averaging after every step of plain SGD (momentum too: its step is linear in the
    gradient) is the allreduce step: the weights of model.fit, to round-off."""
    x, y = models.mlp_data(100)  # the last batch (4 samples) is short
    sw = np.linspace(0.5, 2.0, len(x)).astype("float32") if weighted else None

    def build():
        model = models.mlp(keras.optimizers.SGD(0.05, momentum=0.9))
        if weighted:  # a mean over the batch's weights: its normaliser spans the replicas
            model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                          loss=keras.losses.SparseCategoricalCrossentropy(
                              from_logits=True, reduction="mean_with_sample_weight"))
        return model

    start, expected, _ = reference(build, x, y, epochs=2, batch_size=16, sample_weight=sw)
    results = train_ranks(build, x, y, num_stages=s, num_replicas=r, num_microbatches=m,
                          weights=start, batch_size=16, epochs=2, shuffle=False,
                          sample_weight=sw, replica_sync=hf.LocalSGD(every=1), **extra)
    for w, _ in results:
        assert max_diff(w, expected) <= 1e-5


# -- the LSGD update rule, transcribed -----------------------------------------------

def tiny(lr=0.1):
    keras.utils.set_random_seed(7)
    inp = keras.Input((6,))
    h = keras.layers.Dense(8, activation="tanh", name="hidden")(inp)
    out = keras.layers.Dense(2, name="out")(h)
    model = keras.Model(inp, out)
    model.compile(optimizer=keras.optimizers.SGD(lr), loss="mse")
    return model


def tiny_data(n=64):
    rng = np.random.default_rng(3)
    x = rng.normal(size=(n, 6)).astype("float32")
    y = np.stack([np.sin(x[:, 0] + x[:, 1]), x[:, 2] * x[:, 3]], axis=1).astype("float32")
    return x, y


def _loss_and_grad(w, x, y):
    """MSE (mean over outputs, then over samples, as Keras) of the 6-8-2 tanh net and
    its gradient, in float64."""
    W1, b1, W2, b2 = w
    h = np.tanh(x @ W1 + b1)
    p = h @ W2 + b2
    n, o = p.shape
    d = 2.0 * (p - y) / (n * o)
    dh = (d @ W2.T) * (1.0 - h ** 2)
    return np.mean(np.mean((p - y) ** 2, axis=1)), [x.T @ dh, dh.sum(0), h.T @ d, d.sum(0)]


def transcribe(w0, x, y, *, R, batch, epochs, lr, method, groups):
    """The replicas' weights after training, in the paper's terms: each worker r takes
    x_r <- x_r - lr g_r on its slice of every batch; LSGD (the authors' code): every
    `local_every` steps the group's leader l (lowest loss of the step) stays and each
    other worker moves x_r <- (1 - c) x_r + c x_l, then every `global_every` steps the
    same with the global leader; LocalSGD: x_r <- mean of the x_q every `every` steps.
    Returns the model the run ends with (the last step's global leader, or the mean)
    and the leaders chosen."""
    x64, y64 = x.astype(np.float64), y.astype(np.float64)
    reps = [[np.array(a, np.float64) for a in w0] for _ in range(R)]
    step, chosen, losses = 0, [], None
    for _ in range(epochs):
        for begin in range(0, len(x), batch):
            slices = np.array_split(np.arange(begin, min(begin + batch, len(x))), R)
            results = [_loss_and_grad(reps[q], x64[sl], y64[sl]) for q, sl in enumerate(slices)]
            losses = [loss for loss, _ in results]
            reps = [[a - lr * g for a, g in zip(reps[q], grads)]
                    for q, (_, grads) in enumerate(results)]
            step += 1
            if isinstance(method, hf.LocalSGD):
                if step % method.every == 0:
                    mean = [sum(reps[q][k] for q in range(R)) / R for k in range(len(w0))]
                    reps = [[a.copy() for a in mean] for _ in range(R)]
                continue
            pulls = []
            if method.local_every and step % method.local_every == 0:
                pulls += [("local", [q for q in range(R) if groups[q] == g]) for g in sorted(set(groups))]
            if method.global_every and step % method.global_every == 0:
                pulls.append(("global", list(range(R))))
            for scope, members in pulls:
                leader = min(members, key=lambda q: (losses[q], q))
                chosen.append((step, scope, leader))
                for q in members:
                    if q != leader:
                        reps[q] = [(1 - method.pull) * a + method.pull * b
                                   for a, b in zip(reps[q], reps[leader])]
    if isinstance(method, hf.LocalSGD):
        return [sum(reps[q][k] for q in range(R)) / R for k in range(len(w0))], chosen
    final = min(range(R), key=lambda q: (losses[q], q))
    return reps[final], chosen


CASES = [
    # (S, R, M, method, groups): four replicas in two groups (two leaders), and a
    # pipeline of two stages whose replicas form one group.
    (1, 4, 1, hf.LeaderSGD(pull=0.3, local_every=2, global_every=4, groups=2), [0, 0, 1, 1]),
    (2, 2, 2, hf.LeaderSGD(pull=0.3, local_every=2, global_every=4), [0, 0]),
    (1, 2, 1, hf.LocalSGD(every=3), [0, 0]),
]


@pytest.mark.parametrize("s,r,m,method,groups", CASES)
def test_update_rule_matches_the_papers_equations(s, r, m, method, groups):
    x, y = tiny_data()
    w0 = tiny().get_weights()
    expected, chosen = transcribe(w0, x, y, R=r, batch=16, epochs=3, lr=0.1, method=method,
                                  groups=groups)

    def body(comm):
        model = tiny()
        model.set_weights(w0)  # the threads build at once: Keras's global seed is shared
        history = hf.fit(model, x, y, batch_size=16, epochs=3, shuffle=False, verbose=0,
                         num_stages=s, num_replicas=r, num_microbatches=m, comm=comm,
                         replica_sync=method)
        return model.get_weights(), history.replicas

    results = run_ranks(s * r, body, timeout=300)
    for weights, _ in results:
        assert max_diff(weights, expected) <= 2e-6, max_diff(weights, expected)
    # Every rank chose the same leaders from the same losses, and they are the
    # transcription's (lowest loss of the step in the group, ties to the lower replica).
    summaries = [dict(summary, received_bytes=None) for _, summary in results]
    assert all(summary == summaries[0] for summary in summaries[1:])
    assert summaries[0]["groups"] == groups
    assert [(step, scope, leader) for step, scope, _, leader, _ in summaries[0]["leaders"]] \
        == chosen
    for step, scope, group, leader, losses in summaries[0]["leaders"]:
        members = [q for q in range(r) if scope == "global" or groups[q] == group]
        assert leader == min(members, key=lambda q: (losses[q], q))


# -- checkpoints ---------------------------------------------------------------------

def test_resume_goes_on_from_each_replicas_own_weights(tmp_path):
    """A run stopped after an epoch and resumed ends with the weights of one that went
    straight through (Adam: each replica's own moments come back too); the
    checkpoint's main files hold the global leader's model, which the first run
    returned."""
    x, y = models.mlp_data(64)
    method = hf.LeaderSGD(pull=0.5, local_every=1, global_every=3)
    w0 = models.mlp("adam").get_weights()

    def run(epochs, **kwargs):
        def body(comm):
            model = models.mlp("adam")
            model.set_weights(w0)  # the threads build at once: Keras's global seed is shared
            history = hf.fit(model, x, y, batch_size=16, epochs=epochs, shuffle=False,
                             verbose=0, num_stages=2, num_replicas=2, comm=comm,
                             replica_sync=method, **kwargs)
            return model.get_weights(), history.replicas

        return run_ranks(4, body, timeout=300)

    from hyparflow.engine import checkpoint

    straight = run(2)
    first = run(1, checkpoint_dir=str(tmp_path))
    model = models.mlp("adam")
    manifest = checkpoint.restore_model(model, checkpoint.latest_valid(str(tmp_path))[0],
                                        optimizer=False)
    assert manifest["replicas"]["num_replicas"] == 2
    assert max_diff(model.get_weights(), first[0][0]) == 0.0
    resumed = run(2, checkpoint_dir=str(tmp_path), resume=True)
    assert max_diff(resumed[0][0], straight[0][0]) <= 1e-6
    assert max_diff(first[0][0], straight[0][0]) > 1e-3  # the second epoch did something


def test_tied_copies_stay_identical_within_each_replica():
    """A weight tied across stages (GPT's embedding, on the first and the last stage) is
    summed over its stages within each replica, never across replicas: the two copies
    of a replica agree after every step, and the replicas differ until they average."""
    import test_tied

    x, y = test_tied.data()
    x, y = x[:64], y[:64]
    start = test_tied.build().get_weights()
    copies = [test_tied.Copies() for _ in range(4)]

    def body(comm):
        model = test_tied.build()
        model.set_weights(start)
        hf.fit(model, x, y, batch_size=32, epochs=1, shuffle=False, verbose=0, num_stages=2,
               num_replicas=2, num_microbatches=2, callbacks=[copies[comm.rank]], comm=comm,
               replica_sync=hf.LocalSGD(every=2))

    run_ranks(4, body, timeout=300)
    # Ranks: (stage 0, replica 0), (stage 1, replica 0), (stage 0, replica 1), (stage 1, replica 1).
    for first, last in ((0, 1), (2, 3)):
        assert len(copies[first].seen) == 2
        for a, b in zip(copies[first].seen, copies[last].seen):
            np.testing.assert_array_equal(a, b)
    assert max_diff([copies[0].seen[0]], [copies[2].seen[0]]) > 1e-6  # on their own
    np.testing.assert_array_equal(copies[0].seen[1], copies[2].seen[1])  # averaged


def test_bad_methods_are_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"pull=1\.5"):
        hf.LeaderSGD(pull=1.5)
    with pytest.raises(ValueError, match="both None"):
        hf.LeaderSGD(local_every=None, global_every=None)
    with pytest.raises(ValueError, match="every=0"):
        hf.LocalSGD(every=0)
    x, y = models.mlp_data(32)

    def body(comm):
        hf.fit(models.mlp(), x, y, batch_size=16, num_replicas=2, comm=comm, verbose=0,
               replica_sync=hf.LeaderSGD(groups=3))

    with pytest.raises(ValueError, match=r"groups=3\) must divide the replicas"):
        run_ranks(2, body, timeout=120)
    with pytest.raises(ValueError, match="Unknown replica_sync 'local'"):
        run_ranks(1, lambda comm: hf.fit(models.mlp(), x, y, comm=comm, verbose=0,
                                         replica_sync="local"), timeout=120)


def test_pulls_average_batchnorm_statistics():
    """At every pull the group's BatchNorm statistics become their mean (the same bits
    on both replicas) while the weights only move toward the leader's."""
    keras.utils.set_random_seed(3)
    inp = keras.Input((6,))
    h = keras.layers.Dense(8, name="first")(inp)
    h = keras.layers.BatchNormalization(name="norm")(h)
    model = keras.Model(inp, keras.layers.Dense(2)(h))
    config = model.to_json()
    w0 = model.get_weights()
    x, y = tiny_data(32)

    class Seen(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.stats, self.kernels = [], []

        def on_train_batch_end(self, batch, logs=None):
            self.stats.append(self.model.get_layer("norm").moving_mean.numpy().copy())
            self.kernels.append(self.model.get_layer("first").kernel.numpy().copy())

    seen = [Seen(), Seen()]

    def body(comm):
        m = keras.models.model_from_json(config)
        m.set_weights(w0)
        m.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        hf.fit(m, x, y, batch_size=16, epochs=1, shuffle=False, verbose=0, num_replicas=2,
               comm=comm, callbacks=[seen[comm.rank]],
               replica_sync=hf.LeaderSGD(pull=0.5, local_every=1, global_every=None))

    run_ranks(2, body, timeout=120)
    for step in range(2):
        np.testing.assert_array_equal(seen[0].stats[step], seen[1].stats[step])
        assert max_diff([seen[0].kernels[step]], [seen[1].kernels[step]]) > 1e-6


# -- the benchmark's CIFAR-shaped workload ---------------------------------------------

def test_benchmark_resnet_workload_builds():
    """benchmarks/replicas.py --workload resnet: CIFAR-shaped data and a ResNet-8 that takes
    it; a class is the same pattern whatever the seed (the held-out set is the same task)."""
    import importlib.util
    import os
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                        "benchmarks", "replicas.py")
    spec = importlib.util.spec_from_file_location("replicas_benchmark", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)

    label, build, (x, y, x_test, y_test) = bench.workload("resnet", samples=32)
    assert x.shape == (32, 32, 32, 3) and x.dtype == np.float32 and y.dtype == np.int32
    assert x_test.shape == (1000, 32, 32, 3) and set(np.unique(y_test)) == set(range(10))
    model = build()
    assert model.count_params() == 78_330
    assert model.predict(x[:2], verbose=0).shape == (2, 10)

    # Without noise and shifts, images of one class from two seeds are one pattern (up to
    # scale and tint); images of two classes are not.
    a, ya = bench.cifar_like(200, seed=1, noise=0.0, shift=0)
    b, yb = bench.cifar_like(200, seed=2, noise=0.0, shift=0)
    flat = lambda v: (v - v.mean(axis=(0, 1))).ravel()  # noqa: E731 (the tint away)
    same = [np.corrcoef(flat(a[i]), flat(b[np.flatnonzero(yb == ya[i])[0]]))[0, 1]
            for i in range(20)]
    other = [np.corrcoef(flat(a[i]), flat(b[np.flatnonzero(yb != ya[i])[0]]))[0, 1]
             for i in range(20)]
    assert min(same) > 0.99 and max(np.abs(other)) < 0.8, (same, other)
