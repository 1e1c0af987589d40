"""MultiHeadAttention, split by heads (Megatron-LM's layout): each rank holds its
heads' slices of the query/key/value projections and of the output projection,
computes their attention as Keras does, and the partial outputs are summed (one sum
forward; one sum of the input gradient backward). A layer that holds attention layers
inside (Keras Hub's TransformerEncoder) gets them split the same way while it runs,
and its feed-forward Dense pair paired ("inner", a `Nested` part)."""

import inspect

import keras
import tensorflow as tf

from ... import _compat
from .collectives import ENTER, SCORES, SUBS, SUM
from .shard import Shard
from .dense import Column, Row
from .split import Split, SplitKind, common_why_not, qualified

__all__ = ["Heads", "Inner", "Nested", "refuse_cache"]

_FOLLOWED_CALLS = {
    "keras.src.layers.attention.multi_head_attention.MultiHeadAttention.call",
    "keras_hub.src.layers.modeling.cached_multi_head_attention.CachedMultiHeadAttention.call",
}
_ATTENTION_METHODS = ("_compute_attention", "_masked_softmax", "_compute_attention_mask",
                      "_compute_causal_mask")
def _attention_why_not(op, num_tensor):
    """Why a keras MultiHeadAttention cannot be split by heads, or None."""
    parts = _compat.attention_parts(op)
    dense = [parts[k] for k in ("query", "key", "value", "gate", "output") if k in parts]
    if any(d is None for d in dense):
        return "it is not built (call the model once first)"
    cls, base = type(op), keras.layers.MultiHeadAttention
    if qualified(cls.call) not in _FOLLOWED_CALLS:
        return (f"its class {cls.__name__} overrides MultiHeadAttention.call, which hyparflow "
                "cannot follow head by head")
    for name in _ATTENTION_METHODS:
        if getattr(cls, name, None) is not getattr(base, name, None):
            return (f"its class {cls.__name__} overrides MultiHeadAttention.{name}, which "
                    "hyparflow cannot follow head by head")
    reason = common_why_not(op, [op] + dense)
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
    for first, second in _INNER_PAIRS.get(qualified(type(op).call), ()):
        a, b = getattr(op, first, None), getattr(op, second, None)
        if (isinstance(a, keras.layers.Dense) and isinstance(b, keras.layers.Dense)
                and a.built and b.built and a.units >= num_tensor
                and common_why_not(a, [a]) is None and common_why_not(b, [b]) is None
                and int(b.kernel.shape[0]) == a.units):
            out.append((a, b))
    return out


def refuse_cache(op, bound):
    """A key/value cache holds every head: decoding is not split."""
    if bound.arguments.get("cache") is not None:
        raise ValueError(
            f"Attention layer {op.name!r} is split by heads (num_tensor > 1) and was "
            "called with a key/value cache, which holds every head. Decode with "
            "num_tensor=1.")


class Heads(SplitKind):
    name = "heads"
    what = "MultiHeadAttention"

    def claims(self, op):
        return isinstance(op, keras.layers.MultiHeadAttention)

    def why_not(self, op, num_tensor):
        return _attention_why_not(op, num_tensor)

    def size(self, op):
        return op.num_heads

    def cuts(self, shard):
        return _attention_cuts(shard)

    def calls(self, shard):
        return _calls(shard)

    def exchange(self, split, out_bytes, in_bytes, num_tensor, network):
        # A sum of the outputs forward, of the input's gradient backward.
        return network.exchange(out_bytes, num_tensor), network.exchange(in_bytes, num_tensor)


class Inner(SplitKind):
    """The MultiHeadAttention layers inside another layer, by heads while it runs (and
    its feed-forward Dense pair by columns and rows): a `Nested` part."""
    name = "inner"
    what = "(or layers holding MultiHeadAttention layers)"

    def claims(self, op):
        return bool(_inner_attention(op))

    def why_not(self, op, num_tensor):
        for sub in _inner_attention(op):
            reason = _attention_why_not(sub, num_tensor)
            if reason is not None:
                return f"its attention layer {sub.name!r} cannot be split: {reason}"
        return None

    def members(self, op, num_tensor):
        """[(sublayer, its kind, Split options)] a `Nested` part splits: the attention
        layers by heads, the known feed-forward pair by columns then rows."""
        out = [(layer, _HEADS, {}) for layer in _inner_attention(op)]
        for first, second in _inner_pairs(op, num_tensor):
            out += [(first, _COLUMN, {"gather": False}), (second, _ROW, {})]
        return out

    def exchange(self, split, out_bytes, in_bytes, num_tensor, network):
        # A block also sums its feed-forward pair's, each way.
        return (2 * network.exchange(out_bytes, num_tensor),
                2 * network.exchange(in_bytes, num_tensor))


def _attention_cuts(shard):
    """MultiHeadAttention: the query/key/value (and gate) projections' kernels
    (dim, heads, size) and biases (heads, size) cut on their heads axis, the
    output projection's kernel (heads, size, out...) on its first; the output
    bias whole (added once, after the sum)."""
    parts = _compat.attention_parts(shard.op)
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


def _calls(shard):
    """{layer: function run in place of its `call`} while the attention layer runs:
    the projections compute this rank's heads only, the dropout on the attention
    probabilities draws the whole layer's mask and keeps this rank's heads of it,
    and the layer's own call is wrapped to enter the inputs and sum the outputs."""
    parts = _compat.attention_parts(shard.op)
    out = {}
    for name in ("query", "key", "value", "gate"):
        if name in parts:
            layer = parts[name]
            out[layer] = _projection(layer, shard.part_of[id(layer.kernel)],
                                     shard.part_of.get(id(layer.bias)))
    out[parts["output"]] = _projection(parts["output"], shard.part_of[id(parts["output"].kernel)],
                                       None)
    if shard.op.dropout > 0:
        out[parts["dropout"]] = _dropout(shard, parts["dropout"], parts["axes"])
    out[shard.op] = _attention(shard, parts)
    return out


def _heads(shard, x, axis):
    """This rank's heads of `x` (all heads on `axis`)."""
    index = [slice(None)] * len(x.shape)
    index[axis] = slice(shard.start, shard.start + shard.sizes[shard.rank])
    return x[tuple(index)]


def _dropout(shard, layer, axes):
    """Dropout of this rank's heads of the attention probabilities with the mask
    one process would draw for all heads: Keras draws a stateless uniform of the
    whole shape from the layer's seed generator, whose state every tensor rank
    shares, so each rank draws the whole mask and keeps its heads."""
    own = _compat.original_call(layer)
    heads = shard.op.num_heads

    def call(inputs, training=None):
        axis = len(inputs.shape) - 2 * len(axes) - 1  # (batch..., heads, queries, keys)
        shape = tf.unstack(tf.shape(inputs))
        shape[axis] = tf.constant(heads, shape[axis].dtype)
        ones = tf.ones(tf.stack(shape), inputs.dtype)
        mask = own(ones, training=training)
        if mask is ones:  # not training: the input as it is, as Keras returns it
            return inputs
        # x * (1 * scale or 0) is Keras's x * scale or 0, bit for bit.
        return keras.ops.multiply(inputs, _heads(shard, mask, axis))

    return call


def _attention(shard, parts):
    """The attention layer's own call, on this rank's heads: the inputs entered
    once each (the backward sums their gradients over the ranks), the partial
    output projections summed, the output bias added once."""
    op = shard.op
    own = _compat.original_call(op)
    signature = inspect.signature(own)
    out_bias = parts["output"].bias
    axes = parts["axes"]

    def call(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        refuse_cache(op, bound)
        entered, originals = {}, []
        for k, name in enumerate(("query", "value", "key")):
            x = bound.arguments.get(name)
            if x is None:
                continue
            originals.append(x)
            if id(x) not in entered:  # self-attention: one sum for query = value
                entered[id(x)] = _compat.set_keras_mask(
                    shard.coll.enter(x, shard.what, tag=shard.tag(ENTER + k)),
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
        y = shard.coll.sum(result, shard.what, tag=shard.tag(SUM))
        if out_bias is not None:
            y = keras.ops.add(y, out_bias)
        _compat.set_keras_mask(y, mask)
        if not rest:
            return y
        scores = rest[0]  # (batch..., heads, queries, keys): put the heads together
        axis = len(scores.shape) - 2 * len(axes) - 1
        return (y, shard.coll.gather(scores, shard.sizes, shard.what, axis=axis,
                                    tag=shard.tag(SCORES))) + rest[1:]

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
    """One rank's part of a layer that holds layers to split inside (Keras Hub's
    TransformerEncoder/Decoder, its LLM decoder blocks): each of them a Shard of its
    own, as its kind's `members(op, T)` lists them (for `Inner`: each attention layer
    by heads, a known Dense pair, `_INNER_PAIRS`, by columns then rows); their calls
    replaced while the outer layer runs as it is."""

    def __init__(self, op, split, rank, shares, collectives, site=0, kind=None):
        self.op, self.split, self.rank = op, split, rank
        made = []
        kind = kind if kind is not None else _INNER
        for layer, sub_kind, extra in kind.members(op, len(shares)):
            made.append(Shard(layer, Split(split.node, sub_kind.name, **extra), rank, shares,
                              collectives, site=site + 1 + len(made), kind=sub_kind))
        if len(made) >= SUBS:
            raise ValueError(f"Layer {op.name!r} holds {len(made)} layers to split; hyparflow "
                             f"splits at most {SUBS - 1} inside one layer. Use num_tensor=1 "
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


Inner.part = Nested  # a rank's part of a layer holding attention layers
_HEADS, _COLUMN, _ROW = Heads(), Column(), Row()  # the kinds a Nested part's layers take
_INNER = Inner()
