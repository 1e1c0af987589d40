"""Trained by `hyparflow run -n 2 --data-workers 2` (tests/cluster/test_data_service_run.py):
each replica's part decoded by the workers `hyparflow run` started, the weights those of
reading in place. Argument: a directory for the records."""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, ".."), os.path.join(HERE, "..", "readers")]

import hyparflow as hf  # noqa: E402
from mpi4py import MPI  # noqa: E402

import records  # noqa: E402
from conftest import max_diff  # noqa: E402
from test_sharded import B, EPOCHS, model, want  # noqa: E402

comm = MPI.COMM_WORLD
if comm.rank == 0:
    os.makedirs(sys.argv[1], exist_ok=True)
    records.write(sys.argv[1], files=4)
comm.Barrier()
paths = sorted(os.path.join(sys.argv[1], f) for f in os.listdir(sys.argv[1]))
start = model().get_weights()
expect = want(records.global_batches(records.replica_batches(paths, B, 2)), start)
trained = model()
trained.set_weights(start)
# No data_service=: HYPARFLOW_DATA_SERVICE, which `hyparflow run` set, names the service.
hf.fit(trained, records.by_files_uncounted(paths), batch_size=B, epochs=EPOCHS, verbose=0,
       num_replicas=2)
diff = max_diff(trained.get_weights(), expect)
print(f"rank {comm.rank}: max weight difference {diff:.2e}", flush=True)
assert diff < 2e-6
