"""`hyparflow run train.py` without -n: the script's model captured, the node planned
(`hyparflow plan --ranks auto`, under mpiexec) and the plan's ranks x threads launched;
run again, the cached plan is taken without profiling (hyparflow/planning/auto.py)."""

import os
import subprocess
import sys

import pytest

from hyparflow.cluster import launch

from test_mpi import FAKE_SRUN, launcher_words

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "autoplan_script.py")

pytestmark = [pytest.mark.mpiexec,
              pytest.mark.skipif(launch.find_mpiexec() is None, reason="no mpiexec")]


def _run(cache, **extra):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "HYPARFLOW_NUM_", "HYPARFLOW_THREADS"))
           and k != "HYPARFLOW_PLAN"}
    env.update(HYPARFLOW_PLAN_CACHE=str(cache), HYPARFLOW_TIMEOUT="120",
               HYPARFLOW_INTER_OP_THREADS="1", PYTHONUNBUFFERED="1", **extra)
    return subprocess.run([sys.executable, "-m", "hyparflow", "run", SCRIPT], env=env,
                          capture_output=True, text=True, timeout=900)


@pytest.mark.timeout(1200)
def test_run_without_ranks_plans_launches_and_reuses_the_plan(tmp_path):
    cache = tmp_path / "plans"
    first = _run(cache)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    lines = first.stdout.splitlines()
    # The first line: the choice, its predicted speed against one rank with all cores.
    assert lines[0].startswith("hyparflow: ") and " x " in lines[0], lines[:3]
    assert "x one rank with all" in lines[0] and "planned now, cached as" in lines[0]
    assert "planning this node" in first.stderr
    ranks, threads = [int(w) for w in lines[0].split()[1:5:3]]
    trained = [line for line in lines if line.startswith("trained:")]
    assert trained and trained[0].startswith(f"trained: {ranks} ranks x {threads} threads")
    assert float(trained[0].rsplit(" ", 1)[1]) <= 1e-5   # model.fit's weights
    logs = sorted(p.name for p in cache.iterdir() if p.suffix == ".log")
    assert len(logs) == 1
    made = os.path.getmtime(cache / logs[0])

    second = _run(cache)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    again = second.stdout.splitlines()
    assert "the cached plan" in again[0] and again[0].split(";")[0] == lines[0].split(";")[0]
    assert "planning this node" not in second.stderr   # no profiling the second time
    assert os.path.getmtime(cache / logs[0]) == made
    assert [line for line in again if line.startswith("trained:")][0].startswith(
        f"trained: {ranks} ranks x {threads} threads")

    # Inside a one-node Slurm allocation that fixed no task count: the same plan (the
    # allocation's CPUs are this machine's), started by srun with its threads per task.
    srun = tmp_path / "srun"
    shebang, rest = FAKE_SRUN.format(mpiexec=launcher_words()).split("\n", 1)
    srun.write_text(f'{shebang}\necho "srun $*" >> {tmp_path / "srun.log"}\n{rest}')
    srun.chmod(0o755)
    third = _run(cache, SLURM_JOB_ID="42", SLURM_NNODES="1",
                 SLURM_CPUS_ON_NODE=str(launch.usable_cores()),
                 PATH=f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert third.returncode == 0, third.stdout[-3000:] + third.stderr[-3000:]
    assert "the cached plan" in third.stdout.splitlines()[0]
    started = (tmp_path / "srun.log").read_text()
    assert f"-n {ranks} --cpus-per-task={threads} " in started, started
    assert [line for line in third.stdout.splitlines() if line.startswith("trained:")][0] \
        .startswith(f"trained: {ranks} ranks x {threads} threads")
