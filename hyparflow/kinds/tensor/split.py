"""What every split kind shares: `Split` (how a node is split), the shares and sizes of
the T ranks' parts, the reasons that stop any kind, and `SplitKind`, the base of the
kinds (one file each: dense, conv, embedding, attention; listed in `registry`)."""

from dataclasses import dataclass
from typing import Any, List, Optional, Sequence

__all__ = ["MIN_PARAMS", "Split", "SplitKind", "ByOutputs", "shares_of", "split_sizes",
           "common_why_not", "qualified"]

MIN_PARAMS = 1 << 16  # layers with fewer weights are not split unless named

@dataclass(frozen=True)
class Split:
    """How node `node` is split: `kind` names a `SplitKind` of the registry: "column"
    (Dense outputs; `gather`: put the output back together, else the next node is its
    "row" partner), "row" (Dense inputs, partial sums added), "filters" (Conv2D),
    "rows" (Embedding), "heads" (MultiHeadAttention) or "inner" (the
    MultiHeadAttention layers inside another layer, split by heads while it runs)."""

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
_TERMS = ("kernel_regularizer", "bias_regularizer", "activity_regularizer",
          "embeddings_regularizer", "kernel_constraint", "bias_constraint",
          "embeddings_constraint")


def qualified(fn):
    return f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', '')}"


def common_why_not(op: Any, layers: Sequence[Any]) -> Optional[str]:
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


class SplitKind:
    """One way of splitting a layer over T ranks. A kind answers:

    - `claims(op)`: whether it is the kind for layer `op` (the registry asks the kinds
      in order; the first that claims a layer splits it);
    - `why_not(op, num_tensor)`: why `op` cannot be split this way (a sentence), or None;
    - `splits(graph, i, context)`: {node: Split} for node `i` (a kind may split a
      partner node with it, as the Dense pair does);
    - `size(op)`: the units cut over the ranks (columns, filters, rows, heads);
    - `cuts(shard)`: [(layer variable, axis it is cut on, or None: kept whole)];
    - `call(shard, x)`: this rank's part of the layer's call on `x`, collectives
      included; or `calls(shard)`: {layer: function run in place of its `call`};
    - `exchange(split, out_bytes, in_bytes, num_tensor, network)`: the seconds of its
      collectives per call, (forward, backward), for the planner (`repeats(op)` times:
      a backbone holding several blocks);
    - `weights(op)`: the variables its parts replace (no other layer may use them).

    `what` names the layers it splits in messages ("Dense"), None for a kind that is
    only chosen with another (a Dense pair's "row"). `part`: the class of a rank's
    part, None for a `Shard` (the kind's cuts and calls)."""

    name: str = ""
    what: str | None = None
    part: type | None = None

    def claims(self, op):
        return False

    def why_not(self, op, num_tensor):
        return None

    def splits(self, graph, i, context):
        return {i: Split(i, self.name)}

    def weights(self, op):
        """The variables of `op` its parts replace (no other layer may use them)."""
        return op.weights

    def size(self, op):
        raise NotImplementedError(f"split kind {self.name!r} gives no size")

    def cuts(self, shard):
        raise NotImplementedError(f"split kind {self.name!r} gives no cuts")

    def call(self, shard, x):
        raise NotImplementedError(f"split kind {self.name!r} has no call")

    def calls(self, shard):
        return {shard.op: lambda inputs, training=None, **_: self.call(shard, inputs)}

    def exchange(self, split, out_bytes, in_bytes, num_tensor, network):
        return 0.0, 0.0

    def repeats(self, op):
        """How many times `exchange`'s collectives run per call of `op` (a layer
        holding several blocks split alike)."""
        return 1


def weights_of(shard: Any) -> List[Any]:
    """This rank's parts of the layer's variables, as the layer computes with them."""
    import tensorflow as tf

    return [tf.cast(part.value, shard.op.compute_dtype) for _, part, _ in shard.cuts]


def output_split_call(shard, x, product):
    """A layer split by its outputs (Dense columns, Conv2D filters): the input entered
    whole (the backward sums its gradient over the ranks), this rank's outputs by
    `product(x, kernel part)`, its bias part and the activation; the outputs gathered
    unless a row partner sums them."""
    import keras
    import tensorflow as tf

    from .collectives import ENTER, GATHER

    op = shard.op
    x = tf.cast(x, op.compute_dtype) if x.dtype.is_floating else x
    weights = weights_of(shard)
    x = shard.coll.enter(x, shard.what, tag=shard.tag(ENTER))
    y = product(x, weights[0])
    if op.use_bias:
        y = keras.ops.add(y, weights[1])
    if op.activation is not None:
        y = op.activation(y)
    if shard.split.gather:
        y = shard.coll.gather(y, shard.sizes, shard.what, tag=shard.tag(GATHER))
    return y


class ByOutputs(SplitKind):
    """A layer split by its output units (Dense columns, Conv2D filters): the kernel's
    last axis and the bias cut, `product(op)` the layer's own kernel product."""

    def product(self, op):
        raise NotImplementedError

    def size(self, op):
        return int(op.kernel.shape[-1])

    def cuts(self, shard):
        op = shard.op
        return [(op.kernel, -1)] + ([(op.bias, 0)] if op.use_bias else [])

    def call(self, shard, x):
        return output_split_call(shard, x, self.product(shard.op))

    def exchange(self, split, out_bytes, in_bytes, num_tensor, network):
        # Forward: the outputs gathered (each rank sends its units), or nothing when
        # a row partner sums; backward: the input's gradient summed.
        forward = network.exchange(out_bytes / num_tensor, num_tensor) if split.gather else 0.0
        return forward, network.exchange(in_bytes, num_tensor)
