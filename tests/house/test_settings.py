"""Every HYPARFLOW_* variable: read in one place, documented, and checked."""

import os
import re

import pytest

from hyparflow import settings
from hyparflow.layout import Layout, resolve

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_docs_table_lists_every_variable_read():
    text = open(os.path.join(ROOT, "docs", "api.md")).read()
    table = text[text.index("## Environment"):].split("\n## ")[0]
    documented = set(re.findall(r"^\| `(HYPARFLOW_[A-Z_]+)` \|", table, re.M))
    assert documented == {v.name for v in settings.VARIABLES}


def test_malformed_values_name_the_variable(monkeypatch):
    monkeypatch.setenv("HYPARFLOW_TIMEOUT", "ten")
    with pytest.raises(settings.SettingError, match=r"HYPARFLOW_TIMEOUT must be a number\. "
                                                    r"Received: HYPARFLOW_TIMEOUT='ten'"):
        settings.timeout()
    monkeypatch.setenv("HYPARFLOW_OVERLAP", "yes")
    with pytest.raises(settings.SettingError, match=r"HYPARFLOW_OVERLAP must be 1, 0 or auto"):
        settings.overlap()
    monkeypatch.setenv("HYPARFLOW_NUM_STAGES", "0")
    with pytest.raises(settings.SettingError, match=r"HYPARFLOW_NUM_STAGES must be >= 1"):
        settings.layout_counts()


def test_defaults_and_values(monkeypatch):
    for v in settings.VARIABLES:
        monkeypatch.delenv(v.name, raising=False)
    assert settings.timeout() == 600 and settings.peer_timeout() == 20
    assert settings.overlap() is None and settings.transposed() is None and settings.sparse()
    monkeypatch.setenv("HYPARFLOW_TIMEOUT", "0")
    monkeypatch.setenv("HYPARFLOW_OVERLAP", "0")
    monkeypatch.setenv("HYPARFLOW_NUM_MICROBATCHES", "4")
    assert settings.timeout() is None and settings.overlap() is False
    monkeypatch.setenv("HYPARFLOW_TRANSPOSED", "1")
    assert settings.transposed() is True
    assert settings.layout_counts() == {"num_microbatches": 4}
    assert settings.layout_counts({"HYPARFLOW_NUM_STAGES": "2"}) == {"num_stages": 2}


def test_the_layout_is_resolved_in_the_documented_order(tmp_path):
    env = {"HYPARFLOW_NUM_STAGES": "4", "HYPARFLOW_NUM_MICROBATCHES": "8"}
    # The world size derives the replicas; the environment fills what the call leaves out.
    layout = resolve(8, environ=env)
    assert (layout.num_stages, layout.num_replicas, layout.num_microbatches) == (4, 2, 8)
    assert layout.origin["num_replicas"] == "the world size"
    # An argument wins over the environment.
    layout = resolve(8, num_stages=2, environ=env)
    assert (layout.num_stages, layout.num_replicas) == (2, 4)
    # A plan file wins over the environment; an argument that contradicts it is refused.
    path = tmp_path / "plan.json"
    path.write_text('{"format": "hyparflow-plan", "version": 1, "num_stages": 2, '
                    '"num_microbatches": 2, "schedule": "gpipe", '
                    '"stages": [{"layers": ["a"]}, {"layers": ["b"]}]}')
    layout = resolve(4, plan=str(path), environ=env)
    assert (layout.num_stages, layout.num_replicas, layout.num_microbatches,
            layout.schedule) == (2, 2, 2, "gpipe")
    assert resolve(4, plan=str(path), num_microbatches=2, environ=env).num_microbatches == 2
    with pytest.raises(ValueError, match=r"num_stages=4 \(the argument\) contradicts the plan"):
        resolve(4, plan=str(path), num_stages=4, environ={})
    with pytest.raises(ValueError, match=r"num_stages=3 \(this script's argument\) x "
                                         r"num_replicas=2 \(\$HYPARFLOW_NUM_REPLICAS"):
        resolve(4, num_stages=3, environ={"HYPARFLOW_NUM_REPLICAS": "2"})
    with pytest.raises(ValueError, match=r"Unknown schedule 'no-such'"):
        Layout(schedule="no-such")
    assert resolve(6, num_stages=3, num_tensor=2, environ={}).ranks == 6
