"""`hyparflow run --data-workers K`: a dispatcher and K workers started on this node for
the run, the run's ranks reading from them (model.fit's weights, exact mode), and every
one of them stopped when the run ends."""

import os
import re
import subprocess
import sys

import pytest

from test_mpi import MPIEXEC, clean_environment

HERE = os.path.dirname(os.path.abspath(__file__))
pytestmark = [pytest.mark.mpiexec, pytest.mark.timeout(600),
              pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec on PATH or beside python")]


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_run_starts_the_data_workers_and_stops_them(tmp_path):
    out = subprocess.run([sys.executable, "-m", "hyparflow", "run", "-n", "2",
                          "--data-workers", "2", os.path.join(HERE, "data_service_script.py"),
                          str(tmp_path)],
                         capture_output=True, text=True, timeout=540, env=clean_environment())
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert out.stdout.count("max weight difference") == 2, out.stdout[-3000:]
    started = re.search(r"data service grpc://localhost:\d+ \(dispatcher pid (\d+), "
                        r"worker pids (\d+) (\d+)\)", out.stdout)
    assert started, out.stdout[-3000:]
    assert not [pid for pid in map(int, started.groups()) if _alive(pid)]


def test_data_flags_are_checked_and_shown(tmp_path):
    script = tmp_path / "s.py"
    script.write_text("")
    env = clean_environment()
    shown = subprocess.run([sys.executable, "-m", "hyparflow", "run", "-n", "2", "--dry-run",
                            "--data-service", "d0:5050", "--data-service-mode", "dynamic",
                            str(script)], capture_output=True, text=True, timeout=120, env=env)
    assert shown.returncode == 0, shown.stderr
    assert "HYPARFLOW_DATA_SERVICE=grpc://d0:5050" in shown.stdout
    assert "HYPARFLOW_DATA_SERVICE_MODE=dynamic" in shown.stdout
    bad = subprocess.run([sys.executable, "-m", "hyparflow", "run", "-n", "2",
                          "--data-service", "http://d0", str(script)],
                         capture_output=True, text=True, timeout=120, env=env)
    assert bad.returncode == 2 and "grpc://HOST:PORT" in bad.stderr
