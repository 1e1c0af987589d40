"""Real MPI runs (mpiexec from the environment), each under an outer timeout."""

import os
import re
import shutil
import subprocess
import sys
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
MPIEXEC = shutil.which("mpiexec", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))

pytestmark = pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec on PATH or beside python")


def clean_environment(**extra):
    """The caller's environment without Slurm's or hyparflow's layout variables."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "HYPARFLOW_NUM_"))}
    env.update(HYPARFLOW_TIMEOUT="120", PYTHONUNBUFFERED="1", **extra)
    return env


FAKE_SRUN = """#!/bin/bash
# srun for a test: take -n, drop srun's options, run the command under mpiexec outside Slurm.
n="${{SLURM_NTASKS:-1}}"   # srun in a job script takes the allocation's task count
while [ $# -gt 0 ]; do
    case "$1" in
        -n) n="$2"; shift 2 ;;
        --*) shift ;;
        *) break ;;
    esac
done
for v in $(env | grep -o '^SLURM_[A-Z_]*'); do unset "$v"; done
exec {mpiexec} -n "$n" "$@"
"""


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


@pytest.mark.parametrize("how", ["mpiexec", "hyparflow run", "srun", "sbatch template"])
def test_a_script_choosing_its_stages_runs_however_launched(how, tmp_path):
    """`hf.fit(num_stages=2)` with the replicas left out, on 2 ranks: no launcher imposes
    a replica count it derived for another number of stages."""
    script = os.path.join(HERE, "mpi", "own_layout_script.py")
    srun = tmp_path / "srun"
    srun.write_text(FAKE_SRUN.format(mpiexec=MPIEXEC))
    srun.chmod(0o755)
    slurm = {"SLURM_JOB_ID": "42", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "localhost",
             "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}"}
    if how == "mpiexec":
        argv, env = [MPIEXEC, "-n", "2", sys.executable, script], clean_environment()
    elif how == "hyparflow run":
        argv = [sys.executable, "-m", "hyparflow", "run", "-n", "2", script]
        env = clean_environment()
    elif how == "srun":   # hyparflow run inside an allocation: srun, -n from SLURM_NTASKS
        argv = [sys.executable, "-m", "hyparflow", "run", script]
        env = clean_environment(**slurm)
    else:                 # the rendered job script, run as sbatch would run it
        job = tmp_path / "job.sbatch"
        render = subprocess.run([sys.executable, "-m", "hyparflow", "slurm", "--tasks-per-node",
                                 "2", "--output", str(job), script], capture_output=True,
                                text=True, timeout=60, env=clean_environment())
        assert render.returncode == 0, render.stderr
        argv, env = ["bash", str(job)], clean_environment(**slurm)
    out = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env, cwd=HERE)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    assert "own layout: 2 ranks, max weight difference" in out.stdout, out.stdout
    assert "environment []" in out.stdout, out.stdout   # nothing was asked for, none set


def _error_line(text, kind):
    """The line of the message that names the user's mistake."""
    marker = "Received a label value" if kind == "labels" else "ValueError: "
    lines = [line for line in text.splitlines() if line.startswith(marker)]
    assert lines, text[-3000:]
    return lines[-1].split("  Label values:")[0]   # the labels listed depend on the batch


@pytest.mark.parametrize("kind", ["shape", "labels", "loss"])
def test_a_users_mistake_is_reported_once_as_model_fit_reports_it(kind):
    """Wrong input shape, a label out of range, a loss that does not match the output:
    the user's error comes once, first, from the rank where it happened, in model.fit's
    words; the user's frame heads the traceback; hyparflow's context comes after."""
    script = os.path.join(HERE, "mpi", "user_error_script.py")
    keras_run = subprocess.run([sys.executable, script, kind, "keras"], capture_output=True,
                               text=True, timeout=120, env=clean_environment())
    assert keras_run.returncode != 0
    expected = _error_line(keras_run.stderr, kind)
    out, seconds = mpiexec(2, script, kind, "hf", timeout=120)
    err = out.stderr
    assert out.returncode != 0 and "finished without the error" not in out.stdout
    assert err.count("Traceback (most recent call last):") == 1, err[-6000:]
    assert err.count(expected) == 1, (expected, err[-6000:])
    assert _error_line(err, kind) == expected
    # Python's order: the user's frame first, the error, then where it was in hyparflow.
    first_frame = err.split("Traceback (most recent call last):\n", 1)[1].splitlines()[0]
    assert first_frame.startswith(f'  File "{script}"'), first_frame
    context = "set-up failed on every rank (2) alike" if kind != "labels" else \
        "hyparflow: rank 1 (stage 1, replica 0) failed at F0 with the error above"
    assert context in err and err.index(expected) < err.index(context), err[-3000:]
    # hyparflow's frames are hidden, as Keras hides its own (each leaves the one frame
    # that re-raises with the shorter traceback).
    frames = re.findall(r'^  File "([^"]+)"', err.split(expected)[0].split("Detected at node")[0],
                        re.M)
    assert [f for f in frames if "/hyparflow/" in f and not f.endswith("errors.py")] == [], err
    assert seconds < 60


@pytest.mark.skipif(shutil.which("script") is None, reason="no `script` to make a terminal")
def test_progress_on_rank_0_bar_on_a_terminal_one_line_otherwise(tmp_path):
    script = os.path.join(HERE, "mpi", "progress_script.py")
    out, _ = mpiexec(2, script, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "\x1b" not in out.stdout and "\b" not in out.stdout, repr(out.stdout)
    # One line per epoch and one for evaluate, from rank 0 only.
    assert out.stdout.count("Epoch 1/2") == 1
    assert len(re.findall(r"^4/4 - \d+s - ", out.stdout, re.M)) == 3, out.stdout
    # mpiexec writing to a terminal: its ranks write to pipes, yet rank 0 draws Keras's bar.
    log = tmp_path / "terminal.log"
    command = " ".join([MPIEXEC, "-n", "2", sys.executable, script])
    run = subprocess.run(["script", "-qec", command, str(log)], capture_output=True,
                         text=True, timeout=180, env=clean_environment(), cwd=HERE)
    text = log.read_text(errors="replace")
    assert run.returncode == 0, text[-3000:]
    assert "\x1b[" in text and text.count("Epoch 1/2") == 1, repr(text[-2000:])
