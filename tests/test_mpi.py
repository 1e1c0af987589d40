"""Real MPI runs (mpiexec from the environment), each under an outer timeout."""

import os
import shutil
import subprocess
import sys
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
MPIEXEC = shutil.which("mpiexec", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))

pytestmark = pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec on PATH or beside python")


def mpiexec(n, *args, timeout=600):
    env = dict(os.environ, HYPARFLOW_TIMEOUT="120", PYTHONUNBUFFERED="1")
    start = time.monotonic()
    out = subprocess.run([MPIEXEC, "-n", str(n), sys.executable, *args], capture_output=True,
                         text=True, timeout=timeout, env=env, cwd=HERE)
    return out, time.monotonic() - start


@pytest.mark.parametrize("n", [2, 4])
def test_contract_under_mpiexec(n):
    out, _ = mpiexec(n, "-m", "pytest", "--with-mpi", "-q", "-s", "-p", "no:cacheprovider",
                     os.path.join(HERE, "mpi"))
    print(out.stdout[-3000:])
    assert out.returncode == 0, out.stdout[-5000:] + out.stderr[-5000:]
    assert " passed" in out.stdout


@pytest.mark.parametrize("fail_rank", [0, 1])
def test_failure_on_one_rank_ends_all_quickly(fail_rank):
    out, seconds = mpiexec(2, os.path.join(HERE, "mpi", "failing_script.py"), str(fail_rank), "5",
                           timeout=120)
    assert out.returncode != 0
    assert "finished without the failure" not in out.stdout
    # The error is reported once, by the rank that failed, with where it was.
    assert out.stderr.count("injected failure in fails_") >= 1
    assert out.stderr.count(f"hyparflow: rank {fail_rank} (stage {fail_rank}, replica 0) failed") == 1
    assert "aborting all ranks" in out.stderr
    assert seconds < 60, f"took {seconds:.0f} s to stop"
