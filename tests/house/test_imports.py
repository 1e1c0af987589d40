"""The layering rules (docs/architecture.md): every module sits in one layer and imports
only its own layer or those below (`ORDER`); pure modules import neither TF nor MPI;
the training path imports nothing of the planning wing, by any import, and a training
process never loads it; imports have no cycle, function-level ones included; only
`hyparflow.settings` reads HYPARFLOW_* variables."""

import ast
import pathlib
import subprocess
import sys

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "hyparflow"

RULES = {
    "hyparflow.settings": ["tensorflow", "mpi4py", "keras"],
    "hyparflow.layout": ["tensorflow", "mpi4py", "keras"],
    "hyparflow.plan": ["tensorflow", "mpi4py", "keras"],
    "hyparflow.strategy": ["tensorflow", "mpi4py", "keras"],
    "hyparflow.planning.schedule_csv": ["tensorflow", "mpi4py", "keras"],
    "hyparflow.planning.planner": ["tensorflow", "mpi4py", "keras"],
    "hyparflow.planning.costmodel": ["tensorflow", "mpi4py", "keras"],
    "hyparflow.clock": ["tensorflow", "mpi4py", "keras"],
    "hyparflow.nodecost": ["tensorflow", "mpi4py", "keras"],
    "hyparflow.schedules": ["tensorflow", "mpi4py", "keras"],
    "hyparflow.topology": ["tensorflow", "mpi4py", "keras"],
    "hyparflow.sync": ["tensorflow", "mpi4py", "keras"],
    "hyparflow.kinds.replicas": ["tensorflow", "mpi4py", "keras"],
    "hyparflow.balance": ["tensorflow", "mpi4py", "keras"],
    "hyparflow.engine.comm": ["tensorflow", "keras"],
    "hyparflow.cluster.hosts": ["tensorflow", "mpi4py", "keras"],
    "hyparflow.cluster.heartbeat": ["tensorflow", "keras"],
    "hyparflow.engine.calls": ["tensorflow", "keras"],
    "hyparflow.engine.shm": ["tensorflow", "keras"],
    "hyparflow.engine.node": ["tensorflow", "keras"],
    "hyparflow.cluster.restart": ["tensorflow", "mpi4py", "keras"],
    "hyparflow.cluster.dialect": ["tensorflow", "mpi4py", "keras"],
    "hyparflow.cluster.dataservice": ["tensorflow", "mpi4py", "keras"],
    "hyparflow.engine.normaliser": ["tensorflow", "mpi4py", "keras"],
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
    source = open(__import__("hyparflow.engine.stage", fromlist=["x"]).__file__).read()
    assert "mpi4py" not in source


# Every module of the package, in exactly one layer (docs/architecture.md). Names are
# dotted below `hyparflow` ("" is the package itself).
LAYERS = {
    "top": {"", "__main__", "cli", "layers", "sweeps", "sweeps.run", "sweeps.fuse",
            "sweeps.kinds", "sweeps.variables", "sweeps.optimizers", "sweeps.steps",
            "sweeps.members", "sweeps.table", "sweeps.attention", "sweeps.registry",
            "sweeps.conv"},
    "loop": {"loop", "loop.api", "loop.trainer", "loop.inference", "loop.progress",
             "loop.logs", "loop.costs", "loop.options", "loop.runtime",
             "loop.steps", "loop.slow", "loop.capture"},
    "readers": {"readers", "readers.columns", "readers.arrays", "readers.streams",
                "readers.context", "readers.sharded", "readers.wait", "readers.indexed",
                "readers.service"},
    "cluster": {"cluster", "cluster.launch", "cluster.slurm", "cluster.hosts",
                "cluster.heartbeat", "cluster.restart", "cluster.report", "cluster.dialect",
                "cluster.dataservice"},
    "planning": {"planning", "planning.planner", "planning.measure", "planning.probes",
                 "planning.profile", "planning.costmodel", "planning.command",
                 "planning.schedule_csv", "planning.strategy_command", "planning.search",
                 "planning.dataset", "planning.shapes", "planning.auto"},
    "engine": {"engine"} | {f"engine.{m}" for m in (
        "stage", "executor", "comm", "calls", "local", "boundary", "kernels",
        "overlap", "weights", "checkpoint", "partition", "masks", "normaliser", "customised", "coupling",
        "timeline", "errors", "grads", "body", "compiled", "timing", "prepare", "wire", "shm",
        "node", "order", "clipping", "sparse", "fill", "deferred", "groups", "norms", "steps")},
    "kinds": {"kinds", "kinds.tensor", "kinds.mesh", "kinds.zero", "kinds.zero.step",
              "kinds.zero.reduce",
              "kinds.replicas", "kinds.tables", "kinds.tables.plan", "kinds.tables.lookup",
              "kinds.tables.part", "kinds.tables.cost", "kinds.tables.idle",
              "kinds.tables.whole", "kinds.tables.auto", "kinds.tables.pooled",
              "kinds.tables.rs"}
    # A new split kind is one file there (docs/architecture.md): all of them belong here.
    | {f"kinds.{d}.{p.stem}" for d in ("tensor", "mesh")
       for p in (PACKAGE / "kinds" / d).glob("*.py") if p.stem != "__init__"},
    "schedules": {"schedules"} | {f"schedules.{m}" for m in ("actions", "builders", "table",
                                                             "lower", "simulate")},
    "base": {"_compat", "_compat.loss", "_compat.adapters", "_env", "graph"},
    "pure": {"layout", "plan", "strategy", "balance", "topology", "sync", "settings", "clock", "flat",
             "nodecost"},
}
# What a training process runs: it must not reach the planning wing, by any import.
TRAINING = {"layers"} | LAYERS["loop"] | LAYERS["readers"] | LAYERS["engine"] | LAYERS["kinds"] \
    | LAYERS["schedules"] | LAYERS["base"] | LAYERS["pure"]


def _modules():
    """{dotted name below hyparflow: path} of every module of the package."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(name, path, modules):
    """The package's modules `name` imports, at any depth of its code (functions too):
    `from . import x`, `from ..x import y`, `import hyparflow.x`, `from hyparflow.x import y`."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    package = [p for p in package if p]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [(a.name, []) for a in node.names if a.name.split(".")[0] == "hyparflow"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1] if node.level > 1 else package
                module = ".".join(["hyparflow"] + base + ([node.module] if node.module else []))
            elif (node.module or "").split(".")[0] == "hyparflow":
                module = node.module
            else:
                continue
            targets = [(module, [a.name for a in node.names])]
        else:
            continue
        for module, names in targets:
            dotted = module.split(".", 1)[1] if "." in module else ""
            subs = [f"{dotted}.{n}".lstrip(".") for n in names]
            hits = [s for s in subs if s in modules]
            found.update(hits or [dotted])
    found.discard(name)
    return {m for m in found if m in modules}


def _graph():
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def test_every_module_is_in_exactly_one_layer():
    names = set(_modules())
    placed = [m for layer in LAYERS.values() for m in layer]
    twice = sorted({m for m in placed if placed.count(m) > 1})
    assert not twice, f"modules in two layers: {twice}"
    assert not names - set(placed), f"modules in no layer: {sorted(names - set(placed))}"
    assert not set(placed) - names, f"layers name missing modules: {sorted(set(placed) - names)}"


# The wings from the bottom up: a module imports only modules of its own wing or of
# wings below it (function-level imports too). The engine runs a stage and moves its
# messages; the kinds split layers with it; the loop's runtime composes them all.
ORDER = ["schedules", "pure", "base", "engine", "kinds", "cluster", "readers", "loop", "planning",
         "top"]


def test_imports_point_down_the_wings():
    graph, rank = _graph(), {}
    for layer, names in LAYERS.items():
        rank.update({name: ORDER.index(layer) for name in names})
    up = sorted(f"{m} -> {d}" for m, deps in graph.items() for d in deps if rank[d] > rank[m])
    assert not up, f"imports running up the wings ({' < '.join(ORDER)}): {up}"


def test_imports_have_no_cycle_counting_function_level_ones():
    graph = _graph()
    # ... and the parser sees imports inside functions (`hyparflow plan` imports measure there).
    assert "planning.measure" in graph["planning.command"]
    state = {}

    def visit(module, path):
        if state.get(module) == "done":
            return
        assert state.get(module) != "open", f"import cycle: {' -> '.join(path + [module])}"
        state[module] = "open"
        for other in sorted(graph[module]):
            visit(other, path + [module])
        state[module] = "done"

    for module in sorted(graph):
        visit(module, [])


def test_the_training_path_reaches_nothing_of_the_planning_wing():
    graph = _graph()
    reached, todo = {}, [(m, m) for m in sorted(TRAINING)]
    while todo:
        module, via = todo.pop()
        for other in graph[module]:
            if other not in reached:
                reached[other] = via
                todo.append((other, via))
    bad = {m: f"from {reached[m]}" for m in sorted(set(reached) & LAYERS["planning"])}
    assert not bad, bad


def test_a_training_process_never_loads_the_planning_wing():
    code = (
        "import sys, numpy as np\n"
        "import hyparflow as hf, keras\n"
        "model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(1)])\n"
        "model.compile('sgd', 'mse')\n"
        "x = np.ones((8, 4), 'float32'); y = np.ones((8, 1), 'float32')\n"
        "hf.fit(model, x, y, batch_size=8, epochs=1, verbose=0)\n"
        "hf.evaluate(model, x, y, batch_size=8, verbose=0)\n"
        "print(sorted(m for m in sys.modules if m.startswith('hyparflow')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    loaded = {m.split(".", 1)[1] if "." in m else "" for m in eval(out.stdout.strip().splitlines()[-1])}
    assert "loop.trainer" in loaded  # the check sees the loop
    assert not loaded & LAYERS["planning"], sorted(loaded & LAYERS["planning"])


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
               for p in PACKAGE.rglob("*.py") if p.name != "settings.py"}
    assert not {name: lines for name, lines in readers.items() if lines}, readers
    # ... and the check itself sees a read.
    assert _reads_setting(ast.parse('os.environ.get("HYPARFLOW_X", "1")').body[0].value)
    assert _reads_setting(ast.parse('env[f"HYPARFLOW_{n}"]').body[0].value)


def test_the_names_before_the_wings_are_the_wings_modules():
    code = ("import importlib, hyparflow.local, hyparflow.checkpoint\n"
            "from hyparflow.schedule import gpipe\n"
            "import hyparflow as hf\n"
            "assert hf.local is importlib.import_module('hyparflow.engine.local')\n"
            "assert hf.checkpoint.__spec__.name == 'hyparflow.engine.checkpoint'\n"
            "assert gpipe is importlib.import_module('hyparflow.schedules').gpipe\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]


def test_every_module_is_under_500_lines():
    """Small modules (docs/architecture.md): one that grows past this splits by idea."""
    long = {name: n for name, path in _modules().items()
            if (n := len(path.read_text().splitlines())) > 500}
    assert not long, long


def test_processes_the_tests_start_import_what_they_use():
    """tests/_lean: a process a test starts imports no scikit-learn, SciPy or matplotlib
    for Keras (which imports them only because they are installed), and still gets them
    when it asks itself (a digits example, hyparflow's trace picture)."""
    import os

    assert os.path.join("tests", "_lean") in os.environ["PYTHONPATH"]
    code = ("import sys, keras\n"
            "assert not {'sklearn', 'matplotlib'} & set(sys.modules), sorted(sys.modules)\n"
            "assert keras.wrappers.SKLearnClassifier\n"
            "from sklearn.datasets import load_digits\n"
            "import matplotlib.pyplot\n"
            "print(load_digits().data.shape)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "(1797, 64)", out.stderr[-3000:]
