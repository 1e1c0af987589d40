"""Real Slurm jobs: render a template, submit it and wait for it, check the trained model.

Needs a reachable cluster: the one of scripts/slurm-cluster.sh (found through $SLURM_CONF
or $HYPARFLOW_SLURM_DIR/slurm.conf, default /tmp/hyparflow-slurm/slurm.conf); otherwise
every test here is skipped with the reason. Each job is the digits example for 2 epochs.
"""

import os
import re
import shutil
import socket
import subprocess
import uuid

import pytest

from conftest import sbatch_wait

from hyparflow import cli

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples", "digits_resnet.py")
JOB_TIMEOUT = 270


def _controller_down(conf):
    """Why slurmctld cannot be reached, found in a second (sinfo retries for ~10 s), or ''."""
    try:
        text = open(conf).read()
    except OSError as error:
        return f"cannot read {conf}: {error}"
    host = re.search(r"^\s*(?:SlurmctldHost|ControlMachine)\s*=\s*([^\s(#]+)(?:\(([^)]+)\))?",
                     text, re.M | re.I)
    port = re.search(r"^\s*SlurmctldPort\s*=\s*(\d+)", text, re.M | re.I)
    if not host:
        return ""   # e.g. a configless cluster: let sinfo find out
    address, port = host.group(2) or host.group(1), int(port.group(1)) if port else 6817
    try:
        socket.create_connection((address, port), timeout=1).close()
    except OSError as error:
        return f"slurmctld not listening at {address}:{port} ({error.strerror or error})"
    return ""


def _find_cluster():
    """(environment for Slurm commands, node CPUs) or (None, reason)."""
    if shutil.which("sbatch") is None or shutil.which("sinfo") is None:
        return None, "no Slurm commands (sbatch, sinfo) on PATH"
    conf = os.environ.get("SLURM_CONF")
    if not conf:
        candidate = os.path.join(os.environ.get("HYPARFLOW_SLURM_DIR", "/tmp/hyparflow-slurm"),
                                 "slurm.conf")
        if not os.path.isfile(candidate):
            return None, (f"no Slurm cluster configured: SLURM_CONF unset and no {candidate} "
                          f"(start one with `bash scripts/slurm-cluster.sh up`)")
        conf = candidate
    down = _controller_down(conf)
    if down:
        return None, f"no Slurm cluster reachable (SLURM_CONF={conf}): {down}"
    env = dict(os.environ, SLURM_CONF=conf)
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%T %c"], capture_output=True, text=True,
                             timeout=20, env=env)
    except subprocess.TimeoutExpired:
        return None, f"sinfo timed out (SLURM_CONF={conf})"
    if out.returncode != 0:
        return None, (f"no Slurm cluster reachable (SLURM_CONF={conf}): "
                      f"{out.stderr.strip().splitlines()[-1] if out.stderr.strip() else 'sinfo failed'}")
    nodes = [line.split() for line in out.stdout.splitlines() if line.strip()]
    usable = [int(cpus) for state, cpus in nodes
              if state.rstrip("*~#") in ("idle", "mixed", "allocated", "completing")]
    if not usable:
        return None, f"no Slurm node up (SLURM_CONF={conf}): {out.stdout.strip()}"
    return env, max(usable)


SLURM_ENV, NODE_CPUS = _find_cluster()
pytestmark = [pytest.mark.mpiexec, pytest.mark.skipif(SLURM_ENV is None, reason=str(NODE_CPUS))]


def run_job(tmp_path, *options, script_args=()):
    """Render with `hyparflow slurm`, sbatch it and wait; return (exit code, log text, model path)."""
    name = f"hf-test-{uuid.uuid4().hex[:8]}"
    job_file = tmp_path / "job.sbatch"
    model = tmp_path / "model.keras"
    code = cli.main(["slurm", *options, "--time", "00:10:00", "--job-name", name,
                     "--log", str(tmp_path / "job-%j.out"), "--output", str(job_file),
                     EXAMPLE, "--epochs", "1", "--save", str(model), *script_args])
    assert code == 0
    code, said = sbatch_wait(job_file, SLURM_ENV, tmp_path, JOB_TIMEOUT)
    logs = sorted(tmp_path.glob("job-*.out"))
    log = logs[0].read_text() if logs else f"(no job log; sbatch said {said})"
    print(log)
    return code, log, model


def check_trained(code, log, model, ranks, stages):
    assert code == 0, log
    assert "test accuracy" in log, log
    assert f"{stages} stages x {ranks // stages} replicas" in log
    assert f"{ranks} ranks" in log       # the template's own start line
    assert model.is_file(), log
    import keras

    loaded = keras.saving.load_model(model)
    assert loaded.name == "digits_resnet"
    assert loaded.output_shape == (None, 10)


pytestmark = [*pytestmark, pytest.mark.filterwarnings(
    # A rank's saved optimizer holds only its own stage's slots (docs/concepts.md).
    "ignore:Skipping variable loading for optimizer:UserWarning")]


@pytest.mark.timeout(300)
def test_single_node_template(tmp_path):
    code, log, model = run_job(tmp_path, "--template", "single", "--tasks-per-node", "2",
                               "--stages", "2", "--microbatches", "2", script_args=["--stages", "2"])
    check_trained(code, log, model, ranks=2, stages=2)


# Four ranks per node (2 stages x 2 replicas) where the node declares 4 CPUs
# (HYPARFLOW_SLURM_CPUS=4 on a 2-core machine); otherwise two.
HYBRID_TASKS = 4 if NODE_CPUS and not isinstance(NODE_CPUS, str) and NODE_CPUS >= 4 else 2


@pytest.mark.timeout(300)
@pytest.mark.parametrize("launcher", ["srun", "mpiexec"])
def test_hybrid_template(tmp_path, launcher):
    code, log, model = run_job(tmp_path, "--template", "hybrid", "--nodes", "1",
                               "--tasks-per-node", str(HYBRID_TASKS), "--stages", "2",
                               "--microbatches", "4", "--launcher", launcher, "--overcommit",
                               script_args=["--stages", "2"])
    check_trained(code, log, model, ranks=HYBRID_TASKS, stages=2)


@pytest.mark.timeout(300)
def test_data_service_template_as_the_two_steps_of_a_plain_job(tmp_path):
    """slurm/data_service.sbatch is a heterogeneous job (training nodes + data nodes); a
    one-node cluster cannot place two components on its node (the job stays pending for
    Resources), so its steps are run as a plain job: the template without its `hetjob`
    lines starts the dispatcher and a worker as steps beside the ranks, which read from
    them (model.fit's weights, exact mode) and the steps end with the job."""
    import re

    job_file = tmp_path / "job.sbatch"
    script = os.path.join(ROOT, "tests", "cluster", "data_service_script.py")
    code = cli.main(["slurm", "--template", "data_service", "--nodes", "1",
                     "--tasks-per-node", "2", "--overcommit", "--time", "00:10:00",
                     "--job-name", f"hf-test-{uuid.uuid4().hex[:8]}",
                     "--log", str(tmp_path / "job-%j.out"), "--output", str(job_file),
                     script, str(tmp_path / "records")])
    assert code == 0
    text = job_file.read_text()
    assert "#SBATCH hetjob" in text and "--het-group=1" in text
    job_file.write_text(re.sub(r"#SBATCH hetjob\n(#SBATCH [^\n]*\n)*", "", text))
    code, said = sbatch_wait(job_file, dict(SLURM_ENV, DATA_SERVICE_PORT=str(_free_port())),
                             tmp_path, JOB_TIMEOUT)
    logs = sorted(tmp_path.glob("job-*.out"))
    log = logs[0].read_text() if logs else f"(no job log; sbatch said {said})"
    print(log[-3000:])
    assert code == 0, log[-3000:]
    assert "hyparflow data-service: dispatcher grpc://" in log
    assert "hyparflow data-service: worker " in log
    assert log.count("max weight difference") == 2


def _free_port():
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(300)
def test_run_data_workers_inside_an_allocation_start_as_steps(tmp_path):
    """`hyparflow run -n 2 --data-workers 1` in a batch job: the dispatcher and the worker
    start as steps of their own (srun --overlap), the ranks read from them (model.fit's
    weights, exact mode), and the steps are stopped when the run ends (the job then
    completes with nothing left running)."""
    import sys

    script = os.path.join(ROOT, "tests", "cluster", "data_service_script.py")
    job_file = tmp_path / "job.sbatch"
    job_file.write_text("\n".join([
        "#!/bin/bash", "#SBATCH --nodes=1", "#SBATCH --ntasks=2", "#SBATCH --overcommit",
        "#SBATCH --time=00:10:00", f"#SBATCH --job-name=hf-test-{uuid.uuid4().hex[:8]}",
        f"#SBATCH --output={tmp_path}/job-%j.out",
        f"{sys.executable} -m hyparflow run -n 2 --data-workers 1 {script} "
        f"{tmp_path / 'records'}", ""]))
    code, said = sbatch_wait(job_file, SLURM_ENV, tmp_path, JOB_TIMEOUT)
    logs = sorted(tmp_path.glob("job-*.out"))
    log = logs[0].read_text() if logs else f"(no job log; sbatch said {said})"
    print(log[-3000:])
    assert code == 0, log[-3000:]
    assert re.search(r"hyparflow run: data service grpc://\S+:\d+ \(dispatcher pid", log), log
    assert log.count("max weight difference") == 2, log[-3000:]
