"""This rank's node at the start of a run: its ranks (MPI's shared-memory split), cores
for ranks the launcher did not bind, and the line that says how many threads each has.

TensorFlow's thread pools are fixed when it starts, at `import hyparflow`, before MPI
may be up: `_env.threads_per_rank` derives the count from the launcher's environment
then. Here, with MPI up, the count is checked against the ranks MPI finds on the node,
and ranks whose cores are all the same (no binding) are pinned to disjoint ones, each
to as many as it has threads, so two ranks' threads do not take turns on one core
while another idles."""

from __future__ import annotations

import os
from typing import Any, List, Optional, Tuple

from .. import _env, settings

__all__ = ["settle", "pin_slices"]


def pin_slices(cores: List[int], local: int, threads: int) -> Optional[List[List[int]]]:
    """Disjoint cores for each of `local` unbound ranks sharing `cores`, `threads` each
    (pure); None when they do not fit (the operating system places them then)."""
    if local < 2 or threads * local > len(cores):
        return None
    return [cores[i * threads:(i + 1) * threads] for i in range(local)]


def _pin(cores: List[int]) -> None:
    """Every thread of this process (TensorFlow's pools started already) onto `cores`."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except OSError:   # a thread that ended meanwhile
            pass


def settle(comm: Any, asked: Optional[int] = None) -> Tuple[int, str]:
    """Collective over `comm` (a hyparflow communicator): (the ranks on this node, the
    line describing threads per rank). `asked`: fit's `threads_per_rank`, which must
    be what TensorFlow started with."""
    threads = _env.configured_threads()
    local, line = _settle(comm, threads)
    if asked is not None and threads is not None and asked != threads:
        raise ValueError(
            f"threads_per_rank={asked}, but TensorFlow started with {threads} threads per rank "
            "when hyparflow was imported, and cannot change them. Set "
            f"HYPARFLOW_THREADS_PER_RANK={asked} (or `hyparflow run --threads-per-rank "
            f"{asked}`) so that TensorFlow starts with them.")
    return local, line


def _settle(comm: Any, threads: Optional[int]) -> Tuple[int, str]:
    shown = threads if threads is not None else "TensorFlow's default"
    mpi = getattr(comm, "comm", None)
    if mpi is None or not hasattr(mpi, "Split_type"):   # ranks as threads of one process
        return comm.size, (f"hyparflow: {comm.size} ranks as threads of one process, "
                           f"{shown} threads each")
    from mpi4py import MPI

    from .comm import MPICommunicator

    node = MPICommunicator(mpi.Split_type(MPI.COMM_TYPE_SHARED, comm.rank), dup=False)
    try:
        cores = _env.my_cores()
        everyone = node.allgather_obj(cores)
        local = node.size
    finally:
        node.free()
    source = _env.threads_source()
    if settings.threads() is None and "//" in source:
        source = source.split("//")[0] + f"// {local} ranks on this node"
    line = f"hyparflow: {comm.size} ranks, {local} on this node x {shown} threads per rank ({source})"
    unbound = all(c == everyone[0] for c in everyone)
    if unbound and threads is not None and settings.pin() is not False:
        slices = pin_slices(cores, local, threads)
        if slices is not None:
            _pin(slices[node.rank])
            line += "; pinned to disjoint cores"
    node_cores = os.cpu_count() or 1
    if settings.threads() is None and threads is not None and unbound:
        derived = _env.derive_threads(len(cores), node_cores, local, _env.cpu_quota(),
                                      _env.slurm_cpus())
        if derived != threads:
            line += (f"; the node's {local} ranks share {len(cores)} cores: "
                     f"HYPARFLOW_THREADS_PER_RANK={derived} would fit them (the launcher "
                     "did not say how many ranks share the node)")
    return local, line


def rates(size: int = 256, nbytes: int = 1 << 25) -> Tuple[float, float]:
    """This rank's multiply-adds per second in a `size`-square matrix product (with
    the threads TensorFlow started with) and bytes per second of a numpy copy of
    `nbytes`, each the best of three after a warm-up: tens of milliseconds, for the
    quick cost model (`nodecost.Rates`)."""
    import time

    import numpy as np
    import tensorflow as tf

    a = tf.random.normal((size, size))
    src = np.ones(nbytes // 4, "float32")
    dst = np.empty_like(src)

    def best(call: Any) -> float:
        call()
        times = []
        for _ in range(3):
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
        return max(min(times), 1e-9)

    product = best(lambda: tf.linalg.matmul(a, a).numpy())
    copy = best(lambda: np.copyto(dst, src))
    return size ** 3 / product, nbytes / copy
