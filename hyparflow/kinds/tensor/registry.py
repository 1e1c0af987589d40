"""The split kinds, and what dispatches on them: `why_not`, `choose` (which nodes of a
stage to split, and how), `shard` (a rank's part) and `exchange` (the planner's cost
of a split's collectives).

A new kind is one file (a `SplitKind`: see `split.py`, and dense.py for an example)
and one line in `KINDS`."""

from .attention import Heads, Inner
from .conv import Filters
from .decoder import Decoder, EinsumColumn, EinsumRow, QueryGroups
from .dense import Column, Row
from .embedding import Rows
from .collectives import SUBS
from .shard import Shard
from .split import MIN_PARAMS, Split

__all__ = ["KINDS", "BY_NAME", "kind_of", "describe", "why_not", "choose", "shard", "exchange"]

# The kinds, in the order they are asked to claim a layer (the first that claims it
# splits it; a layer holding attention layers is claimed last).
KINDS = (Column(), Row(), Filters(), Rows(), Heads(), Decoder(), QueryGroups(), EinsumColumn(),
         EinsumRow(), Inner())
BY_NAME = {kind.name: kind for kind in KINDS}
Shard.kinds.update(BY_NAME)


def kind_of(op):
    """The kind that splits layer `op`, or None."""
    return next((kind for kind in KINDS if kind.what and kind.claims(op)), None)


def describe(conjunction="and"):
    """The layers the kinds split, for messages: "Dense, Conv2D, Embedding and
    MultiHeadAttention layers (or Keras Hub's ... decoder blocks, or layers holding
    MultiHeadAttention layers)"."""
    names = [k.what for k in KINDS if k.what and not k.what.startswith("(")]
    extra = [k.what.strip("()") for k in KINDS if k.what and k.what.startswith("(")]
    text = names[0] if len(names) == 1 else f"{', '.join(names[:-1])} {conjunction} {names[-1]}"
    return f"{text} layers" + (f" ({', '.join(extra)})" if extra else "")


def why_not(graph, i, num_tensor, kind=None):
    """Why node `i` cannot be split (a sentence), or None if it can. `kind`: the kind
    asked (another layout's, the mesh's), else the registry's for the layer."""
    op = graph.nodes[i].op
    kind = kind_of(op) if kind is None else kind
    if kind is None:
        return f"only {describe()} can be split"
    calls, holders = graph.sharing
    if calls.get(id(op)) != 1:
        return "the layer is called more than once (shared weights)"
    others = [j for v in kind.weights(op) for j in holders.get(id(v), ())
              if graph.nodes[j].op is not op]
    if others:
        return (f"its weights are also used by layer {graph.nodes[min(others)].op.name!r} "
                "(tied weights), which would need the whole of them")
    return kind.why_not(op, num_tensor)


class _Context:
    """What a kind's `splits` may look at: the stage's nodes, the nodes picked, the
    splits made so far, and each tensor's consumers."""

    def __init__(self, graph, nodes, chosen, splits):
        self.nodes, self.chosen, self.splits = nodes, chosen, splits
        self.consumers = {}
        for node in graph.nodes:
            for t in node.inputs:
                self.consumers.setdefault(t, []).append(node.index)


def choose(graph, nodes, num_tensor, layers=None, min_params=MIN_PARAMS):
    """{node index: Split} for the nodes of one stage. `layers`: names to split
    (an error names any that cannot be), or None for every layer a kind splits
    (`describe()`) with at least `min_params` weights that can be."""
    if num_tensor == 1:
        return {}
    picked = []
    for i in nodes:
        node = graph.nodes[i]
        if layers is not None and node.op.name not in layers:
            continue
        reason = why_not(graph, i, num_tensor)
        if reason is None and (layers is not None or node.params >= min_params):
            picked.append(i)
        elif reason is not None and layers is not None:
            raise ValueError(f"Layer {node.op.name!r} is in tensor_layers but cannot be split "
                             f"over {num_tensor} ranks: {reason}. Remove it from tensor_layers.")
    splits = {}
    context = _Context(graph, nodes, set(picked), splits)
    for i in picked:
        if i not in splits:
            splits.update(kind_of(graph.nodes[i].op).splits(graph, i, context))
    return splits


def shard(op, split, rank, shares, collectives):
    """This rank's part of layer `op`, kept on the layer so that a later fit with
    the same split reuses its variables (and the optimizer state built for them)."""
    cache = op.__dict__.setdefault("_hyparflow_shards", {})
    key = (split, rank, tuple(shares))
    if key not in cache:
        kind = BY_NAME[split.kind]
        cache[key] = (kind.part or Shard)(op, split, rank, shares, collectives,
                                          site=split.node * SUBS, kind=kind)
    cache[key].coll = collectives
    return cache[key]


def exchange(split, out_bytes, in_bytes, num_tensor, network, op=None):
    """(forward, backward) seconds of split `split`'s collectives per call (of layer
    `op`, when given: a kind may run its collectives several times per call)."""
    kind = BY_NAME[split.kind]
    forward, backward = kind.exchange(split, out_bytes, in_bytes, num_tensor, network)
    times = kind.repeats(op) if op is not None else 1
    return forward * times, backward * times
