"""Tensor (intra-layer) parallelism: a stage's widest layers split over T ranks.

Each of the T ranks of a stage runs the whole stage, but holds only its share
of the split layers' weights (and of their gradients and optimizer state):

- Dense, alone: a column split (each rank computes some output units); the
  outputs are gathered, so the next layer sees the whole tensor.
- Dense followed by Dense (the first's output used by the second only): the
  first is split by columns, the second by rows (each rank multiplies its own
  slice of the hidden units and the partial sums are added), so one sum serves
  both layers, as Megatron-LM pairs them.
- Conv2D: a filter (output channel) split, gathered on the channel axis.
- Embedding: a row split (each rank owns a range of ids); the lookups are summed.

Shares may be uneven (a rank twice as fast takes twice the columns/filters/rows).
Around a split layer the values are replicated, so every other layer, the loss
and the gradients of unsplit weights are computed identically by all T ranks.
The collectives run inside the compiled stage function (as `py_function`s with
their own gradients) and always sum in rank order, so every rank gets the same
bits.
"""

import contextlib
from dataclasses import dataclass

import keras
import numpy as np
import tensorflow as tf

from .comm import sum_in_order, timeout_seconds, wait_all

__all__ = ["MIN_PARAMS", "Split", "choose", "split_sizes", "shares_of", "shard", "Shard",
           "Collectives"]

MIN_PARAMS = 1 << 16  # layers with fewer weights are not split unless named
_TAG = 11


@dataclass(frozen=True)
class Split:
    """How node `node` is split: kind "column" (Dense outputs; `gather`: put the
    output back together, else the next node is its "row" partner), "row"
    (Dense inputs, partial sums added), "filters" (Conv2D) or "rows" (Embedding)."""

    node: int
    kind: str
    gather: bool = True


def shares_of(shares, num_tensor):
    """Normalised per-rank shares: even when `shares` is None."""
    if shares is None:
        return [1.0 / num_tensor] * num_tensor
    shares = [float(s) for s in shares]
    if len(shares) != num_tensor or any(not s > 0 for s in shares):
        raise ValueError(
            f"`tensor_shares` needs {num_tensor} positive numbers (one per tensor rank, e.g. "
            f"relative speeds). Received: tensor_shares={shares!r}")
    total = sum(shares)
    return [s / total for s in shares]


def split_sizes(n, shares):
    """`n` units cut in proportion to `shares` (largest remainder), at least one each."""
    if n < len(shares):
        raise ValueError(f"cannot split {n} units over {len(shares)} tensor ranks")
    raw = [n * s for s in shares]
    sizes = [max(1, int(r)) for r in raw]
    while sum(sizes) > n:
        k = max((i for i in range(len(sizes)) if sizes[i] > 1), key=lambda i: sizes[i] - raw[i])
        sizes[k] -= 1
    while sum(sizes) < n:
        k = max(range(len(sizes)), key=lambda i: raw[i] - sizes[i])
        sizes[k] += 1
    return sizes


def _why_not(graph, i, num_tensor):
    """Why node `i` cannot be split (a sentence), or None if it can."""
    op = graph.nodes[i].op
    if not isinstance(op, (keras.layers.Dense, keras.layers.Conv2D, keras.layers.Embedding)):
        return "only Dense, Conv2D and Embedding layers can be split"
    if sum(node.op is op for node in graph.nodes) != 1:
        return "the layer is called more than once (shared weights)"
    for attr in ("kernel_regularizer", "bias_regularizer", "activity_regularizer",
                 "embeddings_regularizer", "kernel_constraint", "bias_constraint",
                 "embeddings_constraint"):
        if getattr(op, attr, None) is not None:
            return f"it has a {attr.replace('_', ' ')}"
    if getattr(op, "lora_enabled", False) or getattr(op, "quantization_mode", None):
        return "it is LoRA-enabled or quantized"
    if not all(v.trainable for v in op.weights) or not op.trainable:
        return "it is frozen (nothing to gain: no gradients or optimizer state)"
    if isinstance(op, keras.layers.Embedding):
        if op.mask_zero:
            return "it has mask_zero=True"
        if op.input_dim < num_tensor:
            return f"it has fewer rows ({op.input_dim}) than tensor ranks"
        return None
    if isinstance(op, keras.layers.Conv2D):
        if op.groups != 1 or op.data_format != "channels_last":
            return "only channels_last Conv2D with groups=1 can be split"
        if op.filters < num_tensor:
            return f"it has fewer filters ({op.filters}) than tensor ranks"
        return None
    if op.units < num_tensor:
        return f"it has fewer units ({op.units}) than tensor ranks"
    return None


def choose(graph, nodes, num_tensor, layers=None, min_params=MIN_PARAMS):
    """{node index: Split} for the nodes of one stage. `layers`: names to split
    (an error names any that cannot be), or None for every Dense, Conv2D and
    Embedding with at least `min_params` weights that can be."""
    if num_tensor == 1:
        return {}
    picked = []
    for i in nodes:
        node = graph.nodes[i]
        if layers is not None and node.op.name not in layers:
            continue
        reason = _why_not(graph, i, num_tensor)
        if reason is None and (layers is not None or node.params >= min_params):
            picked.append(i)
        elif reason is not None and layers is not None:
            raise ValueError(f"Layer {node.op.name!r} is in tensor_layers but cannot be split "
                             f"over {num_tensor} ranks: {reason}. Remove it from tensor_layers.")
    chosen = set(picked)
    consumers = {}
    for node in graph.nodes:
        for t in node.inputs:
            consumers.setdefault(t, []).append(node.index)
    splits = {}
    for i in picked:
        if i in splits:
            continue
        node = graph.nodes[i]
        if isinstance(node.op, keras.layers.Dense):
            out = node.outputs[0]
            users = consumers.get(out, [])
            partner = users[0] if len(users) == 1 else None
            if (partner is not None and partner in chosen and partner not in splits
                    and out not in graph.outputs and partner in nodes
                    and isinstance(graph.nodes[partner].op, keras.layers.Dense)
                    and graph.nodes[partner].inputs == [out]):
                splits[i] = Split(i, "column", gather=False)
                splits[partner] = Split(partner, "row")
                continue
            splits[i] = Split(i, "column")
        elif isinstance(node.op, keras.layers.Conv2D):
            splits[i] = Split(i, "filters")
        else:
            splits[i] = Split(i, "rows")
    return splits


class Collectives:
    """Sums and gathers over the T ranks of a stage, as TensorFlow operations with
    gradients (for use inside the compiled stage functions)."""

    def __init__(self, comm=None):
        self.comm = comm  # set once the ranks are connected

    def exchange(self, array, shapes, what):
        """Every rank's array (shapes[p] for rank p), in rank order."""
        comm = self.comm
        array = np.ascontiguousarray(array)
        out = [None] * comm.size
        out[comm.rank] = array
        reqs = []
        for p in range(comm.size):
            if p != comm.rank:
                out[p] = np.empty(shapes[p], array.dtype)
                reqs.append(comm.irecv(out[p], p, _TAG))
                reqs.append(comm.isend(array, p, _TAG))
        wait_all(reqs, timeout_seconds(), f"the other tensor ranks ({what})", comm.spin)
        return out

    def _summed(self, x, what):
        def run(value):
            value = value.numpy()
            return sum_in_order(self.exchange(value, [value.shape] * self.comm.size, what))

        out = tf.py_function(run, [x], x.dtype)
        out.set_shape(x.shape)
        return out

    def sum(self, x, what):
        """Forward: the sum over ranks; backward: the gradient as it is."""

        @tf.custom_gradient
        def op(x):
            return self._summed(x, what), lambda dy: dy

        return op(x)

    def enter(self, x, what):
        """Forward: `x` as it is (replicated); backward: the sum of the ranks' partial
        gradients (each rank's split layer sees only its part)."""

        @tf.custom_gradient
        def op(x):
            return tf.identity(x), lambda dy: self._summed(dy, what)

        return op(x)

    def gather(self, x, sizes, what):
        """Forward: the ranks' parts joined on the last axis; backward: this rank's part."""
        rank = self.comm.rank
        start = sum(sizes[:rank])

        def run(value):
            value = value.numpy()
            shapes = [value.shape[:-1] + (n,) for n in sizes]
            return np.concatenate(self.exchange(value, shapes, what), axis=-1)

        @tf.custom_gradient
        def op(x):
            out = tf.py_function(run, [x], x.dtype)
            out.set_shape(x.shape[:-1].concatenate([sum(sizes)]))
            return out, lambda dy: dy[..., start:start + sizes[rank]]

        return op(x)


def shard(op, split, rank, shares, collectives):
    """This rank's Shard of layer `op`, kept on the layer so that a later fit with
    the same split reuses its variables (and the optimizer state built for them)."""
    cache = op.__dict__.setdefault("_hyparflow_shards", {})
    key = (split, rank, tuple(shares))
    if key not in cache:
        cache[key] = Shard(op, split, rank, shares, collectives)
    cache[key].coll = collectives
    return cache[key]


class Shard:
    """One rank's part of a split layer: its own variables (sliced from the layer's,
    named as the layer's so optimizer slots carry the same names) and the call."""

    def __init__(self, op, split, rank, shares, collectives):
        self.op, self.split, self.rank = op, split, rank
        self.coll = collectives
        kind = split.kind
        if kind == "rows":
            n = op.input_dim
        elif kind == "row":
            n = int(op.kernel.shape[0])
        else:
            n = int(op.kernel.shape[-1])
        self.sizes = split_sizes(n, shares)
        self.start = sum(self.sizes[:rank])
        # (layer variable, axis it is cut on, or None when every rank keeps all of it)
        if kind == "rows":
            cuts = [(op.embeddings, 0)]
        elif kind == "row":
            cuts = [(op.kernel, 0)] + ([(op.bias, None)] if op.use_bias else [])
        else:
            cuts = [(op.kernel, -1)] + ([(op.bias, 0)] if op.use_bias else [])
        self.cuts = []
        for var, axis in cuts:
            if axis is None:
                self.cuts.append((var, var, None))
                continue
            prefix = var.path.rsplit("/", 1)[0] if "/" in var.path else ""
            value = self._slice(var.numpy(), axis)
            with keras.name_scope(prefix) if prefix else contextlib.nullcontext():
                shard = keras.Variable(value, dtype=var.dtype, trainable=True, name=var.name)
            self.cuts.append((var, shard, axis))
        self.what = f"layer {op.name!r}"

    def _slice(self, value, axis):
        index = [slice(None)] * value.ndim
        index[axis] = slice(self.start, self.start + self.sizes[self.rank])
        return value[tuple(index)]

    @property
    def replaces(self):
        """{id(layer variable): the variable this rank trains in its place}."""
        return {id(var): shard for var, shard, _ in self.cuts}

    def load(self):
        """Take this rank's part of the layer's current weights."""
        for var, shard, axis in self.cuts:
            if axis is not None:
                shard.assign(self._slice(var.numpy(), axis))

    def slots(self, optimizer):
        """[(optimizer variable, axis)] for the optimizer state of this rank's parts (Keras names a slot after its variable's path, which a part shares
        with its layer variable)."""
        out = []
        for var, part, axis in self.cuts:
            if axis is None:
                continue
            prefix = part.path.replace("/", "_") + "_"
            out += [(slot, axis) for slot in optimizer.variables
                    if slot.name.startswith(prefix) and tuple(slot.shape) == tuple(part.shape)]
        return out

    def gathered(self, value, axis):
        """The whole of a variable cut on `axis`, from every rank's part `value`."""
        shapes = []
        for n in self.sizes:
            shape = list(value.shape)
            shape[axis] = n
            shapes.append(tuple(shape))
        return np.concatenate(self.coll.exchange(value, shapes, self.what), axis=axis)

    def sliced(self, value, axis):
        """This rank's part of a whole value cut on `axis`."""
        return self._slice(value, axis)

    def gather(self):
        """Put the layer's variables back together from every rank's part, on every
        rank (collective over the tensor ranks)."""
        for var, shard, axis in self.cuts:
            if axis is not None:
                var.assign(self.gathered(shard.numpy(), axis))

    def __call__(self, args, kwargs):
        op, kind = self.op, self.split.kind
        x = args[0] if args else kwargs["inputs"]
        if kind == "rows":
            return self._lookup(x)
        x = tf.cast(x, op.compute_dtype) if x.dtype.is_floating else x
        weights = [tf.cast(shard.value, op.compute_dtype) for _, shard, _ in self.cuts]
        if kind == "row":
            # The input arrives already split (the column partner's output).
            y = keras.ops.matmul(x, weights[0])
            y = self.coll.sum(y, self.what)
            if op.use_bias:
                y = keras.ops.add(y, weights[1])
            return op.activation(y) if op.activation is not None else y
        x = self.coll.enter(x, self.what)
        if kind == "filters":
            y = op.convolution_op(x, weights[0])
        else:
            y = keras.ops.matmul(x, weights[0])
        if op.use_bias:
            y = keras.ops.add(y, weights[1])
        if op.activation is not None:
            y = op.activation(y)
        if self.split.gather:
            y = self.coll.gather(y, self.sizes, self.what)
        return y

    def _lookup(self, ids):
        op = self.op
        if ids.dtype not in (tf.int32, tf.int64):
            ids = tf.cast(ids, tf.int32)
        local = ids - tf.cast(self.start, ids.dtype)
        mine = tf.logical_and(local >= 0, local < self.sizes[self.rank])
        rows = tf.gather(self.cuts[0][1].value, tf.where(mine, local, tf.zeros_like(local)))
        rows = rows * tf.cast(mine, rows.dtype)[..., None]  # other ranks' ids give zeros
        return tf.cast(self.coll.sum(rows, self.what), op.compute_dtype)

