"""Cut a LayerGraph into contiguous stages and list what crosses between them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Set, Tuple, Union

from .. import balance as _balance
from ..graph import LayerGraph

__all__ = ["StageCut", "Edge", "Partition", "partition", "Balance"]

# What `partition` takes as `balance`: None (the nodes' estimated costs), a mode
# resolved into numbers (loop.costs.resolve), or layer-call counts per stage. A mode
# name (str) is refused here with the fix.
Balance = Union[None, _balance.Resolved, Sequence[int], str]


@dataclass(frozen=True)
class Edge:
    """A boundary tensor sent from stage `src` to stage `dst` (index `index` among all edges)."""

    index: int
    tensor: int
    src: int
    dst: int


@dataclass
class StageCut:
    index: int
    nodes: List[int]            # node indices, in execution order
    data_inputs: List[int]      # tensor indices of model inputs this stage reads from data
    recv: List[Edge]            # Edges arriving here, sorted by index
    send: List[Edge]            # Edges leaving here, sorted by index
    outputs: List[int] = field(default_factory=list)  # model-output tensors (last stage only)

    @property
    def sources(self) -> List[int]:
        return sorted({e.src for e in self.recv})

    @property
    def dests(self) -> List[int]:
        return sorted({e.dst for e in self.send})


@dataclass
class Partition:
    counts: List[int]
    stages: List[StageCut]
    edges: List[Edge]
    owner: Dict[int, int]               # id(variable) -> lowest stage using it
    users: Dict[int, Tuple[int, ...]]   # id(variable) -> tuple of stages using it

    @property
    def num_stages(self) -> int:
        return len(self.stages)


def _counts(graph: LayerGraph, num_stages: int, balance: Balance) -> List[int]:
    n = len(graph.nodes)
    if num_stages > n:
        raise ValueError(
            f"num_stages={num_stages} is larger than the number of layer calls in the model "
            f"({n}); each stage needs at least one. Use num_stages <= {n}."
        )
    if balance is None:
        return _balance.solve([node.cost for node in graph.nodes], num_stages)
    if isinstance(balance, dict):  # resolved costs (see hyparflow.costs)
        if balance.get("speeds") is None and balance.get("limit") is None:
            return _balance.solve(balance["costs"], num_stages)
        return _balance.solve_limited(balance["costs"], num_stages, balance.get("speeds"),
                                      balance.get("memory"), balance.get("limit"))
    if isinstance(balance, str):
        raise ValueError(
            "`balance` must be None, 'estimate', 'params', 'time', 'memory' or a list of "
            f"layer-call counts per stage. Received: balance={balance!r}"
        )
    return _balance.check_counts(balance, n, num_stages)


def _check_text(graph: LayerGraph, edges: List[Edge], counts: List[int]) -> None:
    """Strings stay in the stage that makes them: activations travel as numbers."""
    for e in edges:
        t = graph.tensors[e.tensor]
        if t.dtype == "string" and t.producer is not None:
            layer = graph.nodes[t.producer].name
            raise ValueError(
                f"Layer {layer!r} gives strings that a layer of stage {e.dst} takes: the cut "
                f"between stages {e.src} and {e.dst} (layer calls per stage {counts}) would "
                "send text between ranks, and stages exchange numbers only. Keep the layers "
                "that turn the text into numbers (StringLookup, TextVectorization, Hashing) "
                f"in the stage of {layer!r}: pass balance=[...] (layer calls per stage) with "
                "another cut, or fewer stages.")


def partition(graph: LayerGraph, num_stages: int, balance: Balance = None) -> Partition:
    """Stages of consecutive layer calls; every tensor needed by a later stage is
    sent straight from its producer's stage to each consumer's stage, and model
    outputs go to the last stage, where the loss is computed."""
    counts = _counts(graph, num_stages, balance)
    stage_of_node: Dict[int, int] = {}
    start = 0
    groups: List[List[int]] = []
    for s, c in enumerate(counts):
        groups.append(list(range(start, start + c)))
        for i in range(start, start + c):
            stage_of_node[i] = s
        start += c
    last = num_stages - 1

    def stage_of_tensor(t: int) -> Optional[int]:
        producer = graph.tensors[t].producer
        return None if producer is None else stage_of_node[producer]

    needs: Dict[Tuple[int, int], int] = {}  # (tensor, dst) -> src
    data_inputs: List[Set[int]] = [set() for _ in range(num_stages)]
    for node in graph.nodes:
        dst = stage_of_node[node.index]
        for t in node.inputs:
            src = stage_of_tensor(t)
            if src is None:
                data_inputs[dst].add(t)
            elif src != dst:
                needs[(t, dst)] = src
    for t in graph.outputs:
        src = stage_of_tensor(t)
        if src is None:
            data_inputs[last].add(t)
        elif src != last:
            needs[(t, last)] = src
    edges = [Edge(k, t, needs[(t, dst)], dst) for k, (t, dst) in enumerate(sorted(needs))]
    _check_text(graph, edges, counts)

    stages = []
    for s in range(num_stages):
        stages.append(StageCut(
            s, groups[s], sorted(data_inputs[s]),
            [e for e in edges if e.dst == s], [e for e in edges if e.src == s],
            list(graph.outputs) if s == last else [],
        ))

    owner: Dict[int, int] = {}
    using: Dict[int, List[int]] = {}
    for s, group in enumerate(groups):
        for trainable in (True, False):
            for v in graph.variables_of(group, trainable):
                using.setdefault(id(v), [])
                if s not in using[id(v)]:
                    using[id(v)].append(s)
                owner.setdefault(id(v), s)
    users = {k: tuple(v) for k, v in using.items()}
    return Partition(counts, stages, edges, owner, users)
