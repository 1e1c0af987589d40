"""The in-node gradient sum: a shared-memory window (engine.shm) next to MPI's allreduce.

    mpiexec -n 2 python benchmarks/shm_sum.py
    mpiexec -n 2 python benchmarks/shm_sum.py --sizes 0.25 1 8 32 --repeats 20
    mpiexec -n 4 python benchmarks/shm_sum.py --ways window       # one way only

For float32 buffers of `--sizes` MB, the median seconds of `--repeats` in-place sums
(the slowest rank's), each way in the same run: MPI_Allreduce (MPICH's own, blocking),
hyparflow's messages (its non-blocking Iallreduce below 1 MB, its ring of messages
from 1 MB: across nodes, a ring of every rank) and hyparflow's shared window (across
nodes, hierarchical: the node's sum, then slices between nodes). The window is used even
with two ranks per node (HYPARFLOW_SHARED_SUMS=1, unless set otherwise), as this compares
ways. Rank 0 prints the table. benchmarks/hosts_sum.py runs this across emulated hosts.
"""

import argparse
import json
import os
import statistics
import time

import numpy as np
from mpi4py import MPI

os.environ.setdefault("HYPARFLOW_SHARED_SUMS", "1")
from hyparflow.engine import shm  # noqa: E402
from hyparflow.engine.comm import MPICommunicator  # noqa: E402

WAYS = {"mpi": "MPI_Allreduce", "messages": "hyparflow messages",
        "window": "hyparflow shared window"}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=float, nargs="*", default=[0.25, 1, 8, 32])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--ways", nargs="*", choices=sorted(WAYS), default=list(WAYS))
    args = parser.parse_args()
    world = MPI.COMM_WORLD
    shared = MPICommunicator(world)
    messages = MPICommunicator(world)
    messages.shareable = False
    rng = np.random.default_rng(world.Get_rank())
    rows = []
    for mb in args.sizes:
        n = int(mb * 2 ** 20 / 4)
        grads = rng.normal(size=n).astype(np.float32)
        ways = {
            "mpi": lambda buf: world.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM),
            "messages": messages.allreduce,
            "window": shared.allreduce,
        }
        for way in args.ways:
            name, total = WAYS[way], ways[way]
            times = []
            for _ in range(args.repeats + 1):
                buf = grads.copy()
                world.Barrier()
                t = time.perf_counter()
                total(buf)
                times.append(time.perf_counter() - t)
            slowest = world.allreduce(statistics.median(times[1:]), op=MPI.MAX)
            rows.append((mb, name, slowest))
    if world.Get_rank() == 0:
        print(f"{world.Get_size()} ranks; shared sums: {shared.sums} "
              f"({shm.used()} pieces on rank 0)")
        print(f"{'MB':>6}  {'sum':<24}  {'median ms':>9}  {'GB/s':>6}")
        for mb, name, s in rows:
            print(f"{mb:>6g}  {name:<24}  {s * 1e3:>9.2f}  {mb / 1024 / s:>6.2f}")
        print("RESULT " + json.dumps({"how": shared.sums, "rows": rows}))
    shared.free()
    messages.free()


if __name__ == "__main__":
    main()
