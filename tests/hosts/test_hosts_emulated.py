"""Runs across hosts on the emulated cluster of scripts/emulated-cluster.sh (`up 2`).

Each host is a network namespace with its own host name; `hyparflow run --hosts` starts
the ranks there through mpiexec, and they talk over TCP through a bridge. Without the
cluster (not root, not up) every test here is skipped with the reason.
"""

import glob
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import sbatch_wait

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "tests", "mpi", "hosts_script.py")
CLUSTER = os.path.join(ROOT, "scripts", "emulated-cluster.sh")
DETECT_LIMIT = 30   # seconds from a host's loss until every surviving rank has ended


def _find_cluster():
    """(environment pointing mpiexec at the hosts, [host names]) or (None, reason)."""
    if not os.path.isdir("/run/netns") or os.geteuid() != 0:
        return None, "no emulated cluster: needs root and network namespaces"
    try:
        out = subprocess.run(["bash", CLUSTER, "env"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as error:
        return None, f"no emulated cluster: {error}"
    if out.returncode != 0:
        return None, ("no emulated cluster (start one with `bash scripts/emulated-cluster.sh up "
                      f"2`): {out.stderr.strip()}")
    env = dict(os.environ)
    for line in out.stdout.splitlines():
        if line.startswith("export ") and "=" in line:
            name, value = line[len("export "):].split("=", 1)
            env[name] = value
    hosts = env["HYPARFLOW_EMULATED_HOSTS"].split(",")
    missing = [h for h in hosts if not os.path.exists(f"/run/netns/{h}")]
    if len(hosts) < 2 or missing:
        return None, f"emulated cluster incomplete: hosts {hosts}, missing {missing}"
    env.update(PYTHONPATH=ROOT + os.pathsep + env.get("PYTHONPATH", ""), PYTHONUNBUFFERED="1",
               HYPARFLOW_TIMEOUT="300")
    env.pop("HYPARFLOW_OVERLAP", None)   # the default across hosts is under test
    env.pop("HYPARFLOW_NUM_STAGES", None)
    env.pop("HYPARFLOW_THREADS", None)
    return env, hosts


ENV, HOSTS = _find_cluster()
pytestmark = [pytest.mark.mpiexec, pytest.mark.skipif(ENV is None, reason=str(HOSTS))]


def hyparflow_run(hosts, *options, args=(), timeout=240, **popen):
    argv = [sys.executable, "-m", "hyparflow", "run", "--hosts", hosts, *options, SCRIPT, *args]
    return subprocess.Popen(argv, env=ENV, cwd=ROOT, text=True, start_new_session=True, **popen)


def _contract(tmp_path, hosts, *options, mode="contract"):
    proc = hyparflow_run(hosts, *options, args=[mode, str(tmp_path)],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        out, _ = proc.communicate(timeout=240)
    finally:
        _end(proc)
    assert proc.returncode == 0, out[-5000:]
    reports = [json.load(open(p)) for p in sorted(glob.glob(str(tmp_path / "rank-*.json")))]
    trace = tmp_path / "run.json"
    return reports, json.load(open(trace)) if trace.exists() else None


@pytest.mark.timeout(300)
def test_stages_across_hosts_match_model_fit(tmp_path):
    """A 2-stage pipeline with one stage per host: activations and gradients cross TCP."""
    h1, h2 = HOSTS[:2]
    reports, _ = _contract(tmp_path, f"{h1}:1,{h2}:1", "--stages", "2", "--microbatches", "2")
    assert [r["host"] for r in reports] == [h1, h2]
    for r in reports:
        assert r["diff"] <= 1e-5, r


@pytest.mark.timeout(300)
def test_replicas_across_hosts_overlap_and_threads(tmp_path):
    """Three replicas, two on the first host and one on the second: the weights are
    model.fit's; gradient buckets start inside the backward without HYPARFLOW_OVERLAP
    (ranks span hosts); each rank's threads are its host's cores over its host's ranks."""
    h1, h2 = HOSTS[:2]
    reports, trace = _contract(tmp_path, f"{h1}:2,{h2}:1")
    assert [r["host"] for r in reports] == [h1, h1, h2]
    for r in reports:
        assert r["diff"] <= 1e-5, r
        expected = max(1, r["cores"] // (2 if r["host"] == h1 else 1))
        assert r["local_ranks"] == (2 if r["host"] == h1 else 1), r
        assert r["threads"] == r["intra_op"] == expected, r
    steps = [e["args"] for e in trace["traceEvents"]
             if e.get("ph") == "X" and e.get("cat") == "allreduce"]
    assert steps, "no allreduce in the trace"
    for args in steps:
        # One bucket per layer here: all but the last start inside the backward (the last
        # starts at its end anyway); with overlap off none would.
        assert args["buckets"] >= 2 and args["inside"] >= args["buckets"] - 1, args


@pytest.mark.timeout(300)
def test_table_row_tables_within_hosts(tmp_path):
    """"table-row" over 2 hosts x 2 ranks: each such table's rows are cut over the two
    ranks of one host (the two tables on different hosts), a "row" table over all four;
    messages past 64 KB cross TCP; the weights are model.fit's (SGD)."""
    h1, h2 = HOSTS[:2]
    reports, _ = _contract(tmp_path, f"{h1}:2,{h2}:2", mode="tables")
    assert [r["host"] for r in reports] == [h1, h1, h2, h2]
    # The bigger table ("item", 300 rows) on the first host, "user" (64) on the other.
    assert [r["rows"]["item"] for r in reports] == [150, 150, 0, 0]
    assert [r["rows"]["user"] for r in reports] == [0, 0, 32, 32]
    assert [r["rows"]["cat"] for r in reports] == [3, 3, 3, 3]
    print(f"\ntable-row across hosts: max weight difference "
          f"{max(r['diff'] for r in reports):.3g}, largest message "
          f"{max(r['largest'] for r in reports):,} bytes")
    for r in reports:
        assert r["diff"] <= 2e-6, r
        assert r["largest"] > 64 * 1024, r


@pytest.mark.timeout(300)
def test_sums_across_hosts_go_through_each_hosts_window(tmp_path):
    """Four replicas on 2 hosts x 2 ranks, by default: each host sums in its shared
    window and only slices cross (two ranks of one node alone would sum as messages,
    so any piece through a window is this hierarchical sum); the weights are model.fit's
    (Adam), the same bits on every rank."""
    h1, h2 = HOSTS[:2]
    reports, _ = _contract(tmp_path, f"{h1}:2,{h2}:2", mode="sums")
    assert [r["host"] for r in reports] == [h1, h1, h2, h2]
    for r in reports:
        assert r["diff"] <= 1e-5 and r["pieces"] > 0, r
    assert len({r["hash"] for r in reports}) == 1, reports


# ------------------------------------------------------------------ losing a host

def _children():
    kids = {}
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            text = open(stat).read()
        except OSError:
            continue
        pid, rest = int(text.split(" ", 1)[0]), text.rsplit(")", 1)[1].split()
        kids.setdefault(int(rest[1]), []).append(pid)
    return kids


def _tree(root):
    """The pids below `root` (the run's launcher)."""
    kids, out, todo = _children(), [], [root]
    while todo:
        for child in kids.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _on_host(pids, host, name=None):
    """Those of `pids` running in `host`'s namespace (and called `name`)."""
    target = os.stat(f"/run/netns/{host}").st_ino
    found = []
    for pid in pids:
        try:
            if os.stat(f"/proc/{pid}/ns/net").st_ino != target:
                continue
            if name and open(f"/proc/{pid}/comm").read().strip() != name:
                continue
        except OSError:
            continue
        found.append(pid)
    return found


def _end(proc):
    """Kill what is left of a run (its process group), waiting for it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)


@pytest.mark.timeout(240)
# A cut link (silence) is lost in test_restart_after_a_cut_link_finishes_on_the_host_left,
# which asserts the same verdict and time; a frozen rank on one host in
# tests/cluster/test_mpi.py. Here the host's processes are killed (TCP resets) or frozen
# whole, the proxy with the rank (SIGSTOP).
@pytest.mark.parametrize("how", ["kill", "stop"])
def test_losing_a_host_ends_the_run_quickly(tmp_path, how):
    """One stage per host; once both trained an epoch, the second host is lost: its rank
    killed (TCP resets) or its processes frozen (SIGSTOP). Every rank left on the first
    host must end within DETECT_LIMIT seconds, non-zero, and (stop: the heartbeat's
    verdict) name the lost rank and host."""
    h1, h2 = HOSTS[:2]
    marker = str(tmp_path / "epoch")
    log = open(tmp_path / "run.log", "w+")
    proc = hyparflow_run(f"{h1}:1,{h2}:1", "--stages", "2", args=["long", marker],
                         stdout=log, stderr=subprocess.STDOUT)
    frozen = []
    try:
        deadline = time.monotonic() + 120
        while not all(os.path.exists(f"{marker}.{r}") for r in (0, 1)):
            assert proc.poll() is None, open(tmp_path / "run.log").read()
            assert time.monotonic() < deadline, "no epoch trained in 120 s"
            time.sleep(0.2)
        tree = _tree(proc.pid)
        survivors = _on_host(tree, h1, "python")
        assert survivors, "no rank on the first host"
        start = time.monotonic()
        if how == "kill":
            for pid in _on_host(tree, h2, "python"):
                os.kill(pid, signal.SIGKILL)
        else:
            frozen = _on_host(tree, h2)   # the host's proxy and rank
            for pid in frozen:
                os.kill(pid, signal.SIGSTOP)
        seconds = None
        while proc.poll() is None:
            if seconds is None and not any(_alive(p) for p in survivors):
                seconds = time.monotonic() - start
            assert time.monotonic() - start < DETECT_LIMIT + 30, "the run is still going"
            time.sleep(0.1)
        ended = time.monotonic() - start
        seconds = ended if seconds is None else seconds
    finally:
        for pid in frozen:
            try:
                os.kill(pid, signal.SIGKILL)
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        _end(proc)
    log.seek(0)
    text = log.read()
    print(f"{how}: the ranks on {h1} ended {seconds:.1f} s after the loss, the run "
          f"(hyparflow run, exit code {proc.returncode}) {ended:.1f} s\n{text[-3000:]}")
    assert ended < DETECT_LIMIT, f"{how}: {ended:.1f} s\n{text[-3000:]}"
    assert proc.returncode != 0
    assert "finished without a failure" not in text
    if how == "kill":
        assert f"RUNNING AT {h2}" in text, text[-3000:]   # mpiexec names the host
    else:
        assert f"hyparflow: rank 0 on host {h1}: lost rank 1 on host {h2}" in text, text[-3000:]
        assert proc.returncode == 75


def _alive(pid):
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


# ------------------------------------------------------------------ Slurm across hosts

# `env` prints SLURM_CONF only when the cluster's slurmctld runs (`up 2 --slurm`).
SLURM = ENV is not None and os.path.isfile(ENV.get("SLURM_CONF", "")) \
    and ENV["SLURM_CONF"].startswith(ENV["HYPARFLOW_EMULATED_DIR"])


def _sbatch(tmp_path, *options, script_args=()):
    """Render with `hyparflow slurm`, sbatch on the emulated cluster and wait; the log."""
    from hyparflow import cli

    job_file = tmp_path / "job.sbatch"
    name = f"hf-hosts-{tmp_path.name[-8:]}"
    assert cli.main(["slurm", *options, "--time", "00:05:00", "--job-name", name,
                     "--log", str(tmp_path / "job-%j.out"), "--output", str(job_file),
                     SCRIPT, *script_args]) == 0
    code, said = sbatch_wait(job_file, ENV, tmp_path, 200)
    logs = sorted(tmp_path.glob("job-*.out"))
    log = "".join(p.read_text() for p in logs) or f"(no log; sbatch: {said})"
    print(log)
    return code, log


def _reports(directory):
    return [json.load(open(p)) for p in sorted(glob.glob(os.path.join(directory, "rank-*.json")))]


def _slurm_nodes_answer(seconds=120):
    """A link cut for longer than SlurmdTimeout leaves the node down (not responding) in
    slurmctld, and the next 2-node job would wait for it: resume such nodes and wait
    until every node answers and is free."""
    deadline = time.monotonic() + seconds
    while True:
        shown = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], capture_output=True,
                               text=True, timeout=30, env=ENV).stdout.split()
        states = dict(zip(shown[::2], shown[1::2]))
        waiting = {n: s for n, s in states.items() if s != "idle"}
        if states and not waiting:
            return
        for node, state in waiting.items():
            if state.startswith(("down", "drain")):
                subprocess.run(["scontrol", "update", f"nodename={node}", "state=resume"],
                               capture_output=True, timeout=30, env=ENV)
        assert time.monotonic() < deadline, f"Slurm nodes not back in {seconds} s: {states}"
        time.sleep(1)


slurm_only = pytest.mark.skipif(not SLURM, reason="the emulated cluster has no Slurm "
                                "(`bash scripts/emulated-cluster.sh up 2 --slurm`)")


@slurm_only
@pytest.mark.timeout(240)
def test_sbatch_array_template_on_two_nodes(tmp_path):
    """The array template on 2 nodes (one replica on each) trains to model.fit's weights,
    its ranks on the nodes Slurm gave it. (The hybrid template on 2 nodes runs in
    test_two_node_job_requeued_at_the_time_limit_resumes; the single template in
    tests/cluster/test_slurm.py.)"""
    _slurm_nodes_answer()
    h1, h2 = HOSTS[:2]
    array = tmp_path / "array"
    (tmp_path / "a").mkdir()
    code, log = _sbatch(tmp_path / "a", "--array", "0", "--nodes", "2", "--tasks-per-node", "1",
                        script_args=["contract", str(array) + "-{task}"])
    assert code == 0, log
    reports = _reports(str(array) + "-0")
    assert sorted(r["host"] for r in reports) == [h1, h2], log
    assert all(r["diff"] <= 1e-5 for r in reports), reports


# ------------------------------------------------------------------ restart on the hosts left

def _wait_for_steps(directory, ranks, step, proc, log, seconds=150):
    deadline = time.monotonic() + seconds
    while True:
        done = []
        for r in ranks:
            try:
                done.append(int(open(os.path.join(directory, f"step-{r}")).read() or 0))
            except (OSError, ValueError):
                done.append(0)
        if min(done) >= step:
            return
        assert proc.poll() is None, open(log).read()[-4000:]
        assert time.monotonic() < deadline, f"no step {step} in {seconds} s"
        time.sleep(0.2)


@pytest.mark.timeout(300)
def test_restart_after_a_cut_link_finishes_on_the_host_left(tmp_path):
    """2 stages, one per host, Adam, a checkpoint every 2 steps; once both ranks are past
    step 7 (so the checkpoint of step 6, written after step 6's callbacks, is whole) the
    second host's link is cut. `--restarts 1`: the first host's rank ends
    (heartbeat), the probe finds the second host lost, the run starts again on the first
    host alone with 1 stage and resumes from the newest checkpoint; its final weights are
    those of plain model.fit continued from that checkpoint (weights and Adam's state)."""
    h1, h2 = HOSTS[:2]
    out, log = tmp_path / "out", tmp_path / "run.log"
    env = dict(ENV, HYPARFLOW_PEER_TIMEOUT="8", HYPARFLOW_PROBE_SECONDS="5")
    argv = [sys.executable, "-m", "hyparflow", "run", "--hosts", f"{h1}:1,{h2}:1", "--stages",
            "2", "--restarts", "1", SCRIPT, "resumable", str(out)]
    proc = subprocess.Popen(argv, env=env, cwd=ROOT, text=True, start_new_session=True,
                            stdout=open(log, "w"), stderr=subprocess.STDOUT)
    verdict = f"hyparflow: rank 0 on host {h1}: lost rank 1 on host {h2}"
    try:
        _wait_for_steps(out, (0, 1), 7, proc, log)
        subprocess.run(["bash", CLUSTER, "cut", h2], check=True, timeout=20)
        cut = time.monotonic()
        # The first run ends on the heartbeat's verdict, as any lost host ends a run.
        while verdict not in log.read_text() and proc.poll() is None:
            assert time.monotonic() - cut < DETECT_LIMIT, \
                f"no verdict {DETECT_LIMIT} s after the cut\n{log.read_text()[-4000:]}"
            time.sleep(0.2)
        named = time.monotonic() - cut
        proc.wait(timeout=200)
        seconds = time.monotonic() - cut
    finally:
        subprocess.run(["bash", CLUSTER, "heal", h2], timeout=20)
        _end(proc)
        if SLURM:
            _slurm_nodes_answer()
    text = log.read_text()
    print(f"lost rank named {named:.1f} s, restarted and finished {seconds:.1f} s after the "
          f"cut\n{text[-4000:]}")
    assert proc.returncode == 0, text[-4000:]
    assert verdict in text, text[-4000:]
    assert f"{h1} answers, {h2} LOST (no answer)" in text, text[-4000:]
    assert f"restart 1 of 1 (lost {h2}): 1 stage x 1 replica on {h1}:1 (was 2 stages x " \
           f"1 replica on {h1}:1,{h2}:1)" in text, text[-4000:]
    assert f"finished after 1 restart (lost {h2}), on 1 stage x 1 replica on {h1}:1" in text
    result = json.load(open(out / "result.json"))
    assert result["host"] == h1 and result["ranks"] == 1 and result["stages"] == 1, result
    assert result["resumed"] and f"resuming from {result['resumed']}" in text, text[-4000:]
    # It resumed from step 6's checkpoint or later (the cut came after it), not from the
    # beginning.
    assert result["iterations_at_resume"] >= 6, result
    assert result["iterations"][0] == result["iterations"][1] == 32, result
    assert result["diff"] <= 1e-5, result


@slurm_only
@pytest.mark.timeout(420)
def test_two_node_job_requeued_at_the_time_limit_resumes(tmp_path):
    """The hybrid template on 2 nodes (a stage on each, Adam, a checkpoint every 2 steps).
    Mid-run the batch script gets USR1, as `--signal=B:USR1@lead` sends it before the time
    limit: the ranks checkpoint and exit 75, the script requeues the job, and Slurm starts
    it again on the 2 nodes; it resumes from that checkpoint and finishes with the weights
    of plain model.fit continued from the checkpoint."""
    from hyparflow import cli

    _slurm_nodes_answer()
    out, log = tmp_path / "out", tmp_path / "job.out"
    job_file = tmp_path / "job.sbatch"
    name = f"hf-requeue-{tmp_path.name[-8:]}"
    assert cli.main(["slurm", "--nodes", "2", "--tasks-per-node", "1", "--stages", "2",
                     "--time", "00:05:00", "--job-name", name, "--log", str(log),
                     "--output", str(job_file), SCRIPT, "resumable", str(out)]) == 0
    submitted = subprocess.run(["sbatch", "--parsable", str(job_file)], capture_output=True,
                               text=True, timeout=30, env=ENV, cwd=tmp_path)
    assert submitted.returncode == 0, submitted.stderr
    job = submitted.stdout.strip().split(";")[0]

    def state():
        return subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True,
                              text=True, timeout=30, env=ENV).stdout.strip()

    try:
        deadline = time.monotonic() + 60
        while state() != "RUNNING":
            assert state(), f"job {job} ended before it ran\n{log.read_text() if log.exists() else ''}"
            why = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T %r"], capture_output=True,
                                 text=True, timeout=30, env=ENV).stdout.strip()
            assert time.monotonic() < deadline, f"job {job} not running in 60 s: {why}"
            time.sleep(0.5)
        deadline = time.monotonic() + 150
        while True:
            steps = []
            for r in (0, 1):
                try:
                    steps.append(int((out / f"step-{r}").read_text() or 0))
                except (OSError, ValueError):
                    steps.append(0)
            if min(steps) >= 5:
                break
            assert state(), f"the job ended before step 5\n{log.read_text() if log.exists() else ''}"
            assert time.monotonic() < deadline, \
                f"no step 5 in 150 s (steps {steps}, job {state()})\n" \
                f"{log.read_text()[-4000:] if log.exists() else '(no log)'}"
            time.sleep(0.2)
        signalled = time.monotonic()
        subprocess.run(["scancel", "--batch", "--signal=USR1", job], check=True, timeout=30,
                       env=ENV)
        while state():
            assert time.monotonic() - signalled < 200, f"job {job} still {state()}"
            time.sleep(1)
        seconds = time.monotonic() - signalled
    finally:
        subprocess.run(["scancel", job], env=ENV, timeout=30)
    text = log.read_text()
    print(f"requeued and finished {seconds:.1f} s after USR1\n{text[-4000:]}")
    assert "(checkpointed before the time limit, or a lost node): requeueing job" in text, \
        text[-4000:]
    assert text.count(f"hyparflow: job {job} on") == 2, text[-4000:]
    result = json.load(open(out / "result.json"))
    assert result["resumed"] and f"resuming from {result['resumed']}" in text, text[-4000:]
    assert result["ranks"] == 2 and result["stages"] == 2, result
    assert [(out / f"host-{r}").read_text() for r in (0, 1)] == list(HOSTS[:2]), log

    assert result["iterations_at_resume"] >= 5, result
    assert result["iterations"][0] == result["iterations"][1] == 32, result
    assert result["diff"] <= 1e-5, result


def _address(host):
    path = os.path.join(os.environ.get("HYPARFLOW_EMU_DIR", "/tmp/hyparflow-emu"), "hosts")
    return dict(line.split()[:2] for line in open(path) if line.strip())[host]


def _serve(host, *args):
    """`hyparflow data-service ARGS` on `host`: (process, the address it printed)."""
    proc = subprocess.Popen(["bash", CLUSTER, "exec", host, sys.executable, "-m", "hyparflow",
                             "data-service", *args], env=ENV, cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    line = proc.stdout.readline()
    assert line.startswith("hyparflow data-service: "), (line, proc.poll())
    return proc, line.split()[3]


@pytest.mark.timeout(420)
def test_training_on_one_host_from_a_data_service_on_another():
    """Host B runs `hyparflow data-service` (a dispatcher and a worker, each told host B's
    address); 2 ranks on host A train from it over TCP (tests/mpi/test_service_mpi.py,
    Adam, S=1 R=2 and S=2 M=2): the exact mode's weights are those of reading in place.
    SIGTERM then stops both cleanly."""
    import shutil

    h1, h2 = HOSTS[:2]
    address = _address(h2)
    dispatcher, target = _serve(h2, "--dispatcher", "--host", address)
    procs = [dispatcher]
    try:
        procs.append(_serve(h2, "--worker", target, "--host", address)[0])
        mpiexec = shutil.which("mpiexec", path=os.path.dirname(sys.executable))
        env = dict(ENV, HYPARFLOW_TEST_DATA_SERVICE=target, HYPARFLOW_INTER_OP_THREADS="1",
                   HYPARFLOW_TIMEOUT="120")
        out = subprocess.run([mpiexec, "-hosts", f"{h1}:2", "-n", "2", sys.executable, "-m",
                              "pytest", "--with-mpi", "-q", "-s", "-p", "no:cacheprovider",
                              os.path.join(ROOT, "tests", "mpi", "test_service_mpi.py")],
                             env=env, cwd=os.path.join(ROOT, "tests"), capture_output=True,
                             text=True, timeout=360)
        assert out.returncode == 0 and "2 passed" in out.stdout, \
            out.stdout[-4000:] + out.stderr[-4000:]
        assert "data service S=2 R=1 M=2: max weight difference" in out.stdout
    finally:
        for proc in procs[::-1]:
            proc.terminate()   # the `exec` wrapper execs the service: SIGTERM reaches it
            try:
                proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                _end(proc)
    assert all(proc.returncode == 0 for proc in procs), [p.returncode for p in procs]
