"""Keras masks as `model.fit` sees them, followed call by call on every stage.

A Keras mask (`Embedding(mask_zero=True)`, `Masking`, padding) is an attribute of
a value, and which layer sees it depends on the order of the calls: Keras 3's
`MultiHeadAttention.call` removes the mask from the very tensors it was given
(its query, key and value), so in `model.fit` a layer that reads the same
tensor *after* the attention runs sees no mask (an `Add([x, attention(x, x)])`
then gives an output without a mask, and the loss is not masked), and one that
reads it before sees it. Stages run their calls in another order than
`Functional.call` (depth-first by branch, and spread over ranks), and a value
that crosses a stage is a new tensor on which nothing was removed, so
following the attributes as they happen would differ from `model.fit`.

So the model's own run is recorded once (`of`): Keras's `Functional.call`
order, the real layer calls, traced symbolically (no data, nothing computed).
It notes, before each call, which of its input tensors carry a mask, and
which model outputs carry one when the loss reads them. A mask present there
is the one its producer attached (the mask as it was when the tensor was
made); a removed one is None. Stages then attach, before each call, exactly
those masks (`Stage`), and a tensor crossing a stage carries its producer's
mask, whatever a layer on the sending stage did to it since.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import keras
import tensorflow as tf

from .. import _compat
from ..graph import LayerGraph, Shape

__all__ = ["MaskRun", "of"]


class MaskRun:
    """`present[node][tensor]`: whether the call `node` (graph node index) finds
    its input `tensor` (graph tensor index) with its producer's mask attached in
    `model.fit`; `final[tensor]`: the same for each model output when the loss
    reads it; `shapes[tensor]`: the mask shape (batch first, None where open) of
    each tensor whose producer attaches one."""

    def __init__(self, present: Dict[int, Dict[int, bool]], final: Dict[int, bool],
                 shapes: Dict[int, Shape]) -> None:
        self.present, self.final, self.shapes = present, final, shapes


def _cache(graph: LayerGraph) -> Dict[bool, Optional[MaskRun]]:
    cache: Optional[Dict[bool, Optional[MaskRun]]] = graph.__dict__.get("_mask_runs")
    if cache is None:
        cache = graph.__dict__["_mask_runs"] = {}
    return cache


def of(graph: LayerGraph, training: bool) -> Optional[MaskRun]:
    """The `MaskRun` of `graph`'s model in training (or inference) mode, recorded
    at the first call, or None when the model has no Keras mask anywhere (then
    nothing needs following). Tensors that carry a mask in training also get
    their mask shape in `graph.tensors[t].mask`, so that stages send it: every
    rank records that run when it makes its stage (`Stage`), before the
    messages are laid out, so all agree on which tensors carry masks. (Inference
    adds none: a mask only inference would attach, never training, is not
    carried; Keras's masks do not appear that way.)"""
    cache = _cache(graph)
    key = bool(training)
    if key not in cache:
        if graph.functional is None or not any(t.mask is not None for t in graph.tensors):
            cache[key] = None
        else:
            run = cache[key] = _record(graph, key)
            for t, shape in run.shapes.items() if key else ():
                if graph.tensors[t].mask is None:
                    graph.tensors[t].mask = shape
    return cache[key]


def _record(graph: LayerGraph, training: bool) -> MaskRun:
    """Trace the model's layer calls in `Functional.call`'s order (no data runs),
    noting the masks each call and the loss find."""
    tensor_of = {id(t.keras_tensor): t.index for t in graph.tensors}
    node_of = {id(n.keras_node): n.index for n in graph.nodes}
    inputs = [graph.tensors[t].keras_tensor for t in graph.inputs]
    present: Dict[int, Dict[int, bool]] = {}
    final: Dict[int, bool] = {}
    shapes: Dict[int, Shape] = {}

    def run(*flat: Any) -> List[Any]:
        values = {id(kt): v for kt, v in zip(inputs, flat)}   # symbolic tensors
        produced: Dict[int, Any] = {}  # tensor -> the mask its producer attached (or None)
        # Assignments (BatchNorm statistics, seed generators) and losses made by
        # these calls are kept in the scope, away from the layers.
        with keras.StatelessScope(collect_losses=True):
            for keras_node in _compat.call_order(graph.functional):
                i = node_of[id(keras_node)]
                node = graph.nodes[i]
                present[i] = {t: _compat.get_mask(values[id(graph.tensors[t].keras_tensor)])
                              is not None for t in node.inputs}
                args, kwargs = _compat.fill_in(keras_node, values)
                out = _compat.call_operation(node.op, args, kwargs, training)
                for kt, v in zip(keras_node.outputs, _compat.tree.flatten(out)):
                    values[id(kt)] = v
                    mask = _compat.get_mask(v)
                    produced[tensor_of[id(kt)]] = mask
                    if mask is not None:
                        shapes[tensor_of[id(kt)]] = (None,) + tuple(mask.shape[1:])
            for t in graph.outputs:
                final[t] = _compat.get_mask(values[id(graph.tensors[t].keras_tensor)]) is not None
        return []

    specs = [tf.TensorSpec(tuple(kt.shape), kt.dtype) for kt in inputs]
    tf.function(run, autograph=False).get_concrete_function(*specs)
    return MaskRun(present, final, shapes)
