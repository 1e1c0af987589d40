"""One order for the collectives inside a compiled stage function, the same on every rank.

A collective inside a compiled function is a `py_function` that blocks until its peers
reach the same collective. TensorFlow runs independent branches in whatever order their
inputs become ready: an encoder's and a decoder's sums, or the backward sums of
cross-attention's query and key/value, have no order in the graph. A rank with one
inter-op thread that blocks in one of them never reaches the other, and if its peer
chose the other first both wait forever. Tags pair messages with the right peer; they
cannot stop two ranks from blocking in different collectives.

So every collective takes a token (a float32 scalar) and gives a new one, and the next
collective made in the same graph takes that: the forward collectives run in the
order they were made, which is the program order of the layer calls, the same on every
rank. The token also passes through the collectives' gradients (`custom_gradient`):
the gradient of a collective's output token is an input of its backward, and its
backward gives the gradient of its input token, so the backward collectives run in
exactly the reverse order, whatever order TensorFlow's gradient code visits them in.
That order respects the data: a backward can only depend on the backwards of later
forwards.

In eager code (`run_eagerly`) Python's order is the order: tokens are not used.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, List, Optional, Sequence

import tensorflow as tf

# TensorFlow's tensors, graphs and dtypes are untyped here: Any.
Tensor = Any

__all__ = ["py_function", "custom_gradient"]

_state = threading.local()
_ATTR = "_hyparflow_order"  # the token of a graph's outermost chain, kept on the graph


def _graph() -> Any:
    return tf.compat.v1.get_default_graph()


def _frames() -> List[List[Any]]:
    if not hasattr(_state, "frames"):
        _state.frames = []  # [graph, token] chains opened by `custom_gradient`
    frames: List[List[Any]] = _state.frames
    return frames


def _frame() -> Optional[List[Any]]:
    """The innermost chain open in the graph being built, or None."""
    graph = _graph()
    found: Optional[List[Any]] = None
    for frame in _frames():
        if frame[0] is graph:
            found = frame
    return found


def _take() -> Tensor:
    """The token the next collective of this graph waits for."""
    frame = _frame()
    if frame is not None:
        return frame[1]
    token = getattr(_graph(), _ATTR, None)
    return tf.zeros((), tf.float32) if token is None else token


def _put(token: Tensor) -> None:
    frame = _frame()
    if frame is not None:
        frame[1] = token
    else:
        setattr(_graph(), _ATTR, token)


class _chain:
    """A chain of collectives starting at `token` (a gradient function's own)."""

    def __init__(self, token: Tensor) -> None:
        self.frame: List[Any] = [_graph(), token]

    def __enter__(self) -> _chain:
        _frames().append(self.frame)
        return self

    def __exit__(self, *exc: object) -> None:
        _frames().remove(self.frame)

    @property
    def token(self) -> Tensor:
        return self.frame[1]


def py_function(func: Callable[..., Any], inp: Sequence[Tensor], Tout: Any,
                name: Optional[str] = None) -> Any:
    """`tf.py_function(func, inp, Tout)` run after the graph's previous collective and
    before its next one. Its outputs have no gradient (a collective with one makes it
    inside `custom_gradient`); the token's passes through, so that the collectives on
    either side stay in order backward too."""
    if tf.executing_eagerly():
        return tf.py_function(func, inp, Tout, name=name)
    single = not isinstance(Tout, (list, tuple))
    touts = [Tout] if single else list(Tout)
    inp = [tf.stop_gradient(x) for x in inp]

    def run(*args: Tensor) -> List[Any]:
        out = func(*args[:-1])
        out = [out] if single else list(out)
        return out + [tf.zeros((), tf.float32)]

    @tf.custom_gradient
    def link(token: Tensor) -> Any:
        outs = tf.py_function(run, inp + [token], touts + [tf.float32], name=name)

        def grad(*douts: Tensor) -> Tensor:
            return tf.zeros((), tf.float32) if douts[-1] is None else douts[-1]

        return outs, grad

    outs = link(_take())
    _put(outs[-1])
    return outs[0] if single else outs[:-1]


def custom_gradient(f: Callable[..., Any]) -> Callable[..., Any]:
    """As `tf.custom_gradient`, for functions whose forward or gradient function makes
    collectives (`py_function` above): both keep the graph's one order. `f(*xs)` returns
    (outputs, grad_fn) as for `tf.custom_gradient`; xs are tensors."""

    def call(*xs: Tensor) -> Any:
        if tf.executing_eagerly():
            return tf.custom_gradient(f)(*xs)
        holder: dict[str, bool] = {}

        @tf.custom_gradient
        def op(*args: Tensor) -> Any:
            xs_, token = args[:-1], args[-1]
            with _chain(token) as forward:
                ys, grad = f(*xs_)
            holder["single"] = not isinstance(ys, (list, tuple))
            flat = [ys] if holder["single"] else list(ys)

            def backward(*grads: Tensor, **kwargs: Any) -> Any:
                dys, dtoken = list(grads[:-1]), grads[-1]
                if dtoken is None:
                    dtoken = tf.zeros((), tf.float32)
                last = getattr(_graph(), _ATTR, None)
                if last is not None:
                    # Forward and backward in one graph (a tape inside a compiled
                    # function): the backward's collectives come after the forward's.
                    with tf.control_dependencies([last]):
                        dtoken = tf.identity(dtoken)
                with _chain(dtoken) as chain:
                    result = grad(*(dys if not holder["single"] else dys[:1]), **kwargs)
                if "variables" in kwargs:
                    dxs, dvars = result
                else:
                    dxs, dvars = result, None
                dxs = list(dxs) if isinstance(dxs, (list, tuple)) else [dxs]
                dxs.append(chain.token)
                return (dxs, dvars) if "variables" in kwargs else dxs

            return flat + [forward.token], backward

        outs = op(*xs, _take())
        _put(outs[-1])
        outs = list(outs[:-1])
        return outs[0] if holder["single"] else outs

    return call
