"""The replicas' gradient sum in 16 bits: which exchange is faster (engine.wire.Sum).

    mpiexec -n 2 python benchmarks/wire_sum.py
    mpiexec -n 4 python benchmarks/wire_sum.py --sizes 1 4 16

For buffers of `--sizes` MB of float32 gradients: the float32 sum hyparflow takes
without a wire (MPI's allreduce, the ring at 1 MB and up), and the bfloat16 sum of
`engine.wire.Sum` both ways: "gather" (every rank's whole 16-bit buffer to every
other rank, added in float32 on each) and "scatter" (16-bit chunks to their owners,
added in float32, the 16-bit sums back). Median seconds of `--repeats` sums, and the
bytes a rank sends (rank 0 prints).
"""

import argparse
import statistics
import time

import numpy as np
from mpi4py import MPI

from hyparflow.engine import wire
from hyparflow.engine.comm import MPICommunicator, wait_all


class _Counter:
    sent = 0


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=float, nargs="*", default=[0.25, 1, 4, 16])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    comm = MPICommunicator(MPI.COMM_WORLD)
    bf16 = wire.numpy_dtype("bfloat16")
    rng = np.random.default_rng(comm.rank)
    rows = []
    for mb in args.sizes:
        n = int(mb * 2 ** 20 / 4)
        grads = rng.normal(size=n).astype(np.float32)
        ways = {"float32 allreduce": lambda buf, c: comm.iallreduce(buf)}
        for mode in ("gather", "scatter"):
            ways[f"bfloat16 {mode}"] = (lambda buf, c, mode=mode: wire.Sum(
                comm, buf, buf.size, bf16, 1.0, wire.SUM_TAG, c, mode))
        for name, start in ways.items():
            times, counter = [], _Counter()
            for k in range(args.repeats + 1):
                buf = grads.copy()
                comm.barrier()
                t = time.perf_counter()
                wait_all([start(buf, counter)], 60.0, name)
                times.append(time.perf_counter() - t)
            sent = counter.sent // (args.repeats + 1) if counter.sent else \
                int(grads.nbytes * 2 * (comm.size - 1) / comm.size)
            slowest = comm.comm.allreduce(statistics.median(times[1:]), op=MPI.MAX)
            rows.append((mb, name, slowest, sent))
    if comm.rank == 0:
        print(f"R = {comm.size}")
        print(f"{'MB':>6}  {'sum':<18}  {'median s':>9}  {'bytes sent/rank':>15}")
        for mb, name, s, sent in rows:
            print(f"{mb:>6g}  {name:<18}  {s:>9.5f}  {sent:>15,}")


if __name__ == "__main__":
    main()
