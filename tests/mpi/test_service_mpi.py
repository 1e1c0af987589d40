"""A tf.data service's worker decodes the replicas' parts, over real MPI messages with
production's one inter-op thread: rank 0 starts `hyparflow data-service --dispatcher`
and one `--worker` as processes of their own, stops them with SIGTERM at the end (they
must exit cleanly), and the exact mode's weights are those of reading in place (with
HYPARFLOW_TEST_DATA_SERVICE, the service at that address: another emulated host's,
tests/hosts/test_hosts_emulated.py). Run under mpiexec by tests/cluster/test_mpi.py:

    mpiexec -n 2 python -m pytest --with-mpi tests/mpi/test_service_mpi.py
"""

import os
import signal
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "readers"))

import hyparflow as hf  # noqa: E402
import pytest  # noqa: E402
from mpi4py import MPI  # noqa: E402

from conftest import max_diff  # noqa: E402

SIZE = MPI.COMM_WORLD.Get_size()


@pytest.fixture(scope="module")
def service():
    """The dispatcher's address on every rank; the processes stopped at the end."""
    import records

    comm = MPI.COMM_WORLD
    processes, address = [], None
    given = os.environ.get("HYPARFLOW_TEST_DATA_SERVICE")   # one on another host
    if given:
        yield given
        return
    if comm.rank == 0:
        dispatcher, address = records.data_service("--dispatcher", "--host", "localhost")
        worker, _ = records.data_service("--worker", address, "--host", "localhost")
        processes = [dispatcher, worker]
    address = comm.bcast(address, 0)
    yield address
    comm.Barrier()
    for process in processes[::-1]:
        process.send_signal(signal.SIGTERM)
        out, _ = process.communicate(timeout=60)
        assert process.returncode == 0 and "stopped" in out, (process.returncode, out)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("layout", [(1, SIZE, 1), (2, SIZE // 2, 2)],
                         ids=lambda s: "S{}R{}M{}".format(*s))
def test_a_worker_process_decodes_each_replicas_part_exactly(layout, service,
                                                               tmp_path_factory):
    import records
    from test_sharded import B, EPOCHS, model, want

    stages, replicas, micro = layout
    paths = records.written_once(MPI.COMM_WORLD, tmp_path_factory)
    start = model().get_weights()
    expect = want(records.global_batches(records.replica_batches(paths, B, replicas)), start)
    trained = model()
    trained.set_weights(start)
    hf.fit(trained, records.by_files_uncounted(paths), batch_size=B, epochs=EPOCHS, verbose=0,
           num_stages=stages, num_replicas=replicas, num_microbatches=micro,
           data_service=service)
    diff = max_diff(trained.get_weights(), expect)
    print(f"data service S={stages} R={replicas} M={micro}: max weight difference {diff:.2e}")
    assert diff < 2e-6
