"""How a stage's functions are compiled: input specs with an open batch dimension,
XLA when the model asks for it (falling back to the plain function, once and said),
and a scope that reads every variable through a gradient hook."""

from __future__ import annotations

import warnings
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

import keras
import tensorflow as tf

from .. import settings
from ..graph import Tensor

__all__ = ["spec", "Hooked", "wants_xla", "XLAOrPlain"]


def spec(tensor: Tensor, batch: Optional[int] = None) -> Any:
    """A tf.TensorSpec of `tensor` with batch dimension `batch` (None: open)."""
    return tf.TensorSpec((batch,) + tuple(tensor.shape[1:]), tf.as_dtype(tensor.dtype))


class Hooked(keras.StatelessScope):
    """Reads every trainable variable of a stage through a gradient hook.

    Keras layers read a variable's value through the stateless scope when one is
    active, so mapping each variable to `identity(value)` with a custom gradient
    puts a hook where its gradient is complete, inside the compiled backward.
    Assignments made in the scope (BatchNorm statistics, seed generators,
    metrics) are only recorded by Keras; `write_back` applies them. Variables and
    values are Keras's and TensorFlow's (untyped: Any)."""

    def __init__(self, mapping: Any) -> None:
        super().__init__(mapping, collect_losses=True)
        self.updated: Dict[int, Any] = {}   # id(variable) -> variable assigned in the scope

    def add_update(self, update: Tuple[Any, Any]) -> None:
        super().add_update(update)
        self.updated[id(update[0])] = update[0]

    def write_back(self) -> None:
        for variable in self.updated.values():
            variable.assign(self.get_current_value(variable))


def wants_xla(model: Any) -> bool:
    """HYPARFLOW_JIT when set, else what `model.compile(jit_compile=...)` resolved to
    (Keras's "auto" turns XLA off on machines without an accelerator)."""
    chosen = settings.jit()
    return bool(getattr(model, "jit_compile", False)) if chosen is None else chosen


class XLAOrPlain:
    """An XLA-compiled function that falls back to the plain one, once and said, when
    XLA cannot compile it (an operation without an XLA kernel)."""

    runs = 0   # calls run under XLA in this process (what `HYPARFLOW_JIT` changed)

    def __init__(self, xla: Callable[..., Any], plain: Callable[..., Any]) -> None:
        self.xla, self.plain, self.failed = xla, plain, False

    def __call__(self, *args: Any) -> Any:
        if not self.failed:
            try:
                out = self.xla(*args)
                XLAOrPlain.runs += 1
                return out
            except (tf.errors.InvalidArgumentError, tf.errors.UnimplementedError) as exc:
                self.failed = True
                warnings.warn(f"hyparflow: XLA could not compile a stage function, which runs "
                              f"without it ({str(exc).splitlines()[0][:200]})", RuntimeWarning)
        return self.plain(*args)
