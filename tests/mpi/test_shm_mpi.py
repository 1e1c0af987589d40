"""In-node gradient sums through a shared-memory window (engine/shm.py) over real MPI
processes; run under mpiexec by tests/cluster/test_mpi.py:

    mpiexec -n 2 python -m pytest --with-mpi tests/mpi/test_shm_mpi.py
    mpiexec -n 4 python -m pytest --with-mpi tests/mpi/test_shm_mpi.py
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import hyparflow as hf  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from mpi4py import MPI  # noqa: E402

from hyparflow.engine import comm as _comm, shm  # noqa: E402
from test_zero_mpi import wide_adam  # noqa: E402  (kernels far past the window's threshold)

SIZE = MPI.COMM_WORLD.Get_size()
RANK = MPI.COMM_WORLD.Get_rank()


def summed(comm, values):
    """Each rank's `values` summed by `comm`, and every rank's result (to compare bits)."""
    buf = values.copy()
    comm.allreduce(buf)
    return buf, MPI.COMM_WORLD.allgather(buf.tobytes())


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("n", [7, 100_000, 5_000_001])   # in pieces past 16 MB
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_window_sum_is_the_sum_with_the_same_bits_everywhere(n, dtype, monkeypatch):
    monkeypatch.setenv("HYPARFLOW_SHARED_SUMS", "1")
    comm = _comm.MPICommunicator(MPI.COMM_WORLD)
    before = shm.used()
    try:
        rng = np.random.default_rng(RANK)
        values = rng.normal(size=n).astype(dtype)
        everyone = MPI.COMM_WORLD.allgather(values)
        out, results = summed(comm, values)
        expected = np.sum(np.stack(everyone).astype("float64"), axis=0)
        tolerance = 1e-5 if dtype == "float32" else 1e-12
        assert np.allclose(out, expected, rtol=tolerance, atol=tolerance)
        assert all(r == results[0] for r in results), "ranks got different bits"
        large = values.nbytes >= shm.SHM_BYTES
        assert (shm.used() > before) == large, (comm.sums, shm.used(), before)
        if large:
            assert comm.sums.startswith("shared memory"), comm.sums
    finally:
        comm.free()


@pytest.mark.mpi(min_size=4)
def test_nodes_exchange_slices_only(monkeypatch):
    """Four ranks played as two nodes of two: the sum inside each node through its
    window, then each rank's slice with the same-position rank of the other node."""
    monkeypatch.setenv("HYPARFLOW_SHARED_SUMS", "1")
    comm = _comm.MPICommunicator(MPI.COMM_WORLD)
    comm.node_of = lambda rank: rank // (SIZE // 2)
    try:
        values = np.random.default_rng(RANK).normal(size=300_001).astype("float32")
        everyone = MPI.COMM_WORLD.allgather(values)
        out, results = summed(comm, values)
        assert "2 nodes" in comm.sums, comm.sums
        assert np.allclose(out, np.sum(np.stack(everyone), axis=0), rtol=1e-5, atol=1e-5)
        assert all(r == results[0] for r in results), "ranks got different bits"
        # Several sums in flight at once complete in order, each right.
        bufs = [values * (k + 1) for k in range(3)]
        _comm.wait_all([comm.iallreduce(b) for b in bufs], 60)
        for k, b in enumerate(bufs):
            assert np.allclose(b, out * (k + 1), rtol=1e-4, atol=1e-4)
    finally:
        comm.free()


def turned_off(monkeypatch):
    monkeypatch.setenv("HYPARFLOW_SHARED_SUMS", "0")
    comm = _comm.MPICommunicator(MPI.COMM_WORLD)
    try:
        before = shm.used()
        summed(comm, np.ones(100_000, "float32"))
        return comm.sums, shm.used() - before
    finally:
        comm.free()


@pytest.mark.mpi(min_size=2)
def test_turned_off_the_sums_are_messages(monkeypatch):
    sums, pieces = turned_off(monkeypatch)
    assert sums == "messages (HYPARFLOW_SHARED_SUMS=0)" and pieces == 0


@pytest.mark.mpi(min_size=2)
def test_by_default_a_window_where_a_node_holds_more_than_two(monkeypatch):
    monkeypatch.delenv("HYPARFLOW_SHARED_SUMS", raising=False)
    comm = _comm.MPICommunicator(MPI.COMM_WORLD)
    try:
        summed(comm, np.ones(100_000, "float32"))
        assert comm.sums.startswith("shared memory" if SIZE > shm.AUTO_RANKS else
                                    "messages ("), comm.sums
    finally:
        comm.free()
    if SIZE % 2 == 0 and SIZE > 2:
        # Nodes of two ranks, several of them: the window too, as only slices cross.
        comm = _comm.MPICommunicator(MPI.COMM_WORLD)
        comm.node_of = lambda rank: rank // 2
        try:
            summed(comm, np.ones(100_000, "float32"))
            assert comm.sums.startswith("shared memory (2 ranks x"), comm.sums
        finally:
            comm.free()


@pytest.mark.mpi(min_size=2)
def test_ranges_summed_on_their_owner_and_handed_out(monkeypatch):
    """`Shared.ireduce` and `igather` over a buffer in pieces (past the 16 MB of a
    slot), with ranges across the pieces' ends: an owner's range holds the sum, a
    range for every rank the same bits everywhere, the rest what the rank had; then
    each owner's range reaches every rank."""
    monkeypatch.setenv("HYPARFLOW_SHARED_SUMS", "1")
    comm = _comm.MPICommunicator(MPI.COMM_WORLD)
    try:
        n = shm.CAPACITY // 4 + 1_000_003
        cuts = [0, 7, 1000, shm.CAPACITY // 4 - 5, shm.CAPACITY // 4 + 9, n - 3, n]
        ranges = [(a, b, k % SIZE, k % 3 == 1) for k, (a, b) in enumerate(zip(cuts, cuts[1:]))]
        values = np.random.default_rng(RANK).normal(size=n).astype("float32")
        everyone = np.stack(MPI.COMM_WORLD.allgather(values))
        total = everyone.sum(axis=0, dtype="float64")
        buf = values.copy()
        assert comm.window(buf) is not None, comm.sums
        _comm.wait_all([comm.window(buf).ireduce(buf, ranges)], 60)
        for a, b, r, every in ranges:
            if r == RANK or every:
                assert np.allclose(buf[a:b], total[a:b], rtol=1e-5, atol=1e-5), (a, b, r)
            else:
                assert np.array_equal(buf[a:b], values[a:b]), (a, b, r)
            if every:
                bits = MPI.COMM_WORLD.allgather(buf[a:b].tobytes())
                assert all(x == bits[0] for x in bits), (a, b)
        out = values.copy()
        _comm.wait_all([comm.window(out).igather(out, [(a, b, r) for a, b, r, _ in ranges])], 60)
        for a, b, r, _ in ranges:
            assert np.array_equal(out[a:b], everyone[r, a:b]), (a, b, r)
    finally:
        comm.free()


def layouts():
    """(S, R, M, ZeRO) with at least two replicas: plain, a pipeline, ZeRO's step."""
    if SIZE == 2:
        return [(1, 2, 2, "0"), (1, 2, 1, "1")]
    return [(1, SIZE, 1, "0"), (2, SIZE // 2, 2, "0"), (1, SIZE, 2, "1")]


@pytest.mark.mpi(min_size=2)
def test_fit_with_shared_sums_matches_model_fit(monkeypatch):
    monkeypatch.setenv("HYPARFLOW_SHARED_SUMS", "1")
    rng = np.random.default_rng(5)
    x, y = rng.normal(size=(64, 32)).astype("float32"), rng.normal(size=(64, 4)).astype("float32")
    reference = wide_adam()
    start = reference.get_weights()
    reference.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    expected = reference.get_weights()
    for s, r, m, zero in layouts():
        monkeypatch.setenv("HYPARFLOW_ZERO", zero)
        model = wide_adam()
        model.set_weights(start)
        before = shm.used()
        hf.fit(model, x, y, batch_size=16, epochs=2, num_stages=s, num_replicas=r,
               num_microbatches=m, shuffle=False, verbose=0)
        weights = model.get_weights()
        diff = max(float(np.abs(a - b).max()) for a, b in zip(weights, expected))
        mine = b"".join(w.tobytes() for w in weights)
        same = all(other == mine for other in MPI.COMM_WORLD.allgather(mine))
        pieces = MPI.COMM_WORLD.allgather(shm.used() - before)
        if hf.is_main():
            print(f"\nshared sums (S,R,M)={(s, r, m)} zero={zero}: max weight difference "
                  f"{diff:.3g}, pieces through windows {pieces}")
        assert diff <= 1e-5, f"(S,R,M)={(s, r, m)} zero={zero}: {diff}"
        assert same, "ranks hold different weights"
        # ZeRO's sums to the owners and its new rows too (kinds/zero/, forced here).
        assert min(pieces) > 0, pieces
