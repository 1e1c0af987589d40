"""The processes the tests start (ranks, launchers, scripts) import what they use.

Keras imports scikit-learn (for its scikit-learn wrappers, and SciPy with it) and
matplotlib (for its plotting helpers) at `import keras` whenever they are installed:
2 s of a core per process here, a third of a rank's start, and the suite starts about
200 ranks. The test venv has both, for the digits examples and the trace pictures.
tests/conftest.py puts this folder on the PYTHONPATH of every process a test starts.
There an import of these packages made by Keras's own modules finds nothing, as in a
venv without them, and Keras goes on without its wrappers and plots (it tries them).
Any other import of them, a script's `from sklearn.datasets import load_digits` or
hyparflow's trace picture, is served as usual.
"""

import sys

_EXTRAS = ("sklearn", "scipy", "matplotlib")


class _KerasExtras:
    """A finder that answers "not installed" to Keras's optional imports only."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        if name.partition(".")[0] not in _EXTRAS:
            return None
        frame = sys._getframe(1)   # the importing module: the first frame outside importlib
        while frame is not None and frame.f_globals.get("__name__", "").startswith("importlib"):
            frame = frame.f_back
        importer = frame.f_globals.get("__name__", "") if frame is not None else ""
        if importer.startswith("keras."):
            raise ModuleNotFoundError(f"No module named {name!r} (tests/_lean)", name=name)
        return None


sys.meta_path.insert(0, _KerasExtras())
