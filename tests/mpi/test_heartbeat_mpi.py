"""The heartbeat's messages never reach a later communicator; run under mpiexec by
tests/test_mpi.py:

    mpiexec -n 2 python -m pytest --with-mpi tests/mpi/test_heartbeat_mpi.py
"""

import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import pytest  # noqa: E402
from mpi4py import MPI  # noqa: E402

from hyparflow.cluster import heartbeat  # noqa: E402
from hyparflow.engine.comm import MPICommunicator  # noqa: E402


@pytest.mark.mpi(min_size=2)
def test_goodbyes_left_unread_match_nothing_later():
    """Ranks stop their heartbeats at different times, so goodbyes (and beats) reach
    a rank that has stopped listening and freed the heartbeat's communicator. MPI
    reuses a freed communicator's context for the next one (the next hf.fit's): a
    message left unread there must not match what that communicator receives (a
    stage boundary's header or gradient, whose tags are small numbers)."""
    world = MPI.COMM_WORLD
    top = world.Get_attr(MPI.TAG_UB)
    for _ in range(3):
        comm = MPICommunicator(world)
        beat = heartbeat.Heartbeat(comm.comm, ["localhost"] * comm.size, interval=5.0,
                                   limit=30)
        world.Barrier()
        time.sleep(0.3)
        # Rank 0 stops just after the others, before its heartbeat has read their
        # goodbyes: it says its own to ranks no longer listening (as at every call's
        # end, when all ranks stop within milliseconds).
        time.sleep(0.02 if comm.rank == 0 else 0.0)
        beat.stop()
        time.sleep(0.5)
        comm.free()
        later = [world.Dup() for _ in range(4)]   # the contexts just freed, among them
        time.sleep(0.2)
        status, stale = MPI.Status(), []
        for k, c in enumerate(later):
            while c.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG, status):
                stale.append((k, status.Get_tag()))
                c.Recv(bytearray(status.Get_count(MPI.BYTE)), status.Get_source(),
                       status.Get_tag())
        world.Barrier()
        for c in later:
            c.Free()
        # Left over, they must lie where nothing else receives: not among small tags.
        low = [(k, tag) for k, tag in stale if tag < top // 2]
        assert not low, f"rank {world.Get_rank()}: messages left for (comm, tag) {low}"
