"""The members' graphs checked against each other, and the fused array built from them.

`read(models, describe)` reads every member's layer graph (hyparflow.graph), checks that
they are one graph (same layers, calls, shapes; only hyper-parameters that keep the
shapes differ) and picks a kind for each layer (registry.choose). `Array(sweep, positions)`
is the fused model of some of the members: their weights stacked (variables.Stacked, or
the members' own for layers run once per member), one forward for all of them.
"""

from dataclasses import dataclass, field

import keras
import numpy as np
import tensorflow as tf

from .. import _compat
from .. import graph as _graph
from . import registry as _kinds
from .variables import Owned, Stacked

__all__ = ["SweepGraph", "read", "Array", "MismatchError"]

# Methods whose override changes how a model trains: a sweep would not run them.
_CUSTOM_TRAINING = ("train_step", "test_step", "compute_loss", "compute_metrics")


class MismatchError(ValueError):
    """The members' graphs differ where a sweep needs them equal."""


@dataclass
class SweepGraph:
    """What every rank knows of the sweep's graph: member 0's LayerGraph, each layer
    (by member 0's) with the N members' layers and its kind, and the layers not fused."""

    graph: object
    layers: dict                 # id(member 0's op) -> [op of member p for p in range(N)]
    kinds: dict                  # id(member 0's op) -> kind class
    looped: list = field(default_factory=list)   # [(layer name, class name, why)]


def _describe_member(p, describe):
    return describe(p) if describe else f"member {p}"


def _check_model(model, p, describe):
    who = _describe_member(p, describe)
    if not isinstance(model, keras.Model):
        raise TypeError(f"build(config) must return a keras.Model; {who} returned "
                        f"{type(model).__name__}.")
    if not _compat.is_compiled(model):
        raise ValueError(f"{who}'s model {model.name!r} is not compiled: build(config) must "
                         "return a model compiled with its optimizer, loss and metrics, as "
                         "for model.fit.")
    if _compat.functional_of(model) is None:
        raise ValueError(
            f"{who}'s model {model.name!r} is a subclassed keras.Model, whose call a sweep "
            "cannot read layer by layer to fuse it. Build it with the Functional API "
            "(keras.Model(inputs, outputs)) or keras.Sequential.")
    for name in _CUSTOM_TRAINING:
        if getattr(type(model), name) is not getattr(keras.Model, name):
            raise NotImplementedError(
                f"{who}'s model class {type(model).__name__} overrides {name}: a sweep trains "
                "with the compiled loss and metrics only, so it would train differently from "
                "model.fit. Train such models one by one (model.fit or hf.fit).")
    if _compat.onednn():
        for layer in _compat.sublayers(model):
            if (isinstance(layer, (keras.layers.SeparableConv1D, keras.layers.SeparableConv2D))
                    and any(s > 1 for s in layer.strides)):
                # Measured, not understood: the members' own layers and ops, yet with
                # oneDNN on, weights 0.02-0.15 from their own fits after 4 SGD steps in
                # 3 to 6 of 6 sweeps; exact in 6 of 6 with it off.
                raise NotImplementedError(
                    f"{who}'s layer {layer.name!r} is a {type(layer).__name__} with strides "
                    f"{tuple(layer.strides)}: with TensorFlow's oneDNN kernels (on in this "
                    "process) a sweep trained such layers to other weights than each "
                    "member's own fit in some runs (docs/sweeps.md). Set "
                    "TF_ENABLE_ONEDNN_OPTS=0 before TensorFlow is imported (then it "
                    "matches), use strides=1 (and pooling), or train the members one by one "
                    "(model.fit or hf.fit).")


def _arguments(node, index_of):
    """A node's call arguments with its symbolic tensors replaced by tensor indices."""
    args, kwargs = node.keras_node.arguments.args, node.keras_node.arguments.kwargs

    def plain(x):
        if isinstance(x, keras.KerasTensor):
            return ("tensor", index_of.get(id(x)))
        return x

    return _compat.tree.map_structure(plain, (list(args), dict(kwargs)))


def _same(a, b):
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - arrays and the like: compare as arrays
        try:
            return bool(np.array_equal(np.asarray(a), np.asarray(b)))
        except Exception:  # noqa: BLE001
            return False


def _compare(first, other, p, describe):
    """Raise MismatchError naming the first place `other` (member p) differs from member 0."""
    who = _describe_member(p, describe)

    def fail(what):
        raise MismatchError(
            f"The sweep's models differ: {who} {what}. Every member's graph must match member "
            "0's (same layers, calls and shapes); configs may change only what keeps the "
            "shapes (learning rates, optimizer arguments, seeds, dropout rates, loss weights).")

    if len(other.inputs) != len(first.inputs) or len(other.outputs) != len(first.outputs):
        fail(f"has {len(other.inputs)} inputs and {len(other.outputs)} outputs where member 0 "
             f"has {len(first.inputs)} and {len(first.outputs)}")
    for kind, a, b in (("input", first.inputs, other.inputs),
                       ("output", first.outputs, other.outputs)):
        for k, (i, j) in enumerate(zip(a, b)):
            sa, sb = first.tensors[i], other.tensors[j]
            if tuple(sa.shape) != tuple(sb.shape) or sa.dtype != sb.dtype:
                fail(f"has {kind} {k} of shape {tuple(sb.shape)} ({sb.dtype}) where member 0 "
                     f"has {tuple(sa.shape)} ({sa.dtype})")
    if len(other.nodes) != len(first.nodes):
        fail(f"has {len(other.nodes)} layer calls where member 0 has {len(first.nodes)}")
    index_a = {id(t.keras_tensor): t.index for t in first.tensors}
    index_b = {id(t.keras_tensor): t.index for t in other.tensors}
    ops = {}
    for na, nb in zip(first.nodes, other.nodes):
        where = f"layer {nb.op.name!r} (call {nb.index} of the graph)"
        if type(na.op) is not type(nb.op):
            fail(f"has {where} of class {type(nb.op).__name__} where member 0 has "
                 f"{na.op.name!r} of class {type(na.op).__name__}")
        if ops.setdefault(id(na.op), nb.op) is not nb.op:
            fail(f"does not share {where} as member 0 shares {na.op.name!r}")
        if na.inputs != nb.inputs:
            fail(f"feeds {where} from other layers than member 0 feeds {na.op.name!r}")
        for ta, tb in zip(na.outputs, nb.outputs):
            sa, sb = first.tensors[ta].shape, other.tensors[tb].shape
            if tuple(sa) != tuple(sb):
                fail(f"has {where} with output shape {tuple(sb)} where member 0's "
                     f"{na.op.name!r} gives {tuple(sa)}")
        wa, wb = list(getattr(na.op, "weights", ())), list(getattr(nb.op, "weights", ()))
        if [tuple(v.shape) for v in wa] != [tuple(v.shape) for v in wb]:
            fail(f"has {where} with weights of shapes {[tuple(v.shape) for v in wb]} where "
                 f"member 0's {na.op.name!r} has {[tuple(v.shape) for v in wa]}")
        if [v.trainable for v in wa] != [v.trainable for v in wb]:
            fail(f"has {where} with other trainable weights than member 0's {na.op.name!r}")
        args_a, args_b = _arguments(na, index_a), _arguments(nb, index_b)
        if not _same(args_a, args_b):
            fail(f"calls {where} with arguments {args_b} where member 0 calls "
                 f"{na.op.name!r} with {args_a}")


def _calls(graph, op):
    """[(args, kwargs)] of every call of `op` in `graph` (symbolic)."""
    return [(n.keras_node.arguments.args, n.keras_node.arguments.kwargs)
            for n in graph.nodes if n.op is op]


def read(models, describe=None):
    """The sweep's SweepGraph from its N built, compiled models (raises MismatchError,
    ValueError or NotImplementedError naming the member and what differs)."""
    for p, model in enumerate(models):
        _check_model(model, p, describe)
    graphs = [_graph.from_model(m) for m in models]
    first = graphs[0]
    for t in first.tensors:
        if t.mask is not None:
            producer = first.nodes[t.producer].op.name if t.producer is not None else "an input"
            raise NotImplementedError(
                f"Layer {producer!r} gives a Keras mask (e.g. Embedding(mask_zero=True), "
                "Masking): a sweep does not carry masks between fused layers yet. Pass "
                "explicit attention masks, or train these models one by one.")
    for p, g in enumerate(graphs[1:], 1):
        _compare(first, g, p, describe)
    layers, kinds, looped = {}, {}, []
    for k, node in enumerate(first.nodes):
        key = id(node.op)
        if key in layers:
            continue
        layers[key] = [g.nodes[k].op for g in graphs]
        kind, why = _kinds.choose(layers[key], _calls(first, node.op))
        kinds[key] = kind
        if not kind.fused:
            looped.append((node.op.name, type(node.op).__name__, why))
    return SweepGraph(first, layers, kinds, looped)


class Context:
    """What a kind's call may need besides its inputs: `rows`, (first row, rows of the
    global batch) of a replica's part of the batch, for dropout masks; None with one
    replica."""

    def __init__(self, rows=None):
        self.rows = rows


class Array:
    """The fused model of the members at sweep positions `positions` (a rank's sub-array):
    their weights in `slots` (Stacked per fused weight, Owned per member weight of a
    looped layer), their layers' kinds, and the forward of all of them at once."""

    def __init__(self, sweep, models, positions):
        self.sweep = sweep
        self.positions = list(positions)
        self.models = [models[i] for i in self.positions]
        self.n = len(self.positions)
        self.slots = []                     # in the graph's layer order
        self._slot_of = {}                  # id(member 0's variable) -> Stacked
        self.where = {}                     # id(any member's variable) -> (slot, index)
        self.kinds = {}
        for key, all_ops in sweep.layers.items():
            ops = [all_ops[i] for i in self.positions]
            kind = sweep.kinds[key]
            weights = [list(getattr(op, "weights", ())) for op in ops]
            for w in range(len(weights[0])):
                originals = [ws[w] for ws in weights]
                if kind.fused:
                    name = originals[0].path.rsplit("/", 1)[-1]
                    slot = Stacked(originals, originals[0].trainable, rows=name in kind.rows)
                    self._add(slot)
                    self._slot_of[id(originals[0])] = slot
                else:
                    for p, original in enumerate(originals):
                        self._add(Owned(original, p, self.n))
            self.kinds[key] = kind(ops, self._slot)
        self.trainable = [s for s in self.slots if s.trainable]
        # Regularizers and constraints, as each member's own model applies them.
        self.regularized = [[(self.where[id(v)], v.regularizer) for v in m.trainable_weights
                             if v.regularizer is not None and id(v) in self.where]
                            for m in self.models]
        self.activity = {key: [getattr(op, "activity_regularizer", None)
                               for op in (all_ops[i] for i in self.positions)]
                         for key, all_ops in sweep.layers.items()}
        self.activity = {k: v for k, v in self.activity.items() if any(v)}

    def _add(self, slot):
        self.slots.append(slot)
        for index, original in enumerate(slot.originals):
            self.where[id(original)] = (slot, index)

    def _slot(self, variable):
        return self._slot_of[id(variable)]

    def member_value(self, where):
        slot, index = where
        return slot.grouped(slot.variable)[index]

    def forward(self, xs, training, context):
        """The members' outputs ([N, b, ...] per flat model output) for their inputs
        `xs` ([N, b, ...] per flat model input), and each member's activity-regularizer
        losses ([[loss, ...] per member])."""
        graph = self.sweep.graph
        values = {id(graph.tensors[t].keras_tensor): x for t, x in zip(graph.inputs, xs)}
        activity = [[] for _ in range(self.n)]
        for node in graph.nodes:
            key = id(node.op)
            args, kwargs = _compat.fill_in(node.keras_node, values)
            outs = self.kinds[key].call(list(args), dict(kwargs), training, context)
            flat = _compat.tree.flatten(outs)
            for kt, value in zip(node.keras_node.outputs, flat):
                values[id(kt)] = value
            for p, regularizer in enumerate(self.activity.get(key, ())):
                if regularizer is not None:
                    activity[p].extend(regularizer(value[p]) for value in flat)
        return [values[id(graph.tensors[t].keras_tensor)] for t in graph.outputs], activity

    def regularization(self, p):
        """Member p's weight-regularization losses, from its weights in the array."""
        return [regularizer(self.member_value(where)) for where, regularizer in self.regularized[p]]

    def apply_constraints(self):
        """Each member's constraints on its weights, after the optimizer's step, as Keras
        applies them."""
        for slot in self.trainable:
            constraints = [getattr(v, "constraint", None) for v in slot.originals]
            if not any(constraints):
                continue
            grouped = slot.grouped(slot.variable)
            new = [c(grouped[i]) if c is not None else grouped[i]
                   for i, c in enumerate(constraints)]
            slot.variable.assign(slot.storage(tf.stack(new)))

    def write_back(self):
        for slot in self.slots:
            slot.write_back()

    def reload(self):
        for slot in self.slots:
            slot.reload()
