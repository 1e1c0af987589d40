"""hyparflow: hybrid-parallel (pipeline x data) training of Keras 3 models over MPI.

Import it before TensorFlow or Keras: it quiets TensorFlow's start-up noise
and sets each rank's thread pools before the first TensorFlow operation.
"""

import os
import sys

from . import _env

__version__ = "0.1.0"
__all__ = ["fit", "evaluate", "predict", "rank", "size", "is_main", "__version__"]

_env.quiet_tensorflow()
# The `hyparflow` command (run, slurm, info) must start fast and never needs
# TensorFlow's threads: only a training process starts TensorFlow at import.
_argv0 = sys.argv[0] if sys.argv and sys.argv[0] else ""
_orig = list(getattr(sys, "orig_argv", []))
_COMMAND = os.path.basename(_argv0) == "hyparflow" or _argv0.endswith(
    os.path.join("hyparflow", "__main__.py")) or any(
    a == "-m" and b == "hyparflow" for a, b in zip(_orig, _orig[1:]))
if not _COMMAND:
    _env.start_tensorflow()
    from .api import evaluate, fit, is_main, predict, rank, size  # noqa: E402,F401


def __getattr__(name):
    # In the command, the training API is loaded on first use.
    if name in ("fit", "evaluate", "predict", "rank", "size", "is_main"):
        from . import api

        return getattr(api, name)
    raise AttributeError(f"module 'hyparflow' has no attribute {name!r}")
