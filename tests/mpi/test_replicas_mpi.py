"""Replicas stepping on their own (hf.LocalSGD, hf.LeaderSGD) over real MPI messages;
run under mpiexec by tests/cluster/test_mpi.py (n = 2 and 4)."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import hyparflow as hf  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from mpi4py import MPI  # noqa: E402

import models  # noqa: E402
import test_replicas  # noqa: E402

SIZE = MPI.COMM_WORLD.Get_size()


def max_diff(a, b):
    return max(float(np.max(np.abs(np.asarray(p) - np.asarray(q)))) for p, q in zip(a, b))


@pytest.mark.mpi(min_size=2)
def test_local_sgd_every_step_is_model_fit():
    x, y = models.mlp_data(96)
    build = lambda: models.mlp(keras.optimizers.SGD(0.05, momentum=0.9))  # noqa: E731
    reference = build()
    start = reference.get_weights()
    reference.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    model = build()
    model.set_weights(start)
    hf.fit(model, x, y, batch_size=16, epochs=2, shuffle=False, verbose=0, num_stages=1,
           num_microbatches=2, replica_sync=hf.LocalSGD(every=1))
    assert max_diff(model.get_weights(), reference.get_weights()) <= 1e-5


@pytest.mark.mpi(min_size=2)
def test_leader_sgd_is_the_papers_update_rule():
    """n=2: two replicas; n=4: two stages x two replicas. Weights as the NumPy
    transcription's, the same leaders on every rank."""
    s = 2 if SIZE % 4 == 0 else 1
    r = SIZE // s
    method = hf.LeaderSGD(pull=0.3, local_every=2, global_every=4)
    x, y = test_replicas.tiny_data()
    w0 = test_replicas.tiny().get_weights()
    expected, chosen = test_replicas.transcribe(w0, x, y, R=r, batch=16, epochs=3, lr=0.1,
                                                method=method, groups=[0] * r)
    model = test_replicas.tiny()
    history = hf.fit(model, x, y, batch_size=16, epochs=3, shuffle=False, verbose=0,
                     num_stages=s, num_microbatches=2, replica_sync=method)
    assert max_diff(model.get_weights(), expected) <= 2e-6
    summary = dict(history.replicas, received_bytes=None)
    everyone = MPI.COMM_WORLD.allgather(summary)
    assert all(other == everyone[0] for other in everyone)
    assert [(step, scope, leader) for step, scope, _, leader, _ in summary["leaders"]] == chosen
