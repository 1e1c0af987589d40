"""The layering rules of DESIGN.md: pure modules import neither TF nor MPI."""

import subprocess
import sys

import pytest

RULES = {
    "hyparflow.schedule": ["tensorflow", "mpi4py", "keras"],
    "hyparflow.topology": ["tensorflow", "mpi4py", "keras"],
    "hyparflow.balance": ["tensorflow", "mpi4py", "keras"],
    "hyparflow.comm": ["tensorflow", "keras"],
    "hyparflow.hosts": ["tensorflow", "mpi4py", "keras"],
    "hyparflow.heartbeat": ["tensorflow", "keras"],
    "hyparflow.restart": ["tensorflow", "mpi4py", "keras"],
}


@pytest.mark.parametrize("module,forbidden", sorted(RULES.items()))
def test_module_imports_point_down(module, forbidden):
    code = (
        "import importlib.util, sys\n"
        "spec = importlib.util.find_spec('hyparflow')\n"
        "# Load the module without running hyparflow/__init__ (which starts TF).\n"
        "import os, types; pkg = types.ModuleType('hyparflow'); pkg.__path__ = [os.path.dirname(spec.origin)]\n"
        "sys.modules['hyparflow'] = pkg\n"
        f"importlib.import_module('{module}')\n"
        f"print(sorted(m for m in {forbidden!r} if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"{module} imports {out.stdout.strip()}"


def test_stage_does_not_import_mpi():
    source = open(__import__("hyparflow.stage", fromlist=["x"]).__file__).read()
    assert "mpi4py" not in source
