"""The heartbeat alone (no TensorFlow), for tests/cluster/test_mpi.py's neighbour test.

    mpiexec -n N python heartbeat_script.py DIR

Ranks 2k and 2k+1 pretend to share host `node<k>`; each rank writes DIR/pid-<rank> and
DIR/peers-<rank> (the ranks it beats to) and waits until its heartbeat ends it.
"""

import os
import sys
import time
import types

# hyparflow.heartbeat without hyparflow/__init__ (which starts TensorFlow).
HERE = os.path.dirname(os.path.abspath(__file__))
package = types.ModuleType("hyparflow")
package.__path__ = [os.path.join(HERE, "..", "..", "hyparflow")]
sys.modules["hyparflow"] = package

from mpi4py import MPI  # noqa: E402

from hyparflow.cluster import heartbeat  # noqa: E402

out = sys.argv[1]
comm = MPI.COMM_WORLD
beat = heartbeat.Heartbeat(comm, [f"node{r // 2}" for r in range(comm.size)])
with open(os.path.join(out, f"peers-{comm.rank}"), "w") as f:
    f.write(" ".join(map(str, beat.peers)))
with open(os.path.join(out, f"pid-{comm.rank}"), "w") as f:
    f.write(str(os.getpid()))
time.sleep(120)
print(f"rank {comm.rank}: still running after 120 s", flush=True)
