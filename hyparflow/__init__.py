"""hyparflow: hybrid-parallel (pipeline x data) training of Keras 3 models over MPI.

Import it before TensorFlow or Keras: it quiets TensorFlow's start-up noise
and sets each rank's thread pools before the first TensorFlow operation.
"""

import sys

from . import _env

__version__ = "0.1.0"
__all__ = ["fit", "evaluate", "predict", "sweep", "rank", "size", "is_main", "LocalSGD",
           "LeaderSGD", "layers", "__version__"]

_env.quiet_tensorflow()
from .sync import LeaderSGD, LocalSGD  # noqa: E402  (pure: no TensorFlow)
# The `hyparflow` command's entry point (hyparflow_command.py, loaded first) says
# when this process is the command, which needs no TensorFlow; any other process
# may train, and starts TensorFlow now, with its threads set.
_COMMAND = getattr(sys.modules.get("hyparflow_command"), "COMMAND", False)
if not _COMMAND:
    _env.start_tensorflow()
    from .api import evaluate, fit, is_main, predict, rank, size  # noqa: E402,F401
    from .sweeps import sweep  # noqa: E402,F401
    from . import layers  # noqa: E402,F401


def __getattr__(name):
    # In the command, the training API is loaded on first use.
    if name in ("fit", "evaluate", "predict", "rank", "size", "is_main"):
        from . import api

        return getattr(api, name)
    if name == "sweep":
        from .sweeps import sweep

        return sweep
    if name == "layers":
        import importlib

        return importlib.import_module(".layers", __name__)
    raise AttributeError(f"module 'hyparflow' has no attribute {name!r}")
