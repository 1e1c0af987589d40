"""The sweep's layer kinds in the order they are tried, and `choose`: the kind that
fuses one layer of the members (or `Loop`, with why)."""

import keras

from .attention import MultiHeadAttention
from .conv import Conv
from .kinds import (BatchNormalization, Dense, Dropout, EinsumDense, Embedding, Fold,
                    LayerNormalization, Loop, _FOLD_LAYERS, config_differences)

__all__ = ["KINDS", "choose"]


KINDS = (Dense, EinsumDense, Conv, Embedding, BatchNormalization, LayerNormalization, Dropout,
         MultiHeadAttention, Fold)


def choose(layers, calls):
    """(kind class, why it is not fused or None) for one layer of the members."""
    layer = layers[0]
    for kind in KINDS:
        if kind.accepts(layer, calls):
            differences = config_differences(layers, kind.varying)
            if not differences:
                return kind, None
            p, key, first, other = differences[0]
            return Loop, f"member {p} has {key}={other!r} where member 0 has {first!r}"
    if isinstance(layer, keras.layers.Layer) and not layer.weights and type(layer) in _FOLD_LAYERS:
        return Loop, "called on a value without a batch axis first"
    return Loop, "no fused kind for it"
