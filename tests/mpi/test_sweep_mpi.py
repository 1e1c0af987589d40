"""hf.sweep over real MPI messages: the members shared out over groups of ranks, and each
member data-parallel over a group's replicas; every rank returns every member as its own
model.fit trains it. Run under mpiexec by tests/cluster/test_mpi.py (n = 2 and 4)."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import hyparflow as hf  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from mpi4py import MPI  # noqa: E402

import sweep_models as sm  # noqa: E402

SIZE = MPI.COMM_WORLD.Get_size()
CONFIGS = sm.MLP_CONFIGS[:4]
_ALONE = []


def alone():
    """Each config's own model.fit on this rank (shuffled: the orders its build leaves)."""
    if not _ALONE:
        x, y = sm.mlp_data()
        for config in CONFIGS:
            model = sm.mlp(dict(config))
            history = model.fit(x, y, batch_size=16, epochs=2, verbose=0)
            _ALONE.append((model.get_weights(), history.history))
    return _ALONE


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("replicas", [1, 2])
def test_sweep_over_ranks(replicas):
    x, y = sm.mlp_data()
    models, histories = hf.sweep(sm.mlp, CONFIGS, x, y, batch_size=16, epochs=2, verbose=0,
                                 num_replicas=replicas)
    for p, (model, history) in enumerate(zip(models, histories)):
        weights, logs = alone()[p]
        worst = max(float(np.abs(a - b).max()) for a, b in zip(model.get_weights(), weights))
        if hf.is_main():
            print(f"\nsweep on {SIZE} ranks, {replicas} replica(s) per group: member {p} max "
                  f"weight difference {worst:.3g}")
        assert worst <= 1e-5, (p, worst)
        for key, values in logs.items():
            np.testing.assert_allclose(history.history[key], values, rtol=1e-5, atol=1e-6)
