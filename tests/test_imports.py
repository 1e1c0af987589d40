"""The layering rules (docs/architecture.md): pure modules import neither TF nor MPI,
the engine imports nothing of the planning wing, imports point down (no cycles), and
only `hyparflow.settings` reads HYPARFLOW_* variables."""

import ast
import pathlib
import subprocess
import sys

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "hyparflow"

RULES = {
    "hyparflow.settings": ["tensorflow", "mpi4py", "keras"],
    "hyparflow.layout": ["tensorflow", "mpi4py", "keras"],
    "hyparflow.plan": ["tensorflow", "mpi4py", "keras"],
    "hyparflow.planner": ["tensorflow", "mpi4py", "keras"],
    "hyparflow.clock": ["tensorflow", "mpi4py", "keras"],
    "hyparflow.schedule": ["tensorflow", "mpi4py", "keras"],
    "hyparflow.topology": ["tensorflow", "mpi4py", "keras"],
    "hyparflow.sync": ["tensorflow", "mpi4py", "keras"],
    "hyparflow.replicas": ["tensorflow", "mpi4py", "keras"],
    "hyparflow.balance": ["tensorflow", "mpi4py", "keras"],
    "hyparflow.comm": ["tensorflow", "keras"],
    "hyparflow.hosts": ["tensorflow", "mpi4py", "keras"],
    "hyparflow.heartbeat": ["tensorflow", "keras"],
    "hyparflow.calls": ["tensorflow", "keras"],
    "hyparflow.restart": ["tensorflow", "mpi4py", "keras"],
    "hyparflow.normaliser": ["tensorflow", "mpi4py", "keras"],
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


# The planning wing measures and models; the engine trains. The engine must run
# without it (and a change there must not reach a training run).
PLANNING = {"planner", "measure", "probes", "profile", "costs"}
ENGINE = {"stage", "executor", "runtime", "overlap", "sparse", "boundary", "kernels", "tensor",
          "comm", "local", "partition", "graph", "topology", "schedule", "weights",
          "heartbeat", "calls", "data", "logs", "errors", "checkpoint", "timeline", "inference", "zero",
          "replicas", "sync", "layers",
          "layout", "settings", "clock", "_compat", "_env", "normaliser", "customised"}


def _imports(path, top_level_only=False):
    """Sibling modules `path` imports (`from . import x`, `from .x import y`)."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    found = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                found.add(node.module.split(".")[0])
            else:
                found.update(a.name for a in node.names)
    return found


def test_the_engine_imports_nothing_of_the_planning_wing():
    assert ENGINE | PLANNING <= {p.stem for p in PACKAGE.glob("*.py")}
    offending = {m: sorted(_imports(PACKAGE / f"{m}.py") & PLANNING) for m in sorted(ENGINE)}
    assert not {m: v for m, v in offending.items() if v}, offending


def test_module_level_imports_have_no_cycle():
    graph = {p.stem: _imports(p, top_level_only=True) for p in PACKAGE.glob("*.py")}
    state = {}

    def visit(module, path):
        if state.get(module) == "done":
            return
        assert state.get(module) != "open", f"import cycle: {' -> '.join(path + [module])}"
        state[module] = "open"
        for other in sorted(graph.get(module, ())):
            visit(other, path + [module])
        state[module] = "done"

    for module in sorted(graph):
        visit(module, [])


def _reads_setting(node):
    """Whether `node` reads an environment variable named HYPARFLOW_...: environ.get(
    "HYPARFLOW_X"), environ["HYPARFLOW_X"], os.getenv(...), f-strings included."""
    def named(arg):
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            return arg.value.startswith("HYPARFLOW_")
        if isinstance(arg, ast.JoinedStr) and arg.values:
            first = arg.values[0]
            return isinstance(first, ast.Constant) and str(first.value).startswith("HYPARFLOW_")
        return False

    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
        return node.func.attr in ("get", "getenv", "pop") and named(node.args[0])
    if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
        return named(node.slice)
    return False


def test_only_settings_reads_hyparflow_variables():
    readers = {p.name: [n.lineno for n in ast.walk(ast.parse(p.read_text())) if _reads_setting(n)]
               for p in PACKAGE.glob("*.py") if p.name != "settings.py"}
    assert not {name: lines for name, lines in readers.items() if lines}, readers
    # ... and the check itself sees a read.
    assert _reads_setting(ast.parse('os.environ.get("HYPARFLOW_X", "1")').body[0].value)
    assert _reads_setting(ast.parse('env[f"HYPARFLOW_{n}"]').body[0].value)
