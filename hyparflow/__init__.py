"""hyparflow: hybrid-parallel (pipeline x data) training of Keras 3 models over MPI.

Import it before TensorFlow or Keras: it quiets TensorFlow's start-up noise
and sets each rank's thread pools before the first TensorFlow operation.
"""

from . import _env

_env.quiet_tensorflow()
_env.start_tensorflow()

from .api import evaluate, fit, is_main, predict, rank, size  # noqa: E402

__version__ = "0.1.0"
__all__ = ["fit", "evaluate", "predict", "rank", "size", "is_main", "__version__"]
