"""Real MPI: SIGTERM checkpoints and resumes to the uninterrupted weights; SIGKILL never hangs."""

import glob
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from test_mpi import MPIEXEC, launch_argv, mpiexec

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/
SCRIPT = os.path.join(HERE, "mpi", "resumable_script.py")

pytestmark = [pytest.mark.mpiexec,
              pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec on PATH or beside python")]


def start(tmp, tag, *extra):
    env = dict(os.environ, HYPARFLOW_TIMEOUT="60", PYTHONUNBUFFERED="1")
    return subprocess.Popen(
        launch_argv(4, sys.executable, SCRIPT, str(tmp / "ckpt"), str(tmp / f"{tag}.npz"),
                    str(tmp / f"progress-{tag}"), *extra),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def wait_for_step(tmp, tag, step, proc, timeout=240):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        files = glob.glob(str(tmp / f"progress-{tag}" / "step-*"))
        steps = [int(open(f).read()) for f in files]
        if steps and min(steps) >= step:
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.1)
    raise AssertionError("the run made no progress")


def pid(tmp, tag, rank):
    return int(open(tmp / f"progress-{tag}" / f"pid-{rank}").read())


def weights(path):
    with np.load(path) as f:
        return [f[k] for k in sorted(f.files, key=lambda k: int(k.split("_")[1]))]


def test_sigterm_checkpoints_and_resume_matches_uninterrupted(tmp_path):
    whole_dir = tmp_path / "whole"
    whole_dir.mkdir()
    out, _ = mpiexec(4, SCRIPT, str(whole_dir / "ckpt"), str(whole_dir / "w.npz"),
                     str(whole_dir / "progress"), timeout=400)
    assert out.returncode == 0, out.stderr[-3000:]

    proc = start(tmp_path, "a")
    wait_for_step(tmp_path, "a", 7, proc)
    os.kill(pid(tmp_path, "a", 1), signal.SIGUSR1)  # what Slurm's --signal sends
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 75, stderr[-3000:]
    assert "stopped by SIGUSR1" in stderr
    assert not os.path.exists(tmp_path / "a.npz")
    out, _ = mpiexec(4, SCRIPT, str(tmp_path / "ckpt"), str(tmp_path / "b.npz"),
                     str(tmp_path / "progress-b"), "resume", timeout=400)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "resuming from" in out.stdout
    for a, b in zip(weights(tmp_path / "b.npz"), weights(whole_dir / "w.npz")):
        np.testing.assert_array_equal(a, b)


def test_sigkill_of_one_rank_ends_the_job_and_resume_loses_little(tmp_path):
    proc = start(tmp_path, "k")
    wait_for_step(tmp_path, "k", 9, proc)
    killed_at = time.monotonic()
    os.kill(pid(tmp_path, "k", 2), signal.SIGKILL)
    stdout, stderr = proc.communicate(timeout=60)
    seconds = time.monotonic() - killed_at
    assert proc.returncode != 0
    assert seconds < 30, f"{seconds:.1f} s to stop after SIGKILL"
    both = stdout + stderr
    # mpiexec reports the dead process and the signal, and ends the others.
    assert "BAD TERMINATION" in both and "signal 9" in both, both[-2000:]
    from hyparflow.engine import checkpoint as C

    _, manifest = C.latest_valid(str(tmp_path / "ckpt"))
    steps = [int(open(f).read()) for f in glob.glob(str(tmp_path / "progress-k" / "step-*"))]
    assert max(steps) - manifest["global_step"] <= 2 + 1  # checkpoint_every, plus the step in flight
    print(f"dead rank detected and job ended in {seconds:.2f} s")
