"""The documentation site builds with `mkdocs build --strict`: no broken links between
pages, every page in the nav, every docstring in the API reference rendered."""

import importlib.util
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("mkdocstrings") is None,
    reason="mkdocs or mkdocstrings is not installed (pip install -e \".[test]\" installs both)")


@pytest.mark.timeout(200)
def test_docs_build_strict(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict",
         "--config-file", os.path.join(ROOT, "mkdocs.yml"), "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=180)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-5000:]
    assert "WARNING" not in log, log[-5000:]
    for page in ("index.html", "reference/index.html", "performance/index.html",
                 "troubleshooting/index.html"):
        assert (tmp_path / "site" / page).is_file(), page
    reference = (tmp_path / "site" / "reference" / "index.html").read_text()
    for name in ("hyparflow.api.fit", "hyparflow.api.is_main", "hyparflow.checkpoint.export",
                 "hyparflow.checkpoint.Preempted", "hyparflow.schedule.one_f_one_b",
                 "hyparflow.timeline.bubble", "hyparflow.plan.read"):
        assert f'id="{name}"' in reference, f"{name} missing from the API reference"
