"""`hyparflow run` without `-n` runs the script once with HYPARFLOW_CAPTURE set: its
first `fit` writes what the planner needs (the model as a .keras file, the batch, the
model's structure and the layout arguments the script gave) and ends the process, so
that the command can plan the node (`planning/auto.py`) before it launches the ranks."""

from __future__ import annotations

import hashlib
import inspect
import json
import os
from typing import Any, Mapping

import numpy as np

from .. import _compat
from .. import graph as _graph
from ..engine import prepare

__all__ = ["CAPTURED", "write", "structure"]

CAPTURED = "capture.json"   # beside model.keras in the capture directory


def structure(graph: Any) -> str:
    """A digest of the model's structure: each layer call's class, output shapes and
    weight count, in graph order (not its names, which depend on what else the process
    built: the same model has the same digest in any script)."""
    calls = [(type(n.op).__name__, [list(graph.tensors[t].shape) for t in n.outputs],
              n.params) for n in graph.nodes]
    return hashlib.sha256(json.dumps(calls, default=str).encode()).hexdigest()[:16]


def _modules(model: Any) -> dict[str, str]:
    """{module: file} of the classes of `model` and its layers defined outside Keras,
    TensorFlow and hyparflow."""
    found: dict[str, str] = {}
    for layer in [model, *_compat.sublayers(model)]:
        module = type(layer).__module__
        if module.split(".")[0] in ("keras", "tensorflow", "hyparflow", "keras_hub", "__main__"):
            continue
        try:
            found[module] = inspect.getfile(type(layer))
        except TypeError:   # a class without a file (built at run time)
            pass
    return found


def write(directory: str, model: Any, x: Any, batch_size: int,
          arguments: Mapping[str, Any]) -> None:
    """Write the capture and end the process (exit code 0): nothing of the script after
    its `fit` runs."""
    os.makedirs(directory, exist_ok=True)
    if not model.built:
        prepare.build_like_fit(model, x, batch_size)
    leaves = prepare.x_leaves(x)
    shapes = [tuple(getattr(a, "shape", ())) for a in leaves]
    graph = _graph.from_model(model, shapes, [prepare.data_dtype(a) for a in leaves])
    given = {k: v for k, v in arguments.items() if v is not None}
    saved = os.path.join(directory, "model.keras")
    record: dict[str, Any] = {
        "batch_size": int(batch_size), "structure": structure(graph),
        "given": {k: str(v) for k, v in given.items()},
        "length": (int(shapes[0][1]) if shapes and len(shapes[0]) >= 2 else None),
        "model": saved, "saved": None}
    try:
        model.save(saved)
        # The modules of the model's own layer classes, which the planner's processes
        # import before they load it (a class of the script itself, `__main__`, cannot be).
        with open(saved + ".modules.json", "w") as f:
            json.dump(_modules(model), f)
    except Exception as error:  # noqa: BLE001 - said to the command, which says the fix
        record["saved"] = f"{type(error).__name__}: {error}"
    with open(os.path.join(directory, CAPTURED), "w") as f:
        json.dump(record, f, default=lambda v: v.item() if isinstance(v, np.generic) else str(v))
    raise SystemExit(0)
