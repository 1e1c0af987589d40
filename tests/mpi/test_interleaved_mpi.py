"""Interleaved 1F1B over real MPI messages; run under mpiexec by tests/cluster/test_mpi.py:

    mpiexec -n 2 python -m pytest --with-mpi tests/mpi/test_interleaved_mpi.py
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import hyparflow as hf  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from mpi4py import MPI  # noqa: E402

SIZE = MPI.COMM_WORLD.Get_size()


def max_diff(a, b):
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b))


@pytest.mark.mpi(min_size=2)
def test_tied_embedding_self_messages_and_checkpoint(tmp_path_factory):
    """GPT with tied embeddings, S=2 x v=3: 6 virtual stages, one skip connection
    from virtual stage 3 to 5 (rank 1 to itself), the embedding on rank 0 (chunk 0)
    and rank 1 (chunk 2). Epoch 1 interleaved writes a checkpoint; epoch 2 resumes it
    data parallel; both against plain model.fit, with Adam."""
    import test_tied

    if SIZE != 2:
        pytest.skip("2 ranks")
    x, y = test_tied.data()
    x, y = x[:64], y[:64]
    reference = test_tied.build()
    start = reference.get_weights()
    reference.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    after_one = reference.get_weights()
    reference.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    directory = MPI.COMM_WORLD.bcast(str(tmp_path_factory.mktemp("ckpt")), 0)
    model = test_tied.build()
    model.set_weights(start)
    hf.fit(model, x, y, batch_size=32, epochs=1, num_stages=2, num_microbatches=2,
           schedule="interleaved", num_chunks=3, shuffle=False, verbose=0,
           checkpoint_dir=directory)
    assert max_diff(model.get_weights(), after_one) <= 1e-4
    model = test_tied.build()
    hf.fit(model, x, y, batch_size=32, epochs=2, num_stages=1, num_replicas=2, shuffle=False,
           verbose=0, checkpoint_dir=directory, resume=True)
    assert max_diff(model.get_weights(), reference.get_weights()) <= 1e-4


@pytest.mark.mpi(min_size=4)
def test_replicas_sum_every_chunk():
    """S=2 x R=2 x v=2, Adam: every chunk's gradients allreduced over the replicas."""
    from test_zero_bubble import BATCH, build, data, fit_reference

    if SIZE != 4:
        pytest.skip("4 ranks")
    x, y = data()
    start, expected = fit_reference("adam", 4, bn=False)
    model = build("adam", bn=False)
    model.set_weights(start)
    hf.fit(model, x, y, batch_size=BATCH, epochs=2, num_stages=2, num_replicas=2,
           num_microbatches=2, schedule="interleaved", num_chunks=2, shuffle=False, verbose=0)
    assert max_diff(model.get_weights(), expected) <= 1e-4
