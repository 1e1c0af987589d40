"""Threads per rank derived from what the node allows (hyparflow/_env.py, engine/node.py)."""

import os

import pytest

from hyparflow import _env, settings
from hyparflow.engine import node


@pytest.mark.parametrize("cores,node_cores,local,quota,slurm,expected", [
    (16, 16, 1, None, None, 16),    # one rank: every core
    (16, 16, 4, None, None, 4),     # unbound ranks share the node's cores
    (16, 16, 16, None, None, 1),
    (2, 2, 4, None, None, 1),       # more ranks than cores: one thread each, not zero
    (4, 16, 4, None, None, 4),      # bound by the launcher: its cores are its own
    (16, 16, 2, 4.0, None, 2),      # a cgroup quota of 4 cores shared by 2 ranks
    (16, 16, 1, 2.5, None, 2),      # a fractional quota: whole threads below it
    (16, 16, 4, 0.5, None, 1),
    (4, 16, 4, 8.0, None, 2),       # bound to 4, but the container's 8 cores are shared by 4
    (8, 64, 8, None, 8, 8),         # Slurm's SLURM_CPUS_PER_TASK
    (4, 64, 8, None, 8, 4),         # ... never more than the cores the task may use
])
def test_derived_threads(cores, node_cores, local, quota, slurm, expected):
    assert _env.derive_threads(cores, node_cores, local, quota, slurm) == expected


def test_cgroup_quota_v2_and_v1(tmp_path):
    (tmp_path / "cpu.max").write_text("250000 100000\n")
    assert _env.cpu_quota(str(tmp_path)) == 2.5
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert _env.cpu_quota(str(tmp_path)) is None
    os.remove(tmp_path / "cpu.max")
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("300000\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert _env.cpu_quota(str(tmp_path)) == 3.0
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert _env.cpu_quota(str(tmp_path)) is None
    assert _env.cpu_quota(str(tmp_path / "missing")) is None


def test_setting_and_its_older_name():
    assert settings.threads({"HYPARFLOW_THREADS_PER_RANK": "3"}) == 3
    assert settings.threads({"HYPARFLOW_THREADS": "5"}) == 5
    assert settings.threads({"HYPARFLOW_THREADS": "5", "HYPARFLOW_THREADS_PER_RANK": "2"}) == 2
    assert settings.threads({}) is None
    with pytest.raises(settings.SettingError, match="HYPARFLOW_THREADS_PER_RANK must be >= 1"):
        settings.threads({"HYPARFLOW_THREADS_PER_RANK": "0"})


def test_derived_from_the_launchers_count(monkeypatch):
    monkeypatch.delenv("HYPARFLOW_THREADS_PER_RANK", raising=False)
    monkeypatch.delenv("HYPARFLOW_THREADS", raising=False)
    monkeypatch.delenv("SLURM_STEP_ID", raising=False)
    monkeypatch.setenv("MPI_LOCALNRANKS", "2")
    cores = len(_env.my_cores())
    expected = _env.derive_threads(cores, os.cpu_count(), 2, _env.cpu_quota())
    assert _env.threads_per_rank() == expected
    assert "ranks on this node" in _env.threads_source() or cores < os.cpu_count()
    monkeypatch.setenv("HYPARFLOW_THREADS_PER_RANK", "7")
    assert _env.threads_per_rank() == 7
    assert _env.threads_source() == "HYPARFLOW_THREADS_PER_RANK"


def test_unbound_ranks_get_disjoint_cores():
    assert node.pin_slices([0, 1, 2, 3], 2, 2) == [[0, 1], [2, 3]]
    assert node.pin_slices([4, 5, 6, 7], 4, 1) == [[4], [5], [6], [7]]
    assert node.pin_slices([0, 1], 4, 1) is None   # more ranks than cores: not pinned
    assert node.pin_slices([0, 1, 2, 3], 1, 4) is None   # one rank: nothing to share
