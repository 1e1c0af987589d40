"""The public API and the pure modules are type-checked (configuration: setup.cfg's
[mypy] sections)."""

import importlib.util
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.skipif(importlib.util.find_spec("mypy") is None,
                    reason="mypy is not installed (pip install -e \".[test]\" installs it)")
@pytest.mark.timeout(300)
def test_mypy_passes():
    out = subprocess.run([sys.executable, "-m", "mypy", "--config-file",
                          os.path.join(ROOT, "setup.cfg"), "--no-error-summary"],
                         cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, out.stdout[-5000:] + out.stderr[-2000:]
