"""A Keras model as a LayerGraph: layer calls in a topological order, tensors with shapes."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import keras
import numpy as np

from . import _compat, settings

__all__ = ["LayerGraph", "Node", "Tensor", "Shape", "from_model", "numel", "sized"]

# A tensor's shape, batch first; None: known only at run time.
Shape = Tuple[Optional[int], ...]


@dataclass
class Tensor:
    """A value flowing in the graph. `producer` is a node index, or None for a model input."""

    index: int
    shape: Shape  # first dimension is the batch (None)
    dtype: str
    producer: Optional[int] = None
    input_position: Optional[int] = None   # its place among the model's flat inputs
    keras_tensor: Any = field(default=None, repr=False)   # the KerasTensor (untyped)
    mask: Optional[Shape] = None  # shape of its Keras mask (e.g. padding), batch first; None: no mask

    @property
    def dynamic(self) -> bool:
        """Whether a dimension besides the batch is known only at run time (a
        sequence length, an image size), in the value or its mask."""
        return any(d is None for d in tuple(self.shape[1:]) + tuple((self.mask or (0,))[1:]))

    @property
    def floating(self) -> bool:
        return np.dtype(self.dtype).kind == "f" if self.dtype != "bfloat16" else True


@dataclass
class Node:
    """One call of a layer or operation (a layer called twice is two nodes)."""

    index: int
    name: str
    op: Any = field(repr=False)          # the Keras layer or operation (untyped)
    keras_node: Any = field(repr=False)  # Keras's own node; None for an opaque model
    inputs: List[int]                    # tensor indices
    outputs: List[int]
    params: int
    cost: float
    # False where the layer's name is Keras's auto-name (`_compat.auto_named`): it
    # depends on what else the process built, so ranks match such a call by position.
    given: bool = True


@dataclass
class LayerGraph:
    nodes: List[Node]
    tensors: List[Tensor]
    inputs: List[int]   # tensor index of each model input, in the model's flat input order
    outputs: List[int]  # tensor index of each model output, in the model's flat output order
    functional: Any = field(repr=False)  # None for a subclassed model (one opaque node)
    input_names: List[str] = field(default_factory=list)
    output_names: List[str] = field(default_factory=list)

    @cached_property
    def sharing(self) -> Tuple[Dict[int, int], Dict[int, List[int]]]:
        """(calls, holders): how many nodes call each operation (by its id), and for
        each variable (by id) the nodes whose operations hold it, each operation's
        first call, in order. Once per graph: Keras's `weights` walks every sublayer,
        and asking it per pair of nodes made the planner's search quadratic in the
        layers."""
        calls: Dict[int, int] = {}
        holders: Dict[int, List[int]] = {}
        for node in self.nodes:
            calls[id(node.op)] = calls.get(id(node.op), 0) + 1
            if calls[id(node.op)] == 1:
                for v in getattr(node.op, "weights", ()):
                    holders.setdefault(id(v), []).append(node.index)
        return calls, holders

    def variables_of(self, node_indices: Iterable[int], trainable: bool) -> List[Any]:
        """Variables (Keras, untyped) of the given nodes' operations, each once, in
        first-use order."""
        seen: set[int] = set()
        out: List[Any] = []
        for i in node_indices:
            op = self.nodes[i].op
            # Plain operations (keras.ops calls) have no weights at all.
            for v in getattr(op, "trainable_weights" if trainable else "non_trainable_weights", ()):
                if id(v) not in seen:
                    seen.add(id(v))
                    out.append(v)
        return out


def sized(shape: Sequence[Optional[int]], batch: int) -> Tuple[int, ...]:
    """`shape` for example values of `batch` samples (profiles, timings): an unknown
    dimension, a length left to the data, at HYPARFLOW_PROFILE_LENGTH."""
    length = settings.profile_length()
    return (batch,) + tuple(d if d is not None else length for d in shape[1:])


def numel(shape: Sequence[Optional[int]]) -> int:
    """Values per sample of a tensor of `shape` (batch first; unknown dimensions count as 1)."""
    n = 1
    for d in shape[1:]:
        n *= d if d is not None else 1
    return n


# What an output element of a layer that does little arithmetic per element costs,
# in multiply-adds of a weight product: such layers are bound by memory, not by the
# arithmetic units. Measured per layer call (`balance="time"`, ResNet-110, 32 rows,
# forward and backward, one thread): a Conv2D ran 29 G multiply-adds/s; an
# activation or an add took ~2 ns per element (~60 multiply-adds), a
# BatchNormalization ~11 ns (~300: Keras computes its moments and their gradients
# in several passes). Counting elements as one multiply-add put ResNet-110's
# high-resolution half, where the same convolution work comes with 4x the elements,
# on one stage taking 1.46x the time of the other.
ELEMENT_COST = 60.0
NORMALIZATION_COST = 300.0


def _estimate_cost(op: Any, out_shapes: Sequence[Shape], params: int) -> float:
    """Forward compute estimate per sample, in multiply-adds.

    A weight is used once per output position (the output size divided by its
    last dimension): exact for Dense and Conv, close for recurrent layers. Every
    output element adds `ELEMENT_COST` (`NORMALIZATION_COST` for normalization
    layers), for the memory it passes through.
    """
    elems = sum(numel(s) for s in out_shapes)
    per_element = (NORMALIZATION_COST if isinstance(op, _NORMALIZATIONS) else ELEMENT_COST)
    if params == 0 or isinstance(op, keras.layers.Embedding) or isinstance(op, _NORMALIZATIONS):
        return float(elems) * per_element
    positions = max(1, max(numel(s) // max(1, (s[-1] or 1)) if len(s) > 1 else 1
                           for s in out_shapes))
    return float(params * positions + elems * per_element)


_NORMALIZATIONS = tuple(getattr(keras.layers, name) for name in (
    "BatchNormalization", "LayerNormalization", "GroupNormalization", "UnitNormalization",
    "RMSNormalization") if hasattr(keras.layers, name))


def _param_count(op: Any) -> int:
    return int(sum(int(np.prod(v.shape)) for v in getattr(op, "trainable_weights", ())))


def from_model(model: Any, x_shapes: Optional[Sequence[Sequence[Optional[int]]]] = None,
               x_dtypes: Optional[Sequence[str]] = None) -> LayerGraph:
    """Read `model`'s graph. A subclassed model becomes one opaque node whose inputs
    have the shapes `x_shapes` (flat list of array shapes) and the Keras dtypes
    `x_dtypes` (the data's, as Keras builds such a model from its first batch)."""
    functional = _compat.functional_of(model)
    if functional is None:
        return _opaque(model, x_shapes, x_dtypes)
    members = _compat.graph_nodes(functional)
    tensors: List[Tensor] = []
    tensor_of: Dict[int, int] = {}   # id(KerasTensor) -> its index

    def tensor(kt: Any, producer: Optional[int] = None, input_position: Optional[int] = None) -> int:
        key = id(kt)
        if key not in tensor_of:
            shape = tuple(kt.shape)
            mask = getattr(kt, "_keras_mask", None)
            t = Tensor(len(tensors), shape, str(kt.dtype), producer, input_position, kt,
                       tuple(mask.shape) if mask is not None else None)
            tensors.append(t)
            tensor_of[key] = t.index
        return tensor_of[key]

    flat_inputs = _compat.tree.flatten(_compat.input_structure(functional))
    inputs = [tensor(kt, input_position=p) for p, kt in enumerate(flat_inputs)]
    flat_outputs = _compat.tree.flatten(_compat.output_structure(functional))

    # Depth-first post-order from the outputs: a node comes right after the
    # last of its inputs' producers, so a branch stays contiguous and a
    # stage cut falls between blocks rather than across them.
    order: List[Any] = []          # Keras nodes
    state: Dict[int, str] = {}
    stack = [(_compat.producer_node(kt), False) for kt in reversed(flat_outputs)]
    while stack:
        node, expanded = stack.pop()
        key = id(node)
        if node.is_input or state.get(key) == "done":
            continue
        if expanded:
            state[key] = "done"
            order.append(node)
            continue
        if state.get(key) == "open":
            continue
        if key not in members:
            raise ValueError(
                f"Layer {node.operation.name!r} is used by the model's graph through a call "
                "that is not part of it; hyparflow cannot place it."
            )
        state[key] = "open"
        stack.append((node, True))
        for kt in reversed(node.input_tensors):
            stack.append((_compat.producer_node(kt), False))

    nodes: List[Node] = []
    calls: Dict[int, int] = {}     # id(operation) -> its calls so far
    for kn in order:
        op = kn.operation
        ins: List[int] = []
        for kt in kn.input_tensors:
            if id(kt) not in tensor_of:
                raise ValueError(
                    f"Layer call {op.name!r} reads a tensor that is neither a model input nor "
                    "produced by an earlier layer call; hyparflow cannot place it."
                )
            ins.append(tensor_of[id(kt)])
        index = len(nodes)
        outs = [tensor(kt, producer=index) for kt in kn.outputs]
        calls[id(op)] = calls.get(id(op), 0) + 1
        name = op.name if calls[id(op)] == 1 else f"{op.name}#{calls[id(op)]}"
        params = _param_count(op) if calls[id(op)] == 1 else 0
        cost = _estimate_cost(op, [tensors[t].shape for t in outs], _param_count(op))
        nodes.append(Node(index, name, op, kn, ins, outs, params, cost,
                          given=not _compat.auto_named(op)))

    outputs: List[int] = []
    for kt in flat_outputs:
        if id(kt) not in tensor_of:
            raise ValueError(f"Model output {kt.name!r} is not connected to the model's inputs.")
        outputs.append(tensor_of[id(kt)])
    if not nodes:
        raise ValueError("The model has no layer calls between its inputs and outputs.")
    return LayerGraph(
        nodes, tensors, inputs, outputs, functional,
        input_names=_names(_compat.input_structure(functional), [kt.name for kt in flat_inputs]),
        output_names=_names(_compat.output_structure(functional),
                            list(getattr(model, "output_names", None) or
                                 [kt.name for kt in flat_outputs])),
    )


def _names(structure: Any, fallback: List[str]) -> List[str]:
    """Names by which dict data is matched to the flat inputs/outputs: the dict's
    keys (in the flat order) when the model was built with a dict, else layer names."""
    if isinstance(structure, dict):
        return [path[0] for path, _ in _compat.tree.flatten_with_path(structure)]
    return fallback


def _opaque(model: Any, x_shapes: Optional[Sequence[Sequence[Optional[int]]]],
            x_dtypes: Optional[Sequence[str]] = None) -> LayerGraph:
    """A subclassed model: its `call` cannot be read, so it is one node."""
    if not model.built:
        raise ValueError(
            f"Model {model.name!r} is not built: call it once on a batch (or build it) "
            "before hyparflow.fit, so its variables exist on every rank."
        )
    if not x_shapes:
        raise ValueError("A subclassed model needs its input shapes from the data.")
    dtypes = list(x_dtypes or ["float32"] * len(x_shapes))
    tensors = [Tensor(i, (None,) + tuple(s[1:]), d, None, i)
               for i, (s, d) in enumerate(zip(x_shapes, dtypes))]
    node = Node(0, model.name, model, None, [t.index for t in tensors], [], _param_count(model), 1.0)
    return LayerGraph([node], tensors, [t.index for t in tensors], [], None,
                      input_names=[f"input_{i}" for i in range(len(tensors))],
                      output_names=list(getattr(model, "output_names", None) or []))
