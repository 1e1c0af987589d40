"""`hyparflow run --restarts`: the re-shape rule (pure) and the restart loop on one machine.

The restart across hosts after a lost host, with the weights checked against model.fit,
is tests/hosts/test_hosts_emulated.py::test_restart_after_a_cut_link_finishes_on_the_host_left.
"""

import os
import subprocess
import sys

import pytest

from hyparflow.cluster import launch
from hyparflow.cluster.restart import (RestartError, describe_shape, host_slots, pipelines_within,
                                      reshape, restartable)
from hyparflow.layout import Layout

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def placed(stages, replicas, tensor, hosts, within):
    """The expected layout: (stages, replicas, tensor) on [(host, ranks)], and whether every
    pipeline is on one host."""
    return Layout(num_stages=stages, num_replicas=replicas, num_tensor=tensor,
                  hosts=tuple(h for h, n in hosts for _ in range(n))), within


@pytest.mark.parametrize("slots,layout,expected", [
    # Everything still there: the same layout.
    ([("a", 4), ("b", 4)], (2, 4, 1), placed(2, 4, 1, (("a", 4), ("b", 4)), True)),
    # A host lost: fewer replicas first, the pipelines still within a host.
    ([("a", 4)], (2, 4, 1), placed(2, 2, 1, (("a", 4),), True)),
    ([("a", 3), ("c", 3)], (2, 4, 1), placed(2, 2, 1, (("a", 2), ("c", 2)), True)),
    ([("a", 3), ("c", 3)], (3, 4, 1), placed(3, 2, 1, (("a", 3), ("c", 3)), True)),
    # No pipeline fits on one host: one spanning hosts, before fewer stages.
    ([("a", 1), ("c", 1)], (2, 2, 1), placed(2, 1, 1, (("a", 1), ("c", 1)), False)),
    # Not even one pipeline: fewer stages (the layer partition is recomputed).
    ([("a", 1)], (2, 1, 1), placed(1, 1, 1, (("a", 1),), True)),
    ([("a", 3)], (4, 1, 1), placed(3, 1, 1, (("a", 3),), True)),
    ([("a", 1), ("b", 1)], (4, 2, 1), placed(2, 1, 1, (("a", 1), ("b", 1)), False)),
    # Never more replicas than before, even when stages went.
    ([("a", 5)], (3, 1, 1), placed(3, 1, 1, (("a", 3),), True)),
    # Tensor ranks go last, after the stages.
    ([("a", 2)], (2, 1, 2), placed(1, 1, 2, (("a", 2),), True)),
    ([("a", 1)], (1, 2, 2), placed(1, 1, 1, (("a", 1),), True)),
])
def test_reshape_drops_replicas_then_stages_then_tensor(slots, layout, expected):
    got = reshape(slots, *layout)
    assert (got, pipelines_within(got)) == expected
    assert got.ranks == len(got.hosts) == sum(n for _, n in host_slots(got))


def test_reshape_refuses_nothing_left():
    with pytest.raises(RestartError, match="no host is left"):
        reshape([("a", 0)], 2, 1)
    with pytest.raises(RestartError, match="stages must be at least 1. Received: 0"):
        reshape([("a", 2)], 0, 1)


def test_describe_shape():
    assert describe_shape(placed(2, 1, 1, (("a", 1), ("b", 1)), False)[0]) == \
        "2 stages x 1 replica on a:1,b:1"
    assert describe_shape(placed(1, 3, 2, (("a", 6),), True)[0]) == \
        "1 stage x 3 replicas x 2 tensor ranks on a:6"


def test_restartable():
    assert not restartable(0, [])
    assert restartable(75, [])              # a lost peer (the heartbeat), or preempted
    assert restartable(137, [])             # a rank killed
    assert not restartable(1, [])           # the script's own error: it would fail again
    assert restartable(1, ["b"])            # ... unless a host went


def test_a_plan_file_follows_a_restart_on_fewer_ranks(tmp_path):
    """`fit(plan=...)` after `hyparflow run --restarts` lost ranks: the plan's stages
    and cut stay with fewer replicas; when its stages no longer divide the ranks,
    fewer stages cut by estimate. Without the restart's mark, a mismatch is an error."""
    import warnings

    from hyparflow.layout import resolve

    path = tmp_path / "plan.json"
    path.write_text('{"format": "hyparflow-plan", "version": 1, "num_stages": 2, '
                    '"num_replicas": 2, "num_microbatches": 4, "schedule": "zb-h1", '
                    '"stages": [{"layers": ["a"]}, {"layers": ["b"]}]}')
    with pytest.raises(ValueError, match="num_replicas=2"):
        resolve(2, plan=str(path), environ={})
    mark = {"HYPARFLOW_RESHAPED": "4->2"}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fewer = resolve(2, plan=str(path), environ=mark)
        assert (fewer.num_stages, fewer.num_replicas, fewer.num_microbatches,
                fewer.schedule) == (2, 1, 4, "zb-h1")
        assert fewer.plan is not None                       # its cut still applies
        one = resolve(1, plan=str(path), environ={"HYPARFLOW_RESHAPED": "4->1"})
        assert (one.num_stages, one.num_replicas, one.num_microbatches) == (1, 1, 4)
        assert one.plan is None                             # cut again, by estimate
    assert any("num_replicas=1 and its stages as planned" in str(w.message) for w in caught)
    assert any("num_stages=1, one replica" in str(w.message) for w in caught)
    assert resolve(4, plan=str(path), environ=mark).num_replicas == 2  # nothing lost
    # A plan that leaves the replicas to the world size: 3 ranks left of 4 at S=2.
    path.write_text('{"format": "hyparflow-plan", "version": 1, "num_stages": 2, '
                    '"num_microbatches": 2, "stages": [{"layers": ["a"]}, {"layers": ["b"]}]}')
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        three = resolve(3, plan=str(path), environ={"HYPARFLOW_RESHAPED": "4->3"})
    assert (three.num_stages, three.num_replicas, three.plan) == (3, 1, None)


def test_the_restart_after_a_lost_host_marks_the_run_reshaped(monkeypatch):
    from hyparflow.cluster import restart

    monkeypatch.setattr(restart, "probe", lambda hosts, *a, **k: {h: h != "b" for h in hosts})
    lines, codes = [], iter([75, 0])

    def make_line(on, stages, replicas, tensor):
        return launch.CommandLine("mpiexec", ["mpiexec"], {}, layout=f"{on}")

    def start(line, lost):
        lines.append(line)
        return next(codes)

    assert restart.run(make_line, start, 1, [("a", 2), ("b", 2)], 1, 4, 1, "mpiexec",
                       set()) == 0
    assert "HYPARFLOW_RESHAPED" not in lines[0].env
    assert lines[1].env["HYPARFLOW_RESHAPED"] == "4->2"


# ------------------------------------------------------------------ the loop, real launches

FLAKY = """
import os, signal, sys
marker = sys.argv[1]
runs = int(open(marker).read()) if os.path.exists(marker) else 0
open(marker, "w").write(str(runs + 1))
print(f"attempt {runs + 1} stages={os.environ.get('HYPARFLOW_NUM_STAGES')}", flush=True)
if runs < int(sys.argv[2]):
    os.kill(os.getpid(), getattr(signal, sys.argv[3]))   # e.g. killed by the OOM killer
sys.exit(int(sys.argv[4]) if runs < int(sys.argv[2]) else 0)
"""


def _run(tmp_path, *options, failures=1, how="SIGKILL", code=0):
    script = tmp_path / "flaky.py"
    script.write_text(FLAKY)
    marker = tmp_path / "runs"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "HYPARFLOW_NUM"))}
    out = subprocess.run([sys.executable, "-m", "hyparflow", "run", "-n", "1", *options,
                          str(script), str(marker), str(failures), how, str(code)],
                         capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    return out, int(marker.read_text())


def pytestmark_mpi(test):
    return pytest.mark.mpiexec(pytest.mark.skipif(launch.find_mpiexec() is None,
                                                  reason="no mpiexec")(test))


@pytestmark_mpi
@pytest.mark.timeout(150)
def test_a_killed_run_is_restarted_with_the_same_ranks(tmp_path):
    out, runs = _run(tmp_path, "--stages", "1", "--restarts", "2", failures=1)
    assert out.returncode == 0, out.stderr
    assert runs == 2
    assert "hyparflow run: restart 1 of 2 (exit code" in out.stderr, out.stderr
    assert "finished after 1 restart" in out.stderr
    assert "attempt 2 stages=1" in out.stdout


@pytestmark_mpi
@pytest.mark.timeout(150)
def test_restarts_run_out_and_a_script_error_is_not_restarted(tmp_path):
    out, runs = _run(tmp_path, "--restarts", "1", failures=5)
    assert out.returncode != 0 and runs == 2, out.stderr
    assert "no restart left (--restarts 1)" in out.stderr, out.stderr
    (tmp_path / "b").mkdir()
    out, runs = _run(tmp_path / "b", "--restarts", "3", failures=5, how="SIGCONT", code=1)
    assert out.returncode == 1 and runs == 1, out.stderr
    assert "an error of the script, every host answering): not restarting" in out.stderr


def test_restarts_refused_under_srun_and_negative(capsys, monkeypatch, tmp_path):
    from hyparflow import cli

    script = tmp_path / "t.py"
    script.write_text("")
    assert cli.main(["run", "-n", "1", "--restarts", "-1", str(script)]) == 2
    assert "--restarts must be 0 or more. Received: -1" in capsys.readouterr().err
    srun = tmp_path / "bin" / "srun"     # a Slurm job's srun (never run: refused first)
    srun.parent.mkdir()
    srun.write_text("#!/bin/sh\nexit 99\n")
    srun.chmod(0o755)
    monkeypatch.setenv("PATH", f"{srun.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "1")
    assert cli.main(["run", "-n", "1", "--restarts", "1", str(script)]) == 2
    err = capsys.readouterr().err
    assert "--restarts is for mpiexec runs; inside a Slurm job the templates restart" in err


# ------------------------------------------------------------------ heartbeat neighbours

@pytest.mark.parametrize("size", [2, 3, 4, 5, 8, 9, 16, 64, 1000])
def test_heartbeat_neighbours_few_symmetric_and_see_any_lost_host(size):
    """At most 4 neighbours a rank; symmetric (who beats to whom is who watches whom);
    and whatever block of consecutive ranks (a host) is lost, some rank that remains
    watches one of them."""
    from hyparflow.cluster.heartbeat import neighbours

    table = {r: neighbours(r, size) for r in range(size)}
    for r, peers in table.items():
        assert r not in peers and 1 <= len(peers) <= min(4, size - 1), (r, peers)
        assert all(r in table[p] for p in peers), (r, peers)
    assert sum(len(p) for p in table.values()) <= 4 * size     # O(N), not N^2
    for per_host in {1, 2, max(1, size // 4), max(1, size // 2)}:
        for first in range(0, size, per_host):
            lost = set(range(first, min(size, first + per_host)))
            if len(lost) == size:
                continue
            watchers = {r for r in range(size) if r not in lost and set(table[r]) & lost}
            assert watchers, (size, sorted(lost))
            # The half-way partners: a lost half is also seen beyond its ring ends.
            if size >= 8 and per_host == 2:
                assert len(watchers) >= 3, (size, sorted(lost), watchers)


def test_the_hosts_a_heartbeat_report_names():
    line = ("hyparflow: rank 0 on host n1: lost rank 2 on host n2, rank 3 on host n2, rank 4 "
            "on host n3.x (silent for more than 20 s, found by rank 1: the hosts n2, n3.x "
            "died, froze or lost its network; HYPARFLOW_PEER_TIMEOUT).\n")
    assert launch.named_hosts(line) == ["n2", "n3.x"]
    assert launch.named_hosts("hyparflow: rank 0 on host n1: lost rank 1 on host n2 (x)") == ["n2"]
    assert launch.named_hosts("epoch 1: lost 0.5 on host a") == []


def test_restarts_dry_run_says_what_it_would_probe(capsys, tmp_path, monkeypatch):
    from hyparflow import cli

    for name in list(os.environ):
        if name.startswith(("SLURM_", "HYPARFLOW_NUM")):
            monkeypatch.delenv(name)
    script = tmp_path / "t.py"
    script.write_text("")
    assert cli.main(["run", "--hosts", "a:1,b:1", "--stages", "2", "--restarts", "1",
                     "--dry-run", str(script)]) == 0
    out = capsys.readouterr().out
    assert "-hosts a:1,b:1 -n 2 " in out
    assert "# --restarts 1: after a failure, probe a, b and start again on what answers" in out
