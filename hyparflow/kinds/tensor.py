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
- MultiHeadAttention: a split by heads (Megatron-LM's layout): each rank holds
  its heads' slices of the query/key/value projections and of the output
  projection, computes their attention as Keras does, and the partial outputs
  are summed (one sum forward; one sum of the input gradient backward). A layer
  that holds attention layers inside (Keras Hub's TransformerEncoder) gets them
  split the same way while it runs, and its feed-forward Dense pair paired.

Shares may be uneven (a rank twice as fast takes twice the columns/filters/rows).
Around a split layer the values are replicated, so every other layer, the loss
and the gradients of unsplit weights are computed identically by all T ranks.
The collectives run inside the compiled stage function (as `py_function`s with
their own gradients) and always sum in rank order, so every rank gets the same
bits.
"""

import contextlib
import inspect
from dataclasses import dataclass

import keras
import numpy as np
import tensorflow as tf

from .. import _compat
from ..engine.comm import sum_in_order, timeout_seconds, wait_all

__all__ = ["MIN_PARAMS", "Split", "choose", "split_sizes", "shares_of", "shard", "Shard",
           "Collectives"]

MIN_PARAMS = 1 << 16  # layers with fewer weights are not split unless named
_TAG = 11  # a collective outside any split layer (the planner's measurements)

# Every collective of a split layer has a tag of its own: (site, role), a site being
# a split layer (its node index) or one of the layers a `Nested` splits inside it.
# The collectives of independent branches (an encoder's and a decoder's, or the
# backward sums of cross-attention's query and key/value) have no fixed order in a
# compiled function, so two tensor ranks may run them in different orders: with
# one tag, rank 0's first exchange would take rank 1's second (summing the wrong
# tensors where the shapes agree). MPI (and the in-process communicator) match
# messages of one tag in the order they were sent, and a site runs its collective
# once per call of a stage function, which every tensor rank makes in the same
# order, so the n-th exchange of a site pairs with the n-th on every rank.
_SUM, _GATHER, _SCORES, _WEIGHTS, _ENTER = range(5)  # _ENTER + k: the k-th input entered
_ROLES = 8
_SUBS = 64  # layers a `Nested` may split inside one layer
_SITE_BASE = 16


def _site_tag(site, role):
    return _SITE_BASE + site * _ROLES + role


@dataclass(frozen=True)
class Split:
    """How node `node` is split: kind "column" (Dense outputs; `gather`: put the
    output back together, else the next node is its "row" partner), "row"
    (Dense inputs, partial sums added), "filters" (Conv2D), "rows" (Embedding),
    "heads" (MultiHeadAttention) or "inner" (the MultiHeadAttention layers inside
    another layer, split by heads while it runs)."""

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


# MultiHeadAttention.call methods known to touch the heads only through the
# projection sublayers and `_compute_attention` (so they run unchanged on a share).
_FOLLOWED_CALLS = {
    "keras.src.layers.attention.multi_head_attention.MultiHeadAttention.call",
    "keras_hub.src.layers.modeling.cached_multi_head_attention.CachedMultiHeadAttention.call",
}
_ATTENTION_METHODS = ("_compute_attention", "_masked_softmax", "_compute_attention_mask",
                      "_compute_causal_mask")
_TERMS = ("kernel_regularizer", "bias_regularizer", "activity_regularizer",
          "embeddings_regularizer", "kernel_constraint", "bias_constraint",
          "embeddings_constraint")


def _qualified(fn):
    return f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', '')}"


def _common_why_not(op, layers):
    """Reasons shared by every kind: regularisers, constraints, LoRA, quantization,
    frozen weights (of `op` or of the sublayers `layers` that hold its weights)."""
    for layer in layers:
        for attr in _TERMS:
            if getattr(layer, attr, None) is not None:
                where = "" if layer is op else f" (its sublayer {layer.name!r})"
                return f"it has a {attr.replace('_', ' ')}{where}"
        if getattr(layer, "lora_enabled", False) or getattr(layer, "quantization_mode", None):
            return "it is LoRA-enabled or quantized"
    if not all(v.trainable for v in op.weights) or not op.trainable:
        return "it is frozen (nothing to gain: no gradients or optimizer state)"
    return None


def _attention_why_not(op, num_tensor):
    """Why a keras MultiHeadAttention cannot be split by heads, or None."""
    parts = _compat.attention_parts(op)
    dense = [parts[k] for k in ("query", "key", "value", "gate", "output") if k in parts]
    if any(d is None for d in dense):
        return "it is not built (call the model once first)"
    cls, base = type(op), keras.layers.MultiHeadAttention
    if _qualified(cls.call) not in _FOLLOWED_CALLS:
        return (f"its class {cls.__name__} overrides MultiHeadAttention.call, which hyparflow "
                "cannot follow head by head")
    for name in _ATTENTION_METHODS:
        if getattr(cls, name, None) is not getattr(base, name, None):
            return (f"its class {cls.__name__} overrides MultiHeadAttention.{name}, which "
                    "hyparflow cannot follow head by head")
    reason = _common_why_not(op, [op] + dense)
    if reason is not None:
        return reason
    heads = op.num_heads
    if heads < num_tensor:
        return (f"it has fewer heads ({heads}) than tensor ranks ({num_tensor}); each rank "
                "needs at least one head")
    if (any(d.kernel.shape[-2] != heads for d in dense[:-1])
            or dense[-1].kernel.shape[0] != heads):
        return "its projections are not laid out by heads"
    return None


def _inner_attention(op):
    """The MultiHeadAttention layers inside `op` (not `op` itself)."""
    return [sub for sub in _compat.sublayers(op)
            if isinstance(sub, keras.layers.MultiHeadAttention)]


# Layers whose `call` (read in their source) feeds one Dense sublayer's output straight
# into another's input and nowhere else: inside them that pair is split as Megatron-LM
# pairs Dense layers (keyed by the `call` method, so a subclass overriding it is not).
_INNER_PAIRS = {
    "keras_hub.src.layers.modeling.transformer_encoder.TransformerEncoder.call":
        [("_feedforward_intermediate_dense", "_feedforward_output_dense")],
    "keras_hub.src.layers.modeling.transformer_decoder.TransformerDecoder.call":
        [("_feedforward_intermediate_dense", "_feedforward_output_dense")],
}


def _inner_pairs(op, num_tensor):
    """[(first Dense, second Dense)] inside `op` that can be split as a pair."""
    out = []
    for first, second in _INNER_PAIRS.get(_qualified(type(op).call), ()):
        a, b = getattr(op, first, None), getattr(op, second, None)
        if (isinstance(a, keras.layers.Dense) and isinstance(b, keras.layers.Dense)
                and a.built and b.built and a.units >= num_tensor
                and _common_why_not(a, [a]) is None and _common_why_not(b, [b]) is None
                and int(b.kernel.shape[0]) == a.units):
            out.append((a, b))
    return out


def _why_not(graph, i, num_tensor):
    """Why node `i` cannot be split (a sentence), or None if it can."""
    op = graph.nodes[i].op
    inner = [] if isinstance(op, (keras.layers.Dense, keras.layers.Conv2D, keras.layers.Embedding,
                                  keras.layers.MultiHeadAttention)) else _inner_attention(op)
    if not inner and not isinstance(op, (keras.layers.Dense, keras.layers.Conv2D,
                                         keras.layers.Embedding,
                                         keras.layers.MultiHeadAttention)):
        return ("only Dense, Conv2D, Embedding and MultiHeadAttention layers (or layers "
                "holding MultiHeadAttention layers) can be split")
    if sum(node.op is op for node in graph.nodes) != 1:
        return "the layer is called more than once (shared weights)"
    mine = {id(v) for v in op.weights}
    for node in graph.nodes:
        if node.op is not op and mine & {id(v) for v in getattr(node.op, "weights", ())}:
            return (f"its weights are also used by layer {node.op.name!r} (tied weights), "
                    "which would need the whole of them")
    if isinstance(op, keras.layers.MultiHeadAttention):
        return _attention_why_not(op, num_tensor)
    if inner:
        for sub in inner:
            reason = _attention_why_not(sub, num_tensor)
            if reason is not None:
                return f"its attention layer {sub.name!r} cannot be split: {reason}"
        return None
    reason = _common_why_not(op, [op])
    if reason is not None:
        return reason
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
    (an error names any that cannot be), or None for every Dense, Conv2D,
    Embedding and MultiHeadAttention (or layer holding MultiHeadAttention layers)
    with at least `min_params` weights that can be."""
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
        elif isinstance(node.op, keras.layers.Embedding):
            splits[i] = Split(i, "rows")
        elif isinstance(node.op, keras.layers.MultiHeadAttention):
            splits[i] = Split(i, "heads")
        else:
            splits[i] = Split(i, "inner")
    return splits


class Collectives:
    """Sums and gathers over the T ranks of a stage, as TensorFlow operations with
    gradients (for use inside the compiled stage functions)."""

    def __init__(self, comm=None):
        self.comm = comm  # set once the ranks are connected

    def exchange(self, array, shapes, what, tag=_TAG):
        """Every rank's array (shapes[p] for rank p), in rank order. `tag`: the
        collective's own (see `_site_tag`), so that independent ones never pair."""
        comm = self.comm
        array = np.ascontiguousarray(array)
        out = [None] * comm.size
        out[comm.rank] = array
        reqs = []
        for p in range(comm.size):
            if p != comm.rank:
                out[p] = np.empty(shapes[p], array.dtype)
                reqs.append(comm.irecv(out[p], p, tag))
                reqs.append(comm.isend(array, p, tag))
        wait_all(reqs, timeout_seconds(), f"the other tensor ranks ({what})", comm.spin)
        return out

    def _summed(self, x, what, tag):
        def run(value):
            value = value.numpy()
            return sum_in_order(self.exchange(value, [value.shape] * self.comm.size, what, tag))

        out = tf.py_function(run, [x], x.dtype)
        out.set_shape(x.shape)
        return out

    def sum(self, x, what, tag=_TAG):
        """Forward: the sum over ranks; backward: the gradient as it is."""

        @tf.custom_gradient
        def op(x):
            return self._summed(x, what, tag), lambda dy: dy

        return op(x)

    def enter(self, x, what, tag=_TAG):
        """Forward: `x` as it is (replicated); backward: the sum of the ranks' partial
        gradients (each rank's split layer sees only its part)."""

        @tf.custom_gradient
        def op(x):
            return tf.identity(x), lambda dy: self._summed(dy, what, tag)

        return op(x)

    def gather(self, x, sizes, what, axis=-1, tag=_TAG):
        """Forward: the ranks' parts joined on `axis` (their sizes `sizes`); backward:
        this rank's part."""
        rank = self.comm.rank
        start = sum(sizes[:rank])
        ndim = len(x.shape)
        axis = axis % ndim

        def run(value):
            value = value.numpy()
            shapes = [value.shape[:axis] + (n,) + value.shape[axis + 1:] for n in sizes]
            return np.concatenate(self.exchange(value, shapes, what, tag), axis=axis)

        def part(dy):
            index = [slice(None)] * ndim
            index[axis] = slice(start, start + sizes[rank])
            return dy[tuple(index)]

        @tf.custom_gradient
        def op(x):
            out = tf.py_function(run, [x], x.dtype)
            shape = x.shape.as_list()
            shape[axis] = sum(sizes)
            out.set_shape(shape)
            return out, part

        return op(x)


def shard(op, split, rank, shares, collectives):
    """This rank's Shard of layer `op`, kept on the layer so that a later fit with
    the same split reuses its variables (and the optimizer state built for them)."""
    cache = op.__dict__.setdefault("_hyparflow_shards", {})
    key = (split, rank, tuple(shares))
    if key not in cache:
        kind = Nested if split.kind == "inner" else Shard
        cache[key] = kind(op, split, rank, shares, collectives, site=split.node * _SUBS)
    cache[key].coll = collectives
    return cache[key]


class Shard:
    """One rank's part of a split layer: its own variables (sliced from the layer's,
    named as the layer's so optimizer slots carry the same names) and the call.
    Kinds as in `Split`, but "inner" (see `Nested`)."""

    def __init__(self, op, split, rank, shares, collectives, site=0):
        """`site`: a number of this part's own among the model's split layers, the
        same on every rank (its collectives' tags, `_site_tag`)."""
        self.op, self.split, self.rank, self.site = op, split, rank, site
        self.coll = collectives
        kind = split.kind
        if kind == "rows":
            n = op.input_dim
        elif kind == "heads":
            n = op.num_heads
        elif kind == "row":
            n = int(op.kernel.shape[0])
        else:
            n = int(op.kernel.shape[-1])
        self.sizes = split_sizes(n, shares)
        self.start = sum(self.sizes[:rank])
        # (layer variable, axis it is cut on, or None when every rank keeps all of it)
        if kind == "rows":
            cuts = [(op.embeddings, 0)]
        elif kind == "heads":
            cuts = self._attention_cuts()
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
            with contextlib.ExitStack() as scopes:
                for name in prefix.split("/") if prefix else ():  # one scope per level
                    scopes.enter_context(keras.name_scope(name))
                shard = keras.Variable(value, dtype=var.dtype, trainable=True, name=var.name)
            if shard.path != var.path:  # its optimizer state would not be found by name
                raise RuntimeError(
                    f"hyparflow could not name this rank's part of {var.path!r} as the "
                    f"variable (it got {shard.path!r}); call hyparflow.fit outside any "
                    "keras.name_scope.")
            self.cuts.append((var, shard, axis))
        self.what = f"layer {op.name!r}"
        self.part_of = {id(var): part for var, part, _ in self.cuts}

    def _attention_cuts(self):
        """MultiHeadAttention: the query/key/value (and gate) projections' kernels
        (dim, heads, size) and biases (heads, size) cut on their heads axis, the
        output projection's kernel (heads, size, out...) on its first; the output
        bias whole (added once, after the sum)."""
        parts = _compat.attention_parts(self.op)
        cuts = []
        for name in ("query", "key", "value", "gate"):
            if name in parts:
                layer = parts[name]
                cuts.append((layer.kernel, -2))
                if layer.bias is not None:
                    cuts.append((layer.bias, -2))
        out = parts["output"]
        cuts.append((out.kernel, 0))
        if out.bias is not None:
            cuts.append((out.bias, None))
        return cuts

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
        return np.concatenate(self.coll.exchange(value, shapes, self.what,
                                                 self._tag(_WEIGHTS)), axis=axis)

    def sliced(self, value, axis):
        """This rank's part of a whole value cut on `axis`."""
        return self._slice(value, axis)

    def gather(self):
        """Put the layer's variables back together from every rank's part, on every
        rank (collective over the tensor ranks)."""
        for var, shard, axis in self.cuts:
            if axis is not None:
                var.assign(self.gathered(shard.numpy(), axis))

    def _tag(self, role):
        return _site_tag(self.site, role)

    def __call__(self, args, kwargs, training=None):
        """The layer's call with this rank's part in place of its `call`, through
        Keras's `Layer.__call__` as `model.fit` calls the whole layer: the Keras
        mask its output gets (or not), input casting and the rest are Keras's."""
        with _compat.calls_replaced(self.calls()):
            return _compat.call_operation(self.op, args, kwargs, training)

    def _part(self, x):
        """This rank's part of a Dense, Conv2D or Embedding call on input `x`."""
        op, kind = self.op, self.split.kind
        if kind == "rows":
            return self._lookup(x)
        x = tf.cast(x, op.compute_dtype) if x.dtype.is_floating else x
        weights = [tf.cast(shard.value, op.compute_dtype) for _, shard, _ in self.cuts]
        if kind == "row":
            # The input arrives already split (the column partner's output).
            y = keras.ops.matmul(x, weights[0])
            y = self.coll.sum(y, self.what, tag=self._tag(_SUM))
            if op.use_bias:
                y = keras.ops.add(y, weights[1])
            return op.activation(y) if op.activation is not None else y
        x = self.coll.enter(x, self.what, tag=self._tag(_ENTER))
        if kind == "filters":
            y = op.convolution_op(x, weights[0])
        else:
            y = keras.ops.matmul(x, weights[0])
        if op.use_bias:
            y = keras.ops.add(y, weights[1])
        if op.activation is not None:
            y = op.activation(y)
        if self.split.gather:
            y = self.coll.gather(y, self.sizes, self.what, tag=self._tag(_GATHER))
        return y

    def _lookup(self, ids):
        op = self.op
        if ids.dtype not in (tf.int32, tf.int64):
            ids = tf.cast(ids, tf.int32)
        table = self.cuts[0][1].value
        local = tf.reshape(ids - tf.cast(self.start, ids.dtype), [-1])
        mine = tf.logical_and(local >= 0, local < self.sizes[self.rank])
        # Only this rank's ids are looked up, in the batch's order: the part's gradient
        # holds the (row, value) pairs one process gives these rows and no zero pairs
        # for other ranks' ids, so the pairs gathered over replicas (hyparflow.sparse)
        # shrink with T. Other ranks' ids give zero rows to the sum.
        where = tf.where(mine)
        rows = tf.gather(table, tf.gather_nd(local, where))
        rows = tf.scatter_nd(where, rows, tf.stack([tf.size(local, out_type=tf.int64),
                                                    tf.cast(table.shape[-1], tf.int64)]))
        rows = tf.reshape(rows, tf.concat([tf.shape(ids), [table.shape[-1]]], 0))
        return tf.cast(self.coll.sum(rows, self.what, tag=self._tag(_SUM)), op.compute_dtype)


    # -- MultiHeadAttention by heads ---------------------------------------------
    def calls(self):
        """{layer: function run in place of its `call`} while the layer holding this
        part runs. A Dense: this rank's columns or rows (as `__call__`). An attention
        layer (the rest of this docstring):
        the projections compute this rank's heads only, the dropout on the attention
        probabilities draws the whole layer's mask and keeps this rank's heads of it,
        and the layer's own call is wrapped to enter the inputs and sum the outputs."""
        if self.split.kind != "heads":
            return {self.op: lambda inputs, training=None, **_: self._part(inputs)}
        parts = _compat.attention_parts(self.op)
        out = {}
        for name in ("query", "key", "value", "gate"):
            if name in parts:
                layer = parts[name]
                out[layer] = _projection(layer, self.part_of[id(layer.kernel)],
                                         self.part_of.get(id(layer.bias)))
        out[parts["output"]] = _projection(parts["output"], self.part_of[id(parts["output"].kernel)],
                                           None)
        if self.op.dropout > 0:
            out[parts["dropout"]] = self._dropout(parts["dropout"], parts["axes"])
        out[self.op] = self._attention(parts)
        return out

    def _heads(self, x, axis):
        """This rank's heads of `x` (all heads on `axis`)."""
        index = [slice(None)] * len(x.shape)
        index[axis] = slice(self.start, self.start + self.sizes[self.rank])
        return x[tuple(index)]

    def _dropout(self, layer, axes):
        """Dropout of this rank's heads of the attention probabilities with the mask
        one process would draw for all heads: Keras draws a stateless uniform of the
        whole shape from the layer's seed generator, whose state every tensor rank
        shares, so each rank draws the whole mask and keeps its heads."""
        own = _compat.original_call(layer)
        heads = self.op.num_heads

        def call(inputs, training=None):
            axis = len(inputs.shape) - 2 * len(axes) - 1  # (batch..., heads, queries, keys)
            shape = tf.unstack(tf.shape(inputs))
            shape[axis] = tf.constant(heads, shape[axis].dtype)
            ones = tf.ones(tf.stack(shape), inputs.dtype)
            mask = own(ones, training=training)
            if mask is ones:  # not training: the input as it is, as Keras returns it
                return inputs
            # x * (1 * scale or 0) is Keras's x * scale or 0, bit for bit.
            return keras.ops.multiply(inputs, self._heads(mask, axis))

        return call

    def _attention(self, parts):
        """The attention layer's own call, on this rank's heads: the inputs entered
        once each (the backward sums their gradients over the ranks), the partial
        output projections summed, the output bias added once."""
        op = self.op
        own = _compat.original_call(op)
        signature = inspect.signature(own)
        out_bias = parts["output"].bias
        axes = parts["axes"]

        def call(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)
            if bound.arguments.get("cache") is not None:
                raise ValueError(
                    f"Attention layer {op.name!r} is split by heads (num_tensor > 1) and was "
                    "called with a key/value cache, which holds every head. Decode with "
                    "num_tensor=1.")
            entered, originals = {}, []
            for k, name in enumerate(("query", "value", "key")):
                x = bound.arguments.get(name)
                if x is None:
                    continue
                originals.append(x)
                if id(x) not in entered:  # self-attention: one sum for query = value
                    entered[id(x)] = _compat.set_keras_mask(
                        self.coll.enter(x, self.what, tag=self._tag(_ENTER + k)),
                        _compat.keras_mask(x))
                bound.arguments[name] = entered[id(x)]
            result = own(*bound.args, **bound.kwargs)
            # Keras's call removed the masks of the copies it was given; in model.fit
            # it removes them from the tensors themselves, which later calls read.
            for x in originals:
                _compat.set_mask(x, None)
            rest = ()
            if isinstance(result, (tuple, list)):
                result, rest = result[0], tuple(result[1:])
            mask = _compat.keras_mask(result)
            y = self.coll.sum(result, self.what, tag=self._tag(_SUM))
            if out_bias is not None:
                y = keras.ops.add(y, out_bias)
            _compat.set_keras_mask(y, mask)
            if not rest:
                return y
            scores = rest[0]  # (batch..., heads, queries, keys): put the heads together
            axis = len(scores.shape) - 2 * len(axes) - 1
            return (y, self.coll.gather(scores, self.sizes, self.what, axis=axis,
                                        tag=self._tag(_SCORES))) + rest[1:]

        return call


def _projection(layer, kernel, bias):
    """An EinsumDense's call (einsum, bias, activation, as Keras's) on this rank's
    part `kernel` / `bias` (Keras variables, read as the layer reads its own)."""

    def call(inputs, training=None):
        x = keras.ops.einsum(layer.equation, inputs, kernel)
        if bias is not None:
            x = keras.ops.add(x, bias)
        if layer.activation is not None:
            x = layer.activation(x)
        return x

    return call


class Nested:
    """One rank's part of a layer that holds MultiHeadAttention layers inside (Keras
    Hub's TransformerEncoder/Decoder): each attention layer split by heads (a Shard
    of its own), and a known Dense pair (`_INNER_PAIRS`: the feed-forward block) by
    columns then rows; their calls replaced while the outer layer runs as it is."""

    def __init__(self, op, split, rank, shares, collectives, site=0):
        self.op, self.split, self.rank = op, split, rank
        made = []

        def sub(layer, kind, **extra):
            made.append(Shard(layer, Split(split.node, kind, **extra), rank, shares,
                              collectives, site=site + 1 + len(made)))

        for layer in _inner_attention(op):
            sub(layer, "heads")
        for first, second in _inner_pairs(op, len(shares)):
            sub(first, "column", gather=False)
            sub(second, "row")
        if len(made) >= _SUBS:
            raise ValueError(f"Layer {op.name!r} holds {len(made)} layers to split; hyparflow "
                             f"splits at most {_SUBS - 1} inside one layer. Use num_tensor=1 "
                             "or leave it out of tensor_layers.")
        self.subs = made
        self.coll = collectives

    @property
    def coll(self):
        return self._coll

    @coll.setter
    def coll(self, collectives):
        self._coll = collectives
        for sub in self.subs:
            sub.coll = collectives

    @property
    def replaces(self):
        return {k: v for sub in self.subs for k, v in sub.replaces.items()}

    def load(self):
        for sub in self.subs:
            sub.load()

    def gather(self):
        for sub in self.subs:
            sub.gather()

    def slots(self, optimizer):
        """As Shard.slots; each axis given as (which attention layer, axis)."""
        return [(slot, (k, axis)) for k, sub in enumerate(self.subs)
                for slot, axis in sub.slots(optimizer)]

    def gathered(self, value, axis):
        return self.subs[axis[0]].gathered(value, axis[1])

    def sliced(self, value, axis):
        return self.subs[axis[0]].sliced(value, axis[1])

    def __call__(self, args, kwargs, training=None):
        calls = {}
        for sub in self.subs:
            calls.update(sub.calls())
        with _compat.calls_replaced(calls):
            return _compat.call_operation(self.op, args, kwargs, training)
