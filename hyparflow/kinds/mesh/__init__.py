"""2D tensor parallelism (Optimus): a stage's T = q x q tensor ranks as a mesh, the
activations of a mesh region partitioned by batch rows and features as well as the
weights (docs/tensor.md, "2D: the mesh").

A mesh region is a run of Dense and EinsumDense layers on the mesh (`dense`: SUMMA),
attention layers (`attention`: SUMMA projections, heads over the mesh columns),
Embeddings (`embedding`), an LM head's vocabulary-split logits (`logits`) and the
element-wise layers and LayerNormalizations between them (`elementwise`, `norm`);
values inside it are blocks, and where it meets a layer that is not on the mesh (or a
stage's or the model's output) the blocks are gathered whole (`grid.Mesh.to_whole`),
and a whole value entering it is cut (`to_block`). The same interface as the 1D kinds' registry: `choose` (which
nodes, and whether each gathers its output), `shard` (a rank's part), `describe`.
"""

from typing import Dict

from ..tensor import registry as _tensor
from ..tensor.split import MIN_PARAMS, Split
from .attention import MeshHeads
from .base import MeshKind
from .dense import MeshDense, MeshEinsum
from .embedding import MeshEmbedding
from .elementwise import MeshMap
from .grid import Mesh
from .logits import MeshLogits, eligible
from .norm import MeshNorm
from .part import MeshPart

__all__ = ["KINDS", "BY_NAME", "Mesh", "MeshPart", "choose", "shard", "describe", "why_not",
           "MIN_PARAMS"]

# Kinds that start a region (asked in order), and the kinds that carry it on (chosen
# only where the region feeds them).
KINDS = (MeshDense(), MeshEinsum(), MeshHeads(), MeshEmbedding())
CARRY = (MeshMap(), MeshNorm())
BY_NAME: Dict[str, MeshKind] = {MeshLogits.name: MeshLogits()}
BY_NAME.update({kind.name: kind for kind in KINDS + CARRY})


def describe(conjunction="and"):
    names = [k.what for k in KINDS]
    text = names[0] if len(names) == 1 else f"{', '.join(names[:-1])} {conjunction} {names[-1]}"
    return f"{text} layers"


def _kind(op):
    return next((k for k in KINDS if k.claims(op)), None)


def why_not(graph, i, q):
    """Why node `i` cannot start a mesh region (a sentence), or None."""
    node = graph.nodes[i]
    kind = _kind(node.op)
    if kind is None:
        return f"only {describe()} run on the mesh (element-wise layers between them too)"
    return _tensor.why_not(graph, i, q, kind=kind)


def choose(graph, nodes, num_tensor, layers=None, min_params=MIN_PARAMS):
    """{node index: Split} of one stage's mesh nodes: the Dense layers chosen (named
    in `layers`, else those with at least `min_params` weights that can be), then every
    element-wise layer fed by the region; `gather` is True where a node's output is
    read outside the region (another layer, another stage, the model's outputs)."""
    q = int(round(num_tensor ** 0.5))
    region = {}
    producers = {t: n.index for n in graph.nodes for t in n.outputs}
    for i in nodes:
        node = graph.nodes[i]
        if _kind(node.op) is not None and (layers is None or node.op.name in layers):
            reason = why_not(graph, i, q)
            if reason is None and (layers is not None or node.params >= min_params):
                region[i] = _kind(node.op).name
            elif reason is not None and layers is not None:
                raise ValueError(
                    f"Layer {node.op.name!r} is in tensor_layers but cannot run on the "
                    f"{q}x{q} tensor mesh: {reason}. Remove it from tensor_layers, or "
                    "leave tensor_mesh out for the 1D split.")
        elif _carries(graph, node, region, producers, q):
            region[i] = next(k for k in CARRY if k.claims(node.op)).name
    readers = {}
    for node in graph.nodes:
        for t in node.inputs:
            readers.setdefault(t, set()).add(node.index)
    outputs = set(graph.outputs)
    splits = {}
    for i, kind in region.items():
        out = graph.nodes[i].outputs
        gather = any(t in outputs or not readers.get(t) or readers[t] - set(region)
                     for t in out)
        if (kind in (MeshDense.name, MeshEinsum.name) and list(out) == list(graph.outputs)
                and not readers.get(out[0]) and graph.tensors[out[0]].mask is None
                and eligible(graph.functional, graph.nodes[i].op)):
            kind = MeshLogits.name  # the model's logits: cross-entropy on the blocks
        splits[i] = Split(i, kind, gather=gather)
    return splits


def _carries(graph, node, region, producers, q):
    """Whether `node` carries the region on: a carrying kind's layer fed by the region,
    its inputs alike in shape and floating, and it can run there."""
    kind = next((k for k in CARRY if k.claims(node.op)), None)
    tensors = [graph.tensors[t] for t in node.inputs]
    return (kind is not None and bool(tensors)
            and any(producers.get(t) in region for t in node.inputs)
            and len({tuple(t.shape) for t in tensors}) == 1
            and all(t.floating and len(t.shape) >= 2 for t in tensors)
            and (not node.op.weights or _tensor.why_not(graph, node.index, q, kind=kind) is None))


def shard(op, split, rank, shares, collectives):
    """This rank's part of layer `op` on the mesh (kept on the layer, as the 1D
    registry keeps its parts, so a later fit reuses its variables)."""
    cache = op.__dict__.setdefault("_hyparflow_mesh_parts", {})
    key = (split, rank, collectives.q)
    if key not in cache:
        cache[key] = MeshPart(op, split, rank, collectives, BY_NAME[split.kind])
    cache[key].coll = collectives
    return cache[key]

