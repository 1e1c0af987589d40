"""Keras Hub's LLM decoder blocks (Llama, Mistral, Qwen, Gemma), split inside while
they run, as Megatron-LM splits a decoder layer: the self-attention by heads (its
query, key, value and output projections are `EinsumDense` layers), the gated
feed-forward by columns (gate and up projections, whose product is element-wise, so
each rank's columns meet their own) and rows (the down projection: one sum).

Grouped-query attention (fewer key/value heads than query heads, each key/value head
serving a group of consecutive query heads): a rank takes whole groups, its key/value
heads and their query heads, so `num_key_value_heads` must be divisible by T (the
shares count groups). A single key/value head (multi-query attention, Gemma 2B) is
kept whole on every rank instead, the query heads split: each rank computes the
key and value projections itself, and their gradients, partial (from this rank's
query heads only), are summed over the ranks before they reach the weights or the
input, so the kept weights get the whole gradient, the same on every rank.

A block is recognised by its class's `call` and its attention's (`_BLOCKS`,
`_ATTENTIONS`: the Keras Hub code read, so a subclass overriding either is refused).
One rank's part is a `Nested` (attention.py) whose members this kind lists."""

import inspect
from dataclasses import dataclass

import keras

from ... import _compat
from .attention import Nested, refuse_cache
from .collectives import ENTER, SUBS, SUM
from .dense import Column, Row
from .split import SplitKind, common_why_not, qualified, weights_of

__all__ = ["Decoder", "QueryGroups", "EinsumColumn", "EinsumRow"]


@dataclass(frozen=True)
class _Block:
    attention: str
    columns: tuple  # the feed-forward's gate and up projections
    row: str  # its down projection


@dataclass(frozen=True)
class _Attention:
    query: str
    key: str
    value: str
    output: str
    dropout: str
    counts: tuple  # attributes (query heads, key/value heads, groups) the call reads
    head_axis: int  # the heads axis of the query/key/value kernels (and biases: 0)


_LLAMA_BLOCK = _Block("_self_attention_layer",
                      ("_feedforward_gate_dense", "_feedforward_intermediate_dense"),
                      "_feedforward_output_dense")
_BLOCKS = {
    "keras_hub.src.models.llama.llama_decoder.LlamaTransformerDecoder.call": _LLAMA_BLOCK,
    "keras_hub.src.models.mistral.mistral_transformer_decoder.MistralTransformerDecoder.call":
        _LLAMA_BLOCK,
    "keras_hub.src.models.qwen.qwen_decoder.QwenTransformerDecoder.call": _LLAMA_BLOCK,
    "keras_hub.src.models.gemma.gemma_decoder_block.GemmaDecoderBlock.call":
        _Block("attention", ("gating_ffw", "gating_ffw_2"), "ffw_linear"),
}

_LLAMA = _Attention("_query_dense", "_key_dense", "_value_dense", "_output_dense",
                    "_dropout_layer",
                    ("num_query_heads", "num_key_value_heads", "num_key_value_groups"), 1)
# Keyed by the attention class's module and name; its `call` and `_compute_attention`
# must be that class's own.
_ATTENTIONS = {
    "keras_hub.src.models.llama.llama_attention.LlamaAttention": _LLAMA,
    "keras_hub.src.models.qwen.qwen_attention.QwenAttention": _LLAMA,
    "keras_hub.src.models.mistral.mistral_attention.CachedMistralAttention": _Attention(
        "_query_dense", "_key_dense", "_value_dense", "_output_dense", "_dropout_layer",
        ("_num_query_heads", "_num_key_value_heads", "_num_key_value_groups"), 1),
    "keras_hub.src.models.gemma.gemma_attention.CachedGemmaAttention": _Attention(
        "query_dense", "key_dense", "value_dense", "output_dense", "dropout_layer",
        ("num_query_heads", "num_key_value_heads", "num_key_value_groups"), 0),
}


def _block(op):
    return _BLOCKS.get(qualified(type(op).call))


def _spec(attention):
    cls = type(attention)
    name = f"{cls.__module__}.{cls.__qualname__}"
    spec = _ATTENTIONS.get(name)
    if spec is None:
        return None
    for method in ("call", "_compute_attention"):
        if qualified(getattr(cls, method, None)) != f"{name}.{method}":
            return None
    return spec


def _heads(attention, spec):
    """(query heads, key/value heads) of a Keras Hub attention layer."""
    return getattr(attention, spec.counts[0]), getattr(attention, spec.counts[1])


def _attention_why_not(attention, num_tensor):
    spec = _spec(attention)
    if spec is None:
        return (f"its attention layer's class {type(attention).__name__} is not one hyparflow "
                "follows head by head (Llama, Mistral, Qwen, Gemma attention, not subclassed)")
    dense = [getattr(attention, getattr(spec, k), None)
             for k in ("query", "key", "value", "output")]
    if any(d is None or not d.built for d in dense):
        return "it is not built (call the model once first)"
    reason = common_why_not(attention, [attention] + dense)
    if reason is not None:
        return reason
    dropout = getattr(attention, spec.dropout, None)
    if dropout is not None and dropout.rate > 0:
        return (f"its attention dropout (rate {dropout.rate}) draws one mask over all heads; "
                "build the model with dropout=0 to split it")
    queries, kvs = _heads(attention, spec)
    if queries < num_tensor:
        return (f"it has fewer query heads ({queries}) than tensor ranks ({num_tensor}); each "
                "rank needs at least one head")
    if kvs != 1 and kvs % num_tensor:
        return (f"its {kvs} key/value heads cannot be shared by {num_tensor} tensor ranks: each "
                "rank takes whole groups of query heads with their key/value head, so "
                "num_key_value_heads must be divisible by num_tensor (or be 1, kept whole)")
    return None


def _ffn_why_not(layers, num_tensor):
    units = int(layers[0].kernel.shape[-1])
    for layer in layers:
        if not layer.built:
            return "it is not built (call the model once first)"
        reason = common_why_not(layer, [layer])
        if reason is not None:
            return f"its feed-forward layer {layer.name!r}: {reason}"
        if isinstance(layer, keras.layers.EinsumDense) and (
                layer.bias is not None or len(layer.kernel.shape) != 2):
            return (f"its feed-forward layer {layer.name!r} is not a plain matrix product "
                    "without a bias")
    if units < num_tensor:
        return f"its feed-forward has fewer units ({units}) than tensor ranks"
    return None


def _blocks_in(op):
    """The decoder blocks `op` is or holds (a backbone: a CausalLM's graph holds its
    backbone as one layer call)."""
    if _block(op) is not None:
        return [op]
    return [sub for sub in _compat.sublayers(op) if _block(sub) is not None]


class Decoder(SplitKind):
    """A Keras Hub LLM decoder block, or a layer holding some (a backbone): each
    block's attention by query/key-value groups (`QueryGroups`), its gated
    feed-forward by columns and rows (a `Nested` part)."""

    name = "decoder"
    what = "(or Keras Hub's Llama, Mistral, Qwen and Gemma decoder blocks or backbones)"
    part = Nested

    def claims(self, op):
        return bool(_blocks_in(op))

    def weights(self, op):
        """The variables the parts replace (the blocks' projections): a backbone's
        token embedding, tied to a CausalLM's output, stays whole and may be shared."""
        return [v for layer, _, _ in self.members(op, 1) for v in layer.weights]

    def why_not(self, op, num_tensor):
        blocks = _blocks_in(op)
        if 4 * len(blocks) >= SUBS:
            return (f"it holds {len(blocks)} decoder blocks; hyparflow splits at most "
                    f"{(SUBS - 1) // 4} inside one layer call")
        for block in blocks:
            reason = self._block_why_not(block, num_tensor)
            if reason is not None:
                return reason if block is op else f"its block {block.name!r}: {reason}"
        return None

    def _block_why_not(self, op, num_tensor):
        block = _block(op)
        attention = getattr(op, block.attention, None)
        if attention is None:
            return "it is not built (call the model once first)"
        reason = _attention_why_not(attention, num_tensor)
        if reason is not None:
            return f"its attention layer {attention.name!r} cannot be split: {reason}"
        layers = [getattr(op, name, None) for name in block.columns + (block.row,)]
        if any(layer is None for layer in layers):
            return "it is not built (call the model once first)"
        return _ffn_why_not(layers, num_tensor)

    def members(self, op, num_tensor):
        out = []
        for layer in _blocks_in(op):
            block = _block(layer)
            out.append((getattr(layer, block.attention), _GROUPS, {}))
            for name in block.columns:
                dense = getattr(layer, name)
                out.append((dense, _E_COLUMN if _einsum(dense) else _COLUMN, {"gather": False}))
            row = getattr(layer, block.row)
            out.append((row, _E_ROW if _einsum(row) else _ROW, {}))
        return out

    def exchange(self, split, out_bytes, in_bytes, num_tensor, network):
        # Per block. Forward: the attention's output summed, the down projection's; backward: the
        # input's gradient summed at the attention and at each of the two columns
        # (the key/value gradients of a kept single head are a head's size: left out).
        return (2 * network.exchange(out_bytes, num_tensor),
                3 * network.exchange(in_bytes, num_tensor))

    def repeats(self, op):
        # A backbone: its blocks' (their activations are the backbone's output's size).
        return len(_blocks_in(op))


def _einsum(layer):
    return isinstance(layer, keras.layers.EinsumDense)


class QueryGroups(SplitKind):
    """A Keras Hub attention layer by whole key/value groups (a rank's key/value heads
    and the query heads they serve), or by query heads around a single key/value head
    kept whole. Chosen only inside a `Decoder` block."""

    name = "query_groups"

    def size(self, op):
        queries, kvs = _heads(op, _spec(op))
        return queries if kvs == 1 else kvs

    def cuts(self, shard):
        op = shard.op
        spec = _spec(op)
        queries, kvs = _heads(op, spec)
        per = 1 if kvs == 1 else queries // kvs  # query heads per unit of `size`
        axis = spec.head_axis
        cuts = []
        for name, unit in (("query", per), ("key", 1), ("value", 1)):
            layer = getattr(op, getattr(spec, name))
            whole = kvs == 1 and name != "query"
            cuts.append((layer.kernel, None if whole else (axis, unit)))
            if layer.bias is not None:
                cuts.append((layer.bias, None if whole else (0, unit)))
        out = getattr(op, spec.output)
        cuts.append((out.kernel, (0, per)))
        if out.bias is not None:
            cuts.append((out.bias, None))
        return cuts

    def calls(self, shard):
        op = shard.op
        spec = _spec(op)
        kept = _heads(op, spec)[1] == 1
        out = {}
        for k, name in enumerate(("query", "key", "value")):
            layer = getattr(op, getattr(spec, name))
            kernel = shard.part_of.get(id(layer.kernel), layer.kernel)
            bias = shard.part_of.get(id(layer.bias), layer.bias)
            # Kept whole: the query's input is entered here (its gradient summed over
            # the ranks), and the key's and value's outputs (whose gradients are this
            # rank's query heads' part); split: the attention's input is entered once.
            out[layer] = _projection(shard, layer, kernel, bias,
                                     enter_in=kept and k == 0, enter_out=kept and k > 0,
                                     tag=ENTER + k)
        layer = getattr(op, spec.output)
        out[layer] = _projection(shard, layer, shard.part_of[id(layer.kernel)], None)
        out[op] = _attention(shard, spec, kept)
        return out


def _projection(shard, layer, kernel, bias, enter_in=False, enter_out=False, tag=None):
    """An EinsumDense's call on this rank's part (as Keras computes it)."""

    def call(inputs, training=None):
        if enter_in:
            inputs = shard.coll.enter(inputs, shard.what, tag=shard.tag(tag))
        x = keras.ops.einsum(layer.equation, inputs, kernel)
        if bias is not None:
            x = keras.ops.add(x, bias)
        if layer.activation is not None:
            x = layer.activation(x)
        if enter_out:
            x = shard.coll.enter(x, shard.what, tag=shard.tag(tag))
        return x

    return call


def _attention(shard, spec, kept):
    """The attention layer's own call on this rank's heads: the head counts it reads
    set to this rank's while it runs, the input entered (unless the key/value head is
    kept whole: then the projections enter), the partial outputs summed, the output
    bias added once."""
    op = shard.op
    own = _compat.original_call(op)
    signature = inspect.signature(own)
    first = next(iter(signature.parameters))
    queries, kvs = _heads(op, spec)
    mine = shard.sizes[shard.rank]
    local_q, local_kv = (mine, 1) if kept else (mine * (queries // kvs), mine)
    counts = dict(zip(spec.counts, (local_q, local_kv, local_q // local_kv)))
    if hasattr(op, "hidden_dim"):  # Gemma scales by hidden_dim // num_query_heads
        counts["hidden_dim"] = op.hidden_dim // queries * local_q
    out_bias = getattr(op, spec.output).bias

    def call(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        refuse_cache(op, bound)
        if not kept:
            x = bound.arguments[first]
            bound.arguments[first] = _compat.set_keras_mask(
                shard.coll.enter(x, shard.what, tag=shard.tag(ENTER)), _compat.keras_mask(x))
        saved = {name: getattr(op, name) for name in counts}
        try:
            for name, value in counts.items():
                object.__setattr__(op, name, value)
            result = own(*bound.args, **bound.kwargs)
        finally:
            for name, value in saved.items():
                object.__setattr__(op, name, value)
        mask = _compat.keras_mask(result)
        y = shard.coll.sum(result, shard.what, tag=shard.tag(SUM))
        if out_bias is not None:
            y = keras.ops.add(y, out_bias)
        return _compat.set_keras_mask(y, mask)

    return call


class EinsumColumn(SplitKind):
    """A feed-forward EinsumDense (a matrix product, no bias) by output columns, not
    gathered: the row partner sums."""

    name = "einsum_column"

    def size(self, op):
        return int(op.kernel.shape[-1])

    def cuts(self, shard):
        return [(shard.op.kernel, -1)]

    def call(self, shard, x):
        op = shard.op
        x = shard.coll.enter(x, shard.what, tag=shard.tag(ENTER))
        y = keras.ops.einsum(op.equation, x, weights_of(shard)[0])
        return op.activation(y) if op.activation is not None else y


class EinsumRow(SplitKind):
    """The feed-forward's down EinsumDense by input rows: partial products summed."""

    name = "einsum_row"

    def size(self, op):
        return int(op.kernel.shape[0])

    def cuts(self, shard):
        return [(shard.op.kernel, 0)]

    def call(self, shard, x):
        op = shard.op
        y = keras.ops.einsum(op.equation, x, weights_of(shard)[0])
        y = shard.coll.sum(y, shard.what, tag=shard.tag(SUM))
        return op.activation(y) if op.activation is not None else y


_GROUPS, _E_COLUMN, _E_ROW = QueryGroups(), EinsumColumn(), EinsumRow()
_COLUMN, _ROW = Column(), Row()
