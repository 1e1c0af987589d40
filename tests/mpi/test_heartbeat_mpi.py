"""The heartbeat's messages never reach a later communicator; run under mpiexec by
tests/cluster/test_mpi.py:

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
def test_no_message_is_left_on_a_freed_heartbeat():
    """Ranks stop their heartbeats at different times, so a goodbye or a beat may be on
    its way to a rank that has stopped listening. MPI reuses a freed communicator's
    context for the next one made (the next hf.fit's); under the standard no message may
    be left on a communicator when it is freed (MPICH matched such a one in the next
    call's receives, Open MPI hung in the next `Idup`). So `stop` reads every message
    sent to this rank before the free: nothing at all arrives on later communicators."""
    world = MPI.COMM_WORLD
    for _ in range(3):
        comm = MPICommunicator(world)
        beat = heartbeat.Heartbeat(comm.comm, ["localhost"] * comm.size, interval=0.05,
                                   limit=30)
        world.Barrier()
        time.sleep(0.3)
        # Rank 0 stops after the others, beating meanwhile: messages cross the goodbyes.
        time.sleep(0.2 if comm.rank == 0 else 0.0)
        beat.stop()
        assert beat.freed and beat.beats > 3, (beat.freed, beat.beats)
        # Every message any rank sent this one was read here before the free.
        sent = world.allgather(beat._sent.tolist())
        got = world.allgather(beat._got.tolist())
        pairs = [(i, j, sent[i][j], got[j][i]) for i in range(comm.size)
                 for j in range(comm.size) if sent[i][j] != got[j][i]]
        assert not pairs, f"(from, to, sent, read): {pairs}"
        time.sleep(0.2)
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
        assert not stale, f"rank {world.Get_rank()}: messages left for (comm, tag) {stale}"
