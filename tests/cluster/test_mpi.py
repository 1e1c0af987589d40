"""Real MPI runs (mpiexec from the environment), each under an outer timeout."""

import os
import re
import shutil
import subprocess
import sys
import time

import pytest

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/
from hyparflow.cluster import dialect, launch  # noqa: E402

# The launcher of the MPI this Python's mpi4py is built with (MPICH's wheel, or a site's
# Open MPI), and its flags: every run here starts through `launch_argv`.
MPIEXEC = launch.find_mpiexec()
DIALECT = dialect.Dialect(dialect.of_mpiexec(MPIEXEC) if MPIEXEC else dialect.UNKNOWN)


def launch_argv(n, *command):
    """mpiexec starting `command` on `n` ranks on this machine, in its MPI's words (Open
    MPI: more ranks than cores allowed, no binding)."""
    return DIALECT.argv(MPIEXEC, n, list(command))


def launcher_words():
    """The launcher and its flags, before `-n` (for a shell script to add `-n N cmd`)."""
    argv = launch_argv(1, "true")
    return " ".join(argv[:argv.index("-n")])


pytestmark = [pytest.mark.mpiexec,
              pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec on PATH or beside python")]


def clean_environment(**extra):
    """The caller's environment without Slurm's or hyparflow's layout variables."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "HYPARFLOW_NUM_"))}
    env.update(HYPARFLOW_TIMEOUT="120", PYTHONUNBUFFERED="1", HYPARFLOW_INTER_OP_THREADS="1",
               **extra)
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
    # Production's thread settings: one inter-op thread per rank (tests/conftest.py
    # gives thread-ranks more, which hid a deadlock of split layers' collectives).
    env = dict(os.environ, HYPARFLOW_TIMEOUT="120", PYTHONUNBUFFERED="1",
               HYPARFLOW_INTER_OP_THREADS="1")
    start = time.monotonic()
    out = subprocess.run(launch_argv(n, sys.executable, *args), capture_output=True,
                         text=True, timeout=timeout, env=env, cwd=HERE)
    return out, time.monotonic() - start


# At 4 ranks, only what 4 ranks add to the run at 2: layouts that need them (2x2 meshes,
# S=2 x R=2 or T=2, four replicas, two "nodes" of two) and the cases whose layouts
# change with them. Every file at 4 took as long again as at 2 (over 600 s).
AT_FOUR = " or ".join([
    "test_same_weights_as_one_process", "tensor_parallel_same_weights", "mesh",
    "pipelined_tables", "independent_split", "replicas_sum_every_chunk", "bfloat16",
    "heartbeat", "sharded_optimizer_step", "sharded_step_through_the_window",
    "keras_hub_encoder_decoder_blocks",
    "nodes_exchange_slices_only", "window_where_a_node_holds_more_than_two",
    "local_sgd_every_step", "string_columns", "reads_its_part",
    "own_train_step"])


@pytest.mark.timeout(900)
@pytest.mark.parametrize("n", [2, 4])
def test_contract_under_mpiexec(n):
    # HYPARFLOW_MPI_SELECT: another -k selection of tests/mpi (a developer's re-run).
    select = os.environ.get("HYPARFLOW_MPI_SELECT") or (AT_FOUR if n == 4 else None)
    out, _ = mpiexec(n, "-m", "pytest", "--with-mpi", "-q", "-s", "-p", "no:cacheprovider",
                     "--durations=12", os.path.join(HERE, "mpi"),
                     *(["-k", select] if select else []))
    print(out.stdout[-4000:])
    assert out.returncode == 0, out.stdout[-5000:] + out.stderr[-5000:]
    assert " passed" in out.stdout


def test_two_meshes_on_eight_ranks_under_mpiexec():
    """The one case at n=8 (S=2 x a 2x2 mesh): only the mesh's file, whose other tests
    also run at n=2 and 4 above; 8 processes on this host's cores start slowly, so no
    more than this one."""
    out, _ = mpiexec(8, "-m", "pytest", "--with-mpi", "-q", "-s", "-p", "no:cacheprovider",
                     os.path.join(HERE, "mpi", "test_mesh_mpi.py"), "-k", "two_stages")
    print(out.stdout[-3000:])
    assert out.returncode == 0, out.stdout[-5000:] + out.stderr[-5000:]
    assert "1 passed" in out.stdout and "max weight difference" in out.stdout


def test_two_fits_and_an_evaluate_in_one_process():
    """Each call starts and stops a heartbeat and frees its communicators: the next
    call must meet nothing the last one left (under Open MPI the second fit's heartbeat
    used to hang, sometimes; scripts/openmpi-tier.sh repeats this 10 times)."""
    out, _ = mpiexec(2, os.path.join(HERE, "mpi", "two_fits_script.py"), "2", timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    assert out.stdout.count("two fits: 2 ranks, round ") == 2, out.stdout


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


def test_a_failing_reader_ends_all_quickly_naming_the_error():
    """The rank that reads a generator fails in it: the others, waiting for its batch,
    end too, and the error is named."""
    out, seconds = mpiexec(2, os.path.join(HERE, "mpi", "failing_reader_script.py"),
                           timeout=120)
    assert out.returncode != 0
    assert "finished without the failure" not in out.stdout
    assert "injected: the data's disk is gone" in out.stderr
    assert seconds < 60, f"took {seconds:.0f} s to stop"


def test_failure_in_an_own_train_step_ends_all_quickly():
    """Rank 1's own train_step raises at its third step while rank 0 waits in the
    optimizer's sum of the replicas' gradients."""
    out, seconds = mpiexec(2, os.path.join(HERE, "mpi", "own_step_failing_script.py"), "1",
                           "2", timeout=120)
    assert out.returncode != 0
    assert "finished without the failure" not in out.stdout
    assert out.stderr.count("injected failure in the own train_step") >= 1
    assert out.stderr.count("hyparflow: rank 1 failed with the error above") == 1
    assert seconds < 60, f"took {seconds:.0f} s to stop"


@pytest.mark.parametrize("how", ["mpiexec", "hyparflow run", "srun", "sbatch template"])
def test_a_script_choosing_its_stages_runs_however_launched(how, tmp_path):
    """`hf.fit(num_stages=2)` with the replicas left out, on 2 ranks: no launcher imposes
    a replica count it derived for another number of stages."""
    script = os.path.join(HERE, "mpi", "own_layout_script.py")
    srun = tmp_path / "srun"
    srun.write_text(FAKE_SRUN.format(mpiexec=launcher_words()))
    srun.chmod(0o755)
    slurm = {"SLURM_JOB_ID": "42", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "localhost",
             "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}"}
    if how == "mpiexec":
        argv, env = launch_argv(2, sys.executable, script), clean_environment()
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
    # Plain Keras's own words, from a process started beside the ranks (one core
    # would idle while it starts alone).
    keras_run = subprocess.Popen([sys.executable, script, kind, "keras"], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True, env=clean_environment())
    try:
        out, seconds = mpiexec(2, script, kind, "hf", timeout=120)
        _, keras_err = keras_run.communicate(timeout=120)
    finally:
        if keras_run.poll() is None:
            keras_run.kill()
            keras_run.communicate()
    assert keras_run.returncode != 0
    expected = _error_line(keras_err, kind)
    err = out.stderr
    assert out.returncode != 0 and "finished without the error" not in out.stdout
    assert err.count("Traceback (most recent call last):") == 1, err[-6000:]
    assert err.count(expected) == 1, (expected, err[-6000:])
    assert _error_line(err, kind) == expected
    # Python's order: the user's frame first, the error, then where it was in hyparflow.
    first_frame = err.split("Traceback (most recent call last):\n", 1)[1].splitlines()[0]
    assert first_frame.startswith(f'  File "{script}"'), first_frame
    context = "set-up failed on every rank (2) alike" if kind != "labels" else \
        "hyparflow: rank 1 (stage 1, replica 0) failed at FB0 with the error above"
    assert context in err and err.index(expected) < err.index(context), err[-3000:]
    # hyparflow's frames are hidden, as Keras hides its own (each leaves the one frame
    # that re-raises with the shorter traceback).
    frames = re.findall(r'^  File "([^"]+)"', err.split(expected)[0].split("Detected at node")[0],
                        re.M)
    assert [f for f in frames if "/hyparflow/" in f and not f.endswith("errors.py")] == [], err
    assert seconds < 60


MISTAKES = {
    "ranks": "The world has 2 ranks, which num_stages=3 does not divide.",
    "schedule": "Unknown schedule '1fb1'",
    "keyword": "TypeError: hf.fit() got an unexpected keyword argument 'num_stage'. "
               "Did you mean 'num_stages'?",
}


@pytest.mark.parametrize("kind", sorted(MISTAKES))
def test_a_newcomers_first_mistakes_are_printed_once_from_the_users_line(kind):
    """A wrong rank count, an unknown schedule, a mistyped keyword: one traceback (rank
    0's), the user's line first, none of hyparflow's wrapper frames; the keyword gets
    "Did you mean"."""
    script = os.path.join(HERE, "mpi", "user_error_script.py")
    out, seconds = mpiexec(2, script, kind, "hf", timeout=120)
    err = out.stderr
    assert out.returncode != 0 and "finished without the error" not in out.stdout
    assert err.count("Traceback (most recent call last):") == 1, err[-4000:]
    assert err.count(MISTAKES[kind]) == 1, err[-4000:]
    frames = re.findall(r'^  File "([^"]+)", line \d+, in (\S+)', err, re.M)
    assert frames[0][0] == script, frames
    assert not [f for f in frames if f[0].endswith("errors.py") or f[1] == "wrapper"], err
    assert seconds < 60


@pytest.mark.parametrize("kind", ["main_only", "different"])
def test_a_collective_call_on_some_ranks_only_is_named_at_once(kind):
    """hf.evaluate inside `if hf.is_main():` after a fit: rank 1 has finished, and rank 0
    says so within seconds (not after HYPARFLOW_TIMEOUT, 120 s here), naming the call
    each rank was in and the fix; ranks in different calls are told so too, once."""
    script = os.path.join(HERE, "mpi", "collective_script.py")
    out, seconds = mpiexec(2, script, kind, timeout=100)
    err = out.stderr
    print(f"{kind}: ended after {seconds:.1f} s\n{err[-2000:]}")
    assert out.returncode != 0
    assert err.count("Traceback (most recent call last):") == 1, err[-4000:]
    if kind == "main_only":
        assert ("CollectiveMismatch: Rank 0 waits in hf.evaluate (its 2nd hyparflow call) for "
                "every rank, but rank 1 has finished (its script ended after 1st hyparflow "
                "call, hf.fit). hf.evaluate is collective, as hf.fit: call it on every rank"
                in err), err[-4000:]
        assert "rank 1 finished without the error" in out.stdout
    else:
        assert ("The ranks are in different hyparflow calls: rank 0 in hf.evaluate (its 2nd "
                "call), rank 1 in hf.predict (its 2nd call)." in err), err[-4000:]
        assert "finished without the error" not in out.stdout
    assert seconds < 40, f"took {seconds:.1f} s"


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
    command = " ".join(launch_argv(2, sys.executable, script))
    run = subprocess.run(["script", "-qec", command, str(log)], capture_output=True,
                         text=True, timeout=180, env=clean_environment(), cwd=HERE)
    text = log.read_text(errors="replace")
    assert run.returncode == 0, text[-3000:]
    assert "\x1b[" in text and text.count("Epoch 1/2") == 1, repr(text[-2000:])

HOSTS_SCRIPT = os.path.join(HERE, "mpi", "hosts_script.py")


def _end(proc, frozen):
    """Kill the frozen ranks (mpiexec may have ended them already) and the launch."""
    import signal

    for pid in frozen:
        try:
            os.kill(pid, signal.SIGKILL)
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _signal_rank_one(tmp_path, env, sig):
    """Train HOSTS_SCRIPT's long run on 2 ranks and send `sig` to rank 1 once both train:
    (return code, output, seconds from the signal to the run's end)."""
    marker = str(tmp_path / "epoch")
    proc = subprocess.Popen(launch_argv(2, sys.executable, HOSTS_SCRIPT, "long", marker),
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
        os.kill(pid, sig)
        out, _ = proc.communicate(timeout=60)
        seconds = time.monotonic() - start
    finally:
        _end(proc, [pid] if pid is not None else [])
    return proc.returncode, out, seconds


def test_a_frozen_rank_is_named_and_the_others_end(tmp_path):
    """One machine, 2 stages: rank 1 frozen (SIGSTOP) mid-training. Rank 0's heartbeat
    finds it silent after HYPARFLOW_PEER_TIMEOUT (4 s here) and ends with exit code 75,
    naming rank 1 and its host, long before the 120 s watchdog."""
    import signal
    import socket

    env = dict(os.environ, HYPARFLOW_TIMEOUT="120", HYPARFLOW_PEER_TIMEOUT="4",
               HYPARFLOW_HEARTBEAT_SECONDS="0.5", HYPARFLOW_NUM_STAGES="2", PYTHONUNBUFFERED="1")
    returncode, out, seconds = _signal_rank_one(tmp_path, env, signal.SIGSTOP)
    print(f"frozen rank: the run ended {seconds:.1f} s after SIGSTOP\n{out[-2000:]}")
    assert returncode != 0
    assert f"hyparflow: rank 0 on host {socket.gethostname()}: lost rank 1 on host " \
           f"{socket.gethostname()}" in out, out[-3000:]
    assert "exit code 75" in out
    assert seconds < 15, f"took {seconds:.1f} s"


def test_a_killed_rank_ends_the_run(tmp_path):
    """One machine, 2 stages: rank 1 killed (SIGKILL, as the OOM killer does) mid-training.
    The launcher ends the other rank and the run fails within seconds, not after the
    120 s watchdog, whichever MPI (MPICH's hydra or Open MPI's mpiexec)."""
    import signal

    env = dict(os.environ, HYPARFLOW_TIMEOUT="120", HYPARFLOW_NUM_STAGES="2",
               PYTHONUNBUFFERED="1")
    returncode, out, seconds = _signal_rank_one(tmp_path, env, signal.SIGKILL)
    print(f"killed rank: the run ended {seconds:.1f} s after SIGKILL\n{out[-1500:]}")
    assert returncode != 0
    assert seconds < 20, f"took {seconds:.1f} s"


def test_a_busy_rank_is_not_lost_a_frozen_one_is(tmp_path):
    """4 ranks (2 stages x 2 replicas) on 2 cores beside 4 spinning processes (4x
    oversubscribed); the first step's tracing holds the GIL for 8 s on the ranks that
    trace the slow layer, longer than HYPARFLOW_PEER_TIMEOUT (3 s here): their heartbeat
    falls silent, but /proc shows them sleeping in a call, so no verdict. Then rank 3 is
    frozen (SIGSTOP): named, with its state, within the timeout and a few seconds."""
    import signal
    import socket

    marker = str(tmp_path / "epoch")
    env = dict(os.environ, HYPARFLOW_TIMEOUT="120", HYPARFLOW_PEER_TIMEOUT="3",
               HYPARFLOW_HEARTBEAT_SECONDS="0.5", HYPARFLOW_NUM_STAGES="2",
               HYPARFLOW_THREADS="1", PYTHONUNBUFFERED="1")
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(4)]
    proc = subprocess.Popen(launch_argv(4, sys.executable, HOSTS_SCRIPT, "busy", marker),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            cwd=HERE, start_new_session=True)
    pid, seconds = None, None
    try:
        deadline = time.monotonic() + 150
        while not all(os.path.exists(f"{marker}.{r}") for r in range(4)):
            assert proc.poll() is None, proc.stdout.read()[-3000:]
            assert time.monotonic() < deadline, "no epoch in 150 s"
            time.sleep(0.2)
        time.sleep(0.2)
        pid = int(open(f"{marker}.3").read().split()[1])
        start = time.monotonic()
        os.kill(pid, signal.SIGSTOP)
        out, _ = proc.communicate(timeout=60)
        seconds = time.monotonic() - start
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
        _end(proc, [pid] if pid is not None else [])
    print(f"busy, then frozen: ended {seconds:.1f} s after SIGSTOP\n{out[-2000:]}")
    host = socket.gethostname()
    assert f"lost rank 3 on host {host} (silent for more than 3 s" in out, out[-3000:]
    assert not re.search(r"lost rank [012] ", out), out[-3000:]
    assert "its process is stopped or gone" in out
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


def test_heartbeat_neighbours_name_a_lost_host_on_every_rank(tmp_path):
    """8 ranks, 2 per pretend host, each beating to 3 neighbours (rank +-1, +4), not 7.
    Host node1 (ranks 2, 3) frozen: its neighbours find it silent, and every other rank,
    also those that watch neither (0 and 5), names both its ranks and ends with 75."""
    import signal

    from hyparflow.cluster.heartbeat import neighbours

    script = os.path.join(HERE, "mpi", "heartbeat_script.py")
    env = dict(os.environ, HYPARFLOW_PEER_TIMEOUT="2", HYPARFLOW_HEARTBEAT_SECONDS="0.3",
               PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(launch_argv(8, sys.executable, script, str(tmp_path)),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, start_new_session=True)
    frozen = []
    try:
        deadline = time.monotonic() + 60
        while len(list(tmp_path.glob("pid-*"))) < 8:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
            time.sleep(0.1)
        time.sleep(1.0)
        frozen = [int((tmp_path / f"pid-{r}").read_text()) for r in (2, 3)]
        start = time.monotonic()
        for pid in frozen:
            os.kill(pid, signal.SIGSTOP)
        out, _ = proc.communicate(timeout=60)
        seconds = time.monotonic() - start
    finally:
        _end(proc, frozen)
    print(f"lost host named by every rank {seconds:.1f} s after SIGSTOP\n{out[-3000:]}")
    for r in range(8):
        peers = [int(p) for p in (tmp_path / f"peers-{r}").read_text().split()]
        assert peers == neighbours(r, 8) and len(peers) == 3, (r, peers)
    for r in (0, 1, 4, 5, 6, 7):
        assert f"hyparflow: rank {r} on host node{r // 2}: lost rank 2 on host node1, rank 3 " \
               f"on host node1 (" in out, out[-3000:]
    assert "found by rank" in out      # 0 and 5 watch neither: they heard the verdict
    assert "still running" not in out
    assert seconds < 15, f"took {seconds:.1f} s"


def test_split_attention_in_two_branches_meets_with_one_inter_op_thread():
    """The encoder-decoder whose encoder and decoder self-attention are split: with one
    inter-op thread per rank, the ranks ran the two branches' backward sums in different
    orders and both waited until the watchdog (tests/mpi/branches_script.py). Now one
    order by construction (hyparflow.engine.order), model.fit's weights."""
    env = dict(os.environ, HYPARFLOW_TIMEOUT="60", PYTHONUNBUFFERED="1",
               HYPARFLOW_INTER_OP_THREADS="1")
    out = subprocess.run(launch_argv(2, sys.executable, os.path.join(HERE, "mpi",
                                                                     "branches_script.py")),
                         capture_output=True, text=True, timeout=300, env=env, cwd=HERE)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    diff = float(re.search(r"branches: max weight difference (\S+)", out.stdout).group(1))
    assert diff <= 1e-5, diff


def test_rows_that_interact_are_warned_once_or_refused_on_every_rank():
    """A forward that takes the batch mean, at R=2 under mpiexec: rank 0 warns once,
    naming the layer; made an error by a warnings filter, every rank ends with it."""
    script = os.path.join(HERE, "mpi", "coupling_script.py")
    out, _ = mpiexec(2, script, "warn", timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    # By pattern, not by line: unbuffered, print writes its text and its newline apart,
    # so rank 1's line can land inside rank 0's (after the layout warning, say).
    assert sorted(re.findall(r"rank (\d) warned (\d+): ", out.stdout)) == \
        [("0", "1"), ("1", "0")], out.stdout
    assert "rank 0 warned 1: The outputs of layer 'centre'" in out.stdout, out.stdout
    out, seconds = mpiexec(2, script, "error", timeout=180)
    assert out.returncode != 0 and "warned" not in out.stdout
    assert "BatchCouplingWarning: The outputs of layer 'centre'" in out.stderr, out.stderr[-3000:]
    assert "set-up failed on rank 0 of 2; the other ranks stopped with it" in out.stderr, \
        out.stderr[-3000:]
    assert out.stderr.count("Traceback (most recent call last):") == 1, out.stderr[-3000:]
    assert seconds < 120
