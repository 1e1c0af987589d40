"""The loss contract over real MPI (issue 38): a masked per-token loss whose microbatches
and replicas hold very different numbers of valid tokens, a position table under Adam,
and a `compute_loss` override, against `model.fit` on one process.

    mpiexec -n 2 python -m pytest --with-mpi tests/mpi/test_loss_mpi.py
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import hyparflow as hf  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from mpi4py import MPI  # noqa: E402

from test_loss_contract import (LossModel, dense, dense_data, patches_model, tagger,  # noqa: E402
                                uneven_tokens)

SIZE = MPI.COMM_WORLD.Get_size()


def layouts():
    return {2: [(2, 1, 2), (1, 2, 2)], 4: [(2, 2, 2), (1, 4, 1)]}.get(SIZE, [(1, SIZE, 1)])


def masked():
    return tagger(metrics=["sparse_categorical_accuracy"])


def positions_data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(32, 6, 5)).astype("float32"), rng.integers(0, 3, 32)


CASES = {
    "masked_tokens": (masked, uneven_tokens, 1e-6),
    "position_table_adam": (lambda: patches_model, positions_data, 2e-7),
    "compute_loss": (lambda: dense(LossModel), dense_data, 1e-6),
}


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("case", sorted(CASES))
def test_loss_as_one_process(case):
    make, data, tol = CASES[case]
    build = make()
    x, y = data()
    reference = build()
    start = reference.get_weights()
    expected_history = reference.fit(x, y, batch_size=16, epochs=2, shuffle=False,
                                     verbose=0).history
    expected = reference.get_weights()
    for s, r, m in layouts():
        model = build()
        model.set_weights(start)
        history = hf.fit(model, x, y, batch_size=16, epochs=2, num_stages=s, num_replicas=r,
                         num_microbatches=m, shuffle=False, verbose=0)
        diff = max(float(np.abs(a - b).max()) for a, b in zip(model.get_weights(), expected))
        if hf.is_main():
            print(f"\n{case} (S,R,M)={(s, r, m)} max weight difference {diff:.3g}")
        assert diff <= tol, f"{case} (S,R,M)={(s, r, m)}: {diff}"
        for key, values in expected_history.items():
            np.testing.assert_allclose(history.history[key], values, rtol=2e-6, atol=1e-7)
