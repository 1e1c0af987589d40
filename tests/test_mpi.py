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


HOSTS_SCRIPT = os.path.join(HERE, "mpi", "hosts_script.py")


def test_a_frozen_rank_is_named_and_the_others_end(tmp_path):
    """One machine, 2 stages: rank 1 frozen (SIGSTOP) mid-training. Rank 0's heartbeat
    finds it silent after HYPARFLOW_PEER_TIMEOUT (4 s here) and ends with exit code 75,
    naming rank 1 and its host, long before the 120 s watchdog."""
    import signal
    import socket

    marker = str(tmp_path / "epoch")
    env = dict(os.environ, HYPARFLOW_TIMEOUT="120", HYPARFLOW_PEER_TIMEOUT="4",
               HYPARFLOW_HEARTBEAT_SECONDS="0.5", HYPARFLOW_NUM_STAGES="2", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([MPIEXEC, "-n", "2", sys.executable, HOSTS_SCRIPT, "long", marker],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            cwd=HERE, start_new_session=True)
    pid = None
    try:
        deadline = time.monotonic() + 120
        while not (os.path.exists(marker + ".0") and os.path.exists(marker + ".1")):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
            time.sleep(0.2)
        time.sleep(0.2)
        pid = int(open(marker + ".1").read().split()[1])
        start = time.monotonic()
        os.kill(pid, signal.SIGSTOP)
        out, _ = proc.communicate(timeout=60)
        seconds = time.monotonic() - start
    finally:
        if pid is not None:
            try:
                os.kill(pid, signal.SIGKILL)
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    print(f"frozen rank: the run ended {seconds:.1f} s after SIGSTOP\n{out[-2000:]}")
    assert proc.returncode != 0
    assert f"hyparflow: rank 0 on host {socket.gethostname()}: lost rank 1 on host " \
           f"{socket.gethostname()}" in out, out[-3000:]
    assert "exit code 75" in out
    assert seconds < 15, f"took {seconds:.1f} s"


def test_silence_outside_fit_is_not_a_lost_peer():
    """Rank 0 busy alone for 3x the peer timeout between two fits: no rank is reported
    lost (the heartbeat runs only inside fit, and a rank that leaves says goodbye)."""
    env_timeout = dict(HYPARFLOW_PEER_TIMEOUT="1", HYPARFLOW_HEARTBEAT_SECONDS="0.2")
    old = {k: os.environ.get(k) for k in env_timeout}
    os.environ.update(env_timeout)
    try:
        out, _ = mpiexec(2, HOSTS_SCRIPT, "pause", "3", timeout=180)
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "lost" not in out.stderr, out.stderr[-3000:]
    assert out.stdout.count("finished both fits") == 2
    assert "rank 0 finished its own work" in out.stdout
