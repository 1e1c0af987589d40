"""hyparflow: hybrid-parallel (pipeline x data) training of Keras 3 models over MPI.

Import it before TensorFlow or Keras: it quiets TensorFlow's start-up noise
and sets each rank's thread pools before the first TensorFlow operation.
"""

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from typing import Any, Dict, Optional, Sequence

from . import _env

__version__ = "0.1.0"
__all__ = ["fit", "evaluate", "predict", "sweep", "rank", "size", "is_main", "LocalSGD",
           "LeaderSGD", "layers", "InputContext", "BatchCouplingWarning", "__version__"]

# The modules' names before the package had wings (a folder per part, docs/
# architecture.md): `import hyparflow.local`, `from hyparflow import checkpoint` keep
# working for scripts written against them, as the very module of the wing.
_MOVED = {
    "api": "loop.api",
    "boundary": "engine.boundary",
    "calls": "engine.calls",
    "checkpoint": "engine.checkpoint",
    "comm": "engine.comm",
    "costmodel": "planning.costmodel",
    "costs": "loop.costs",
    "customised": "engine.customised",
    "data": "readers.arrays",
    "errors": "engine.errors",
    "executor": "engine.executor",
    "heartbeat": "cluster.heartbeat",
    "hosts": "cluster.hosts",
    "inference": "loop.inference",
    "kernels": "engine.kernels",
    "launch": "cluster.launch",
    "local": "engine.local",
    "logs": "loop.logs",
    "masks": "engine.masks",
    "measure": "planning.measure",
    "normaliser": "engine.normaliser",
    "overlap": "engine.overlap",
    "partition": "engine.partition",
    "planner": "planning.planner",
    "probes": "planning.probes",
    "profile": "planning.profile",
    "progress": "loop.progress",
    "replicas": "kinds.replicas",
    "restart": "cluster.restart",
    "runtime": "loop.runtime",
    "schedule": "schedules",
    "slurm": "cluster.slurm",
    "sparse": "engine.sparse",
    "stage": "engine.stage",
    "tensor": "kinds.tensor",
    "timeline": "engine.timeline",
    "trainer": "loop.trainer",
    "weights": "engine.weights",
    "zero": "kinds.zero",
}


class _Moved(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds `hyparflow.<old name>` and answers with the wing's module itself."""

    def __init__(self) -> None:
        self._specs: Dict[str, Optional[importlib.machinery.ModuleSpec]] = {}

    def find_spec(self, fullname: str, path: Optional[Sequence[str]] = None,
                  target: Optional[types.ModuleType] = None,
                  ) -> Optional[importlib.machinery.ModuleSpec]:
        old = fullname[len("hyparflow."):] if fullname.startswith("hyparflow.") else None
        if old in _MOVED:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = importlib.import_module(f"hyparflow.{_MOVED[spec.name[len('hyparflow.'):]]}")
        self._specs[module.__name__] = module.__spec__
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        # The import system stamps the alias's spec on the module; give it its own back.
        module.__spec__ = self._specs.pop(module.__name__, module.__spec__)


# First: a finder that maps `hyparflow.<child>` onto a directory (an editable install's)
# would otherwise find a stale file of an old checkout under the old name.
if not any(isinstance(f, _Moved) for f in sys.meta_path):
    sys.meta_path.insert(0, _Moved())

_env.quiet_tensorflow()
from .sync import LeaderSGD, LocalSGD  # noqa: E402  (pure: no TensorFlow)
# The `hyparflow` command's entry point (hyparflow_command.py, loaded first) says
# when this process is the command, which needs no TensorFlow, as does `python -m
# hyparflow`; any other process may train, and starts TensorFlow now, with its
# threads set. (TensorFlow's import alone is seconds of a core, before the ranks start.)
_COMMAND = (getattr(sys.modules.get("hyparflow_command"), "COMMAND", False)
            or _env.run_as_module())
if not _COMMAND:
    _env.start_tensorflow()
    from .loop.api import evaluate, fit, is_main, predict, rank, size  # noqa: E402,F401
    from .sweeps import sweep  # noqa: E402,F401
    from . import layers  # noqa: E402,F401
    from .readers.context import InputContext  # noqa: E402,F401
    from .engine.coupling import BatchCouplingWarning  # noqa: E402,F401


def __getattr__(name: str) -> Any:   # a function or a module, by name
    # In the command, the training API is loaded on first use.
    if name in ("fit", "evaluate", "predict", "rank", "size", "is_main"):
        from .loop import api

        return getattr(api, name)
    if name == "sweep":
        from .sweeps import sweep

        return sweep
    if name == "BatchCouplingWarning":
        from .engine.coupling import BatchCouplingWarning

        return BatchCouplingWarning
    if name == "layers":
        import importlib

        return importlib.import_module(".layers", __name__)
    raise AttributeError(f"module 'hyparflow' has no attribute {name!r}")
