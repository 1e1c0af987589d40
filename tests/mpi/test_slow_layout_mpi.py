"""fit's warning of a slow layout (hyparflow/loop/slow.py) on one-thread ranks sharing
this node, its rates measured in the rank; run under mpiexec by
tests/cluster/test_mpi.py:

    mpiexec -n 2 python -m pytest --with-mpi tests/mpi/test_slow_layout_mpi.py
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "engine"))

import hyparflow as hf  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from mpi4py import MPI  # noqa: E402

from hyparflow import _env  # noqa: E402
from hyparflow.loop import slow  # noqa: E402
from test_nodecost import conv, wide  # noqa: E402

WORLD = MPI.COMM_WORLD
ONE_THREAD = pytest.mark.skipif(_env.configured_threads() != 1,
                                reason="the warning is for one-thread ranks")


def _fit(build, shape, batch, capsys, monkeypatch):
    monkeypatch.setattr(slow, "_warned", False)  # once per process: each test afresh
    model = build()
    model.compile(optimizer="adam", loss="mse")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2 * batch,) + shape).astype("float32")
    y = rng.normal(size=(2 * batch,) + model.output_shape[1:]).astype("float32")
    hf.fit(model, x, y, batch_size=batch, epochs=1, verbose=0)
    out = capsys.readouterr().out
    return [line for line in out.splitlines() if "hyparflow: warning: this layout" in line]


@ONE_THREAD
@pytest.mark.mpi(min_size=2)
def test_a_layout_predicted_slow_is_named_once_on_rank_0(capsys, monkeypatch):
    warned = _fit(wide, (2048,), 8, capsys, monkeypatch)
    if WORLD.Get_rank() == 0:
        assert len(warned) == 1, warned
        print("\n" + warned[0])
        seconds = float(warned[0].rsplit("(checked in ", 1)[1].split(" s)")[0])
        assert seconds <= 2.0, warned[0]
        assert "hyparflow run -n " in warned[0] and "--threads-per-rank" in warned[0]
    else:
        assert warned == []


@ONE_THREAD
@pytest.mark.mpi(min_size=2)
def test_a_layout_predicted_fast_is_not_named(capsys, monkeypatch):
    assert _fit(conv, (32, 32, 16), 32, capsys, monkeypatch) == []


@ONE_THREAD
@pytest.mark.mpi(min_size=2)
def test_the_setting_turns_the_warning_off(capsys, monkeypatch):
    monkeypatch.setenv("HYPARFLOW_LAYOUT_WARNING", "0")
    assert _fit(wide, (2048,), 8, capsys, monkeypatch) == []
