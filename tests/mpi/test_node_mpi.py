"""Threads per rank under a real launcher (hyparflow/_env.py, engine/node.py); run under
mpiexec by tests/cluster/test_mpi.py:

    mpiexec -n 2 python -m pytest --with-mpi tests/mpi/test_node_mpi.py
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import hyparflow as hf  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402
from mpi4py import MPI  # noqa: E402

from hyparflow import _env, settings  # noqa: E402
from hyparflow.engine import comm as _comm, node  # noqa: E402

WORLD = MPI.COMM_WORLD


@pytest.mark.mpi(min_size=2)
def test_threads_are_the_nodes_cores_shared_by_its_ranks():
    local = WORLD.Split_type(MPI.COMM_TYPE_SHARED)
    on_node = local.Get_size()
    local.Free()
    assert _env.local_ranks() == on_node   # from the launcher's environment
    if settings.threads() is None:
        # TensorFlow started (at import) with the count MPI's split agrees with.
        expected = _env.derive_threads(len(_env.my_cores()), os.cpu_count(), on_node,
                                       _env.cpu_quota(), _env.slurm_cpus())
        if len(_env.my_cores()) >= os.cpu_count():   # not pinned yet by an earlier fit
            assert _env.configured_threads() == expected
    assert tf.config.threading.get_intra_op_parallelism_threads() == _env.configured_threads()
    comm = _comm.MPICommunicator(WORLD)
    try:
        count, line = node.settle(comm)
    finally:
        comm.free()
    assert count == on_node
    assert f"{on_node} on this node x {_env.configured_threads()} threads per rank" in line
    # Ranks were pinned to disjoint cores when they fit, else left to the OS.
    everyone = WORLD.allgather(_env.my_cores())
    if node.pin_slices(list(range(os.cpu_count())), on_node, _env.configured_threads()) \
            and settings.pin() is not False:
        assert not set(everyone[0]) & set(everyone[1]), everyone


@pytest.mark.mpi(min_size=2)
def test_fit_refuses_threads_tensorflow_did_not_start_with():
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss="mse")
    x, y = np.ones((8, 4), "float32"), np.ones((8, 2), "float32")
    wrong = _env.configured_threads() + 1
    with pytest.raises(ValueError, match=f"threads_per_rank={wrong}.*HYPARFLOW_THREADS_PER_RANK"):
        hf.fit(model, x, y, batch_size=4, verbose=0, threads_per_rank=wrong)
    # The right count trains.
    hf.fit(model, x, y, batch_size=4, verbose=0, threads_per_rank=_env.configured_threads())
