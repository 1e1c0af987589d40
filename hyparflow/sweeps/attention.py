"""The sweep's fused MultiHeadAttention: the members' attention layers as one, each
member's heads in its own slice (a kind of `kinds.Kind`)."""

import keras
import tensorflow as tf
from keras import ops

from .. import _compat
from .kinds import EinsumDense, Kind, _fold, _plain, _unfold, member_dropout

__all__ = ["MultiHeadAttention"]


class MultiHeadAttention(Kind):
    """Projections fused (EinsumDense); the attention on the members folded into the
    batch, with member 0's own method (it has no weights), or once per member with its
    own method when a member has attention dropout (its own rate and seed)."""

    classes = (keras.layers.MultiHeadAttention,)
    varying = frozenset({"dropout"})
    _PARTS = ("query", "key", "value", "gate", "output")

    @classmethod
    def accepts(cls, layer, calls):
        if not super().accepts(layer, calls):
            return False
        parts = _compat.attention_parts(layer)
        if not all(type(parts[p]) is keras.layers.EinsumDense and _plain(parts[p])
                   for p in cls._PARTS if p in parts):
            return False
        for _, kwargs in calls:
            if kwargs.get("return_attention_scores") or any(
                    kwargs.get(m) is not None for m in ("query_mask", "value_mask", "key_mask")):
                return False
        return True

    def __init__(self, layers, slot):
        super().__init__(layers, slot)
        parts = [_compat.attention_parts(layer) for layer in self.layers]
        self.projections = {name: EinsumDense([p[name] for p in parts], slot)
                            for name in self._PARTS if name in parts[0]}
        self.dropouts = [p["dropout"] for p in parts]

    def _bind(self, args, kwargs):
        names = ("query", "value", "key", "query_mask", "value_mask", "key_mask",
                 "attention_mask", "return_attention_scores", "training", "use_causal_mask")
        bound = dict(zip(names, args))
        bound.update(kwargs)
        return bound

    def call(self, args, kwargs, training, ctx):
        a = self._bind(args, kwargs)
        training = a.get("training") if training is None else training
        query, value = a["query"], a["value"]
        key = a.get("key") if a.get("key") is not None else value
        attention_mask = a.get("attention_mask")
        causal = bool(a.get("use_causal_mask", False))
        layer = self.layers[0]
        causal_only = (causal and attention_mask is None
                       and getattr(layer, "_sliding_window", None) is None)
        if causal_only:
            mask, extra = None, {"use_causal_mask": True}
        else:
            mask = layer._compute_attention_mask(
                _fold(query), _fold(value),
                attention_mask=None if attention_mask is None else _fold(attention_mask),
                use_causal_mask=causal)
            extra = {}
        gate = self.projections["gate"].call([query], {}, training, ctx) \
            if "gate" in self.projections else None
        q = self.projections["query"].call([query], {}, training, ctx)
        k = self.projections["key"].call([key], {}, training, ctx)
        v = self.projections["value"].call([value], {}, training, ctx)
        if any(l._dropout > 0.0 for l in self.layers):
            masks = [None] * self.n if mask is None else _unfold(mask, self.n)
            out = tf.stack([self._member_attention(p, q[p], k[p], v[p], masks[p], training, ctx,
                                                   extra)
                            for p in range(self.n)])
        else:
            out, _ = layer._compute_attention(_fold(q), _fold(k), _fold(v), mask, training,
                                              False, **extra)
            out = _unfold(out, self.n)
        if gate is not None:
            out = ops.multiply(out, gate)
        return self.projections["output"].call([out], {}, training, ctx)

    def _member_attention(self, p, q, k, v, mask, training, ctx, extra):
        layer = self.layers[p]
        dropout = self.dropouts[p]
        if ctx is not None and ctx.rows is not None and training and layer._dropout > 0.0:
            # The attention probabilities' mask for this replica's rows of the batch.
            def rows_dropout(inputs, training=None):
                return member_dropout(inputs, dropout, ctx) if training else inputs

            with _compat.calls_replaced({dropout: rows_dropout}):
                return layer._compute_attention(q, k, v, mask, training, False, **extra)[0]
        return layer._compute_attention(q, k, v, mask, training, False, **extra)[0]


# Layers without weights that compute each sample alone: the members fold into the batch.
