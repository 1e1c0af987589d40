"""Pooled lookups: a sharded Embedding over a bag of ids whose rows are only summed
(or averaged) per sample, as Keras users write it, is pooled by the owners of its
rows (`Lookup.pooled`): one vector per sample travels instead of one per id.

`find` recognises, for certain, the forms whose result is a function of the sum
(anything else keeps the per-id lookup, whose result is Keras's whatever follows):

- `Embedding` (bag axis 1) -> `GlobalAveragePooling1D` (channels_last), with the
  Embedding's own `mask_zero` mask or none: Keras's masked mean is
  sum(rows x mask) / sum(mask); unmasked, the mean over the bag;
- `Embedding` -> `keras.ops.sum(x, axis=1)` (the `Sum` operation; it takes no mask,
  so padding ids are summed, as in Keras);
- keras_rs's `EmbedReduce` (an Embedding that reduces itself; DistributedEmbedding's
  tables off TPU) over 2D ids with no per-id weights: "sum", "mean", "sqrtn".

The Embedding's call then returns the owners' pooled sums, and the pooling call
(`PoolTaken`, in the stage's `shards` at the pooling node) divides them as the
pooling layer would (nothing else reads the Embedding's output: `find` checks)."""

from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import keras
import tensorflow as tf

__all__ = ["Pooling", "PoolTaken", "find", "is_embed_reduce"]


@dataclass(frozen=True)
class Pooling:
    combiner: str  # "sum", "mean" or "sqrtn" (EmbedReduce)
    masked: bool  # sum only where the Embedding's mask (ids != 0) is true
    node: Optional[int]  # the pooling call taken over; None: the layer pools itself
    keepdims: bool = False
    bag: Optional[int] = None  # the bag's length (an unmasked mean divides by it)


def is_embed_reduce(op: Any) -> bool:
    """keras_rs's EmbedReduce (without importing keras_rs: it is optional)."""
    return any(c.__name__ == "EmbedReduce" and c.__module__.startswith("keras_rs")
               for c in type(op).__mro__)


def _float32(op: Any) -> bool:
    return bool(getattr(op, "compute_dtype", None) == "float32")


def _sum_axis(op: Any) -> bool:
    """Whether `op` is keras.ops.sum over axis 1 of a rank-3 value."""
    if type(op).__name__ != "Sum" or not type(op).__module__.startswith("keras.src.ops"):
        return False
    axis = getattr(op, "axis", None)
    axis = list(axis) if isinstance(axis, (list, tuple)) else [axis]
    return bool(axis in ([1], [-2]))


def find(graph: Any, i: int) -> Optional[Pooling]:
    """The pooling of Embedding node `i`'s rows, or None (the per-id lookup)."""
    node = graph.nodes[i]
    op = node.op
    if not _float32(op) or len(node.inputs) != 1 or node.keras_node.arguments.kwargs:
        return None
    ids = graph.tensors[node.inputs[0]]
    if len(ids.shape) != 2:  # (batch, bag)
        return None
    if is_embed_reduce(op):
        if op.combiner not in ("sum", "mean", "sqrtn"):
            return None
        return Pooling(op.combiner, False, None)
    out = node.outputs[0]
    if out in graph.outputs:
        return None
    users = [j for j, n in enumerate(graph.nodes) if out in n.inputs]
    if len(users) != 1:
        return None
    j = users[0]
    pool = graph.nodes[j]
    args, kwargs = pool.keras_node.arguments.args, dict(pool.keras_node.arguments.kwargs)
    mine = graph.tensors[out].keras_tensor
    if (len(args) != 1 or args[0] is not mine or len(pool.outputs) != 1
            or graph.tensors[pool.outputs[0]].dtype != "float32"):
        return None
    keepdims = bool(getattr(pool.op, "keepdims", False))
    if type(pool.op) is keras.layers.GlobalAveragePooling1D:
        if pool.op.data_format != "channels_last" or set(kwargs) - {"mask"}:
            return None
        mask = kwargs.get("mask")
        if mask is None:
            bag = ids.shape[1]
            return None if bag is None else Pooling("mean", False, j, keepdims, int(bag))
        # Only the Embedding's own mask (ids != 0), which the owners apply to the ids.
        if not getattr(op, "mask_zero", False) or mask is not getattr(mine, "_keras_mask", None):
            return None
        return Pooling("mean", True, j, keepdims)
    if _sum_axis(pool.op) and not kwargs:
        return Pooling("sum", False, j, keepdims)
    return None


def reduce_as_embed_reduce(pooled: Any, ids: Any, combiner: str) -> Any:
    """EmbedReduce's divisor (its weights are ones without `weights`), as it computes it."""
    if combiner == "sum":
        return pooled
    ones = keras.ops.ones_like(ids, dtype=pooled.dtype)[..., None]
    if combiner == "mean":
        return keras.ops.divide_no_nan(pooled, keras.ops.sum(ones, axis=-2))
    return keras.ops.divide_no_nan(pooled, keras.ops.sqrt(keras.ops.sum(
        keras.ops.square(ones), axis=-2)))


class PoolTaken:
    """The pooling call whose sums the owners made (`pooling.node`): what the pooling
    layer does after the sum (a mean divides by the bag's valid-id count, as
    Keras's masked GlobalAveragePooling1D: sum(x * mask) / sum(mask)). A shard of
    the stage with no variables of its own."""

    replaces: Dict[int, Any] = {}

    def __init__(self, op: Any, pooling: Pooling) -> None:
        self.op, self.pooling = op, pooling

    def load(self) -> None:
        pass

    def gather(self) -> None:
        pass

    def slots(self, optimizer: Any) -> List[Any]:
        return []

    def __call__(self, args: Any, kwargs: Dict[str, Any], training: Optional[bool] = None) -> Any:
        pooled = args[0]  # (batch, dim): the owners' sums
        if self.pooling.combiner == "mean":
            mask = kwargs.get("mask")
            if mask is not None:
                count = tf.reduce_sum(tf.cast(mask, pooled.dtype), axis=1, keepdims=True)
            else:
                count = tf.cast(self.pooling.bag, pooled.dtype)
            pooled = pooled / count
        return tf.expand_dims(pooled, 1) if self.pooling.keepdims else pooled
