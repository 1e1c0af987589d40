"""`hyparflow plan --search layers`: per-layer strategies, searched with the cost model.

The global search (`planner.search`) tries every (stages, tensor ranks, replicas,
microbatches, schedule) and splits, with T > 1, the layers the rule picks (every
splittable layer of at least `MIN_PARAMS` weights). Here each splittable layer is
split or kept whole on its own, and the cut follows the choice:

1. for each shape (S, T, R, M, schedule), a seed by dynamic programming over the
   layer chain: each layer's cost per microbatch is the cheaper of whole (its time;
   every tensor rank computes it) and split (its time over T plus its exchanges,
   forward and backward, as `kinds.tensor.exchange` prices them), and the exact
   contiguous cut of those costs (`balance.solve`, a dynamic programme) gives the
   stages;
2. local moves from the best seeds, best first, while time is left: flip one layer
   (split / whole), move one stage boundary by one layer call; a move is kept when
   `planner.predict` (the schedule played by the simulator, the allreduce, memory)
   says the step is faster and the plan fits.

Both searches are priced by one model here: the layer profiles (and the stage costs
and contention measured on this node), not the stages timed whole, which time only
the rule's split layers. Pure Python on top of the planner."""

from __future__ import annotations

import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .costmodel import Row
from .planner import predict
from ..layout import resolve

__all__ = ["layers", "splittable"]


def splittable(graph: Any, num_tensor: int) -> List[int]:
    """Node indices a kind can split over `num_tensor` ranks (any size)."""
    from ..kinds import tensor as T

    return [i for i in range(len(graph.nodes)) if T.why_not(graph, i, num_tensor) is None]


def _split_cost(graph: Any, i: int, num_tensor: int, m: float, network: Any,
                row: Row) -> float:
    """Seconds of node i per microbatch, split alone over `num_tensor` ranks."""
    from ..kinds import tensor as T
    from .planner import _elements

    node = graph.nodes[i]
    split = T.choose(graph, [i], num_tensor, [node.op.name])[i]
    out_bytes, in_bytes = (4 * m * _elements(graph, t) for t in (node.outputs[0], node.inputs[0]))
    forward, backward = T.exchange(split, out_bytes, in_bytes, num_tensor, network, op=node.op)
    return row.seconds(m) / num_tensor + forward + backward


def layers(graph: Any, rows: Sequence[Any], opt_per_byte: float, network: Any, batch: int,
           ranks: int, memory_limit: Optional[float] = None,
           microbatches: Sequence[int] = (1, 2, 4, 8, 16), schedules: Sequence[str] = ("1f1b",),
           tensor: Sequence[int] = (1, 2, 4), seconds: float = 30.0, seeds: int = 8,
           **model: Any) -> Tuple[Optional[Dict[str, Any]], Dict[str, Any]]:
    """The best per-layer plan (as `planner.search`'s, with its `tensor_layers` and
    "search": "layers"), or None when no shape has a layer to split, and what the
    search did ({"seconds", "predicted", "shapes", "plans": every strategy priced}). `model`: `predict`'s keywords
    (ranks_per_node, cores, compute, stage_costs)."""
    from .. import balance as B

    start = time.monotonic()
    rows = [Row(*r) for r in rows]
    evaluated = 0
    explored: List[Dict[str, Any]] = []  # every strategy priced, for --explore-all

    def price(shape: Any, counts: Sequence[int], split: Sequence[int]) -> Dict[str, Any]:
        nonlocal evaluated
        evaluated += 1
        names = sorted(graph.nodes[i].op.name for i in split)
        p: Dict[str, Any] = predict(graph, rows, opt_per_byte, network, list(counts), batch,
                                    shape.num_replicas, shape.num_microbatches, shape.schedule,
                                    num_tensor=shape.num_tensor,
                                    tensor_layers=names if shape.num_tensor > 1 else None,
                                    **model)
        p.update(stages=shape.num_stages, tensor=shape.num_tensor, replicas=shape.num_replicas,
                 microbatches=shape.num_microbatches, schedule=shape.schedule,
                 counts=list(counts), chunks=1, search="layers", split=sorted(split),
                 fits=memory_limit is None or max(p["memory_bytes"]) <= memory_limit)
        explored.append(p)
        return p

    seeded: List[Tuple[Any, Dict[str, Any]]] = []
    shapes = 0
    for t in tensor:
        able = splittable(graph, t) if t > 1 else []
        if ranks % t or (t > 1 and not able):
            continue
        for s in range(1, ranks // t + 1):
            if (ranks // t) % s or s > len(graph.nodes):
                continue
            for micro in microbatches:
                for name in (schedules if s > 1 else ("1f1b",)):
                    shape = resolve(ranks, num_stages=s, num_tensor=t, num_microbatches=micro,
                                    schedule=name, environ={})
                    if batch < shape.num_replicas * micro:
                        continue
                    shapes += 1
                    m = batch / (shape.num_replicas * micro)
                    cost = [r.seconds(m) for r in rows]
                    split: List[int] = []
                    for i in able:  # the DP's per-layer choice: the cheaper of the two
                        alone = _split_cost(graph, i, t, m, network, rows[i])
                        if alone < cost[i]:
                            cost[i], split = alone, split + [i]
                    if t > 1 and not split:  # T ranks with nothing to split: no plan
                        split = [max(able, key=lambda i: rows[i].seconds(m))]
                    seeded.append((shape, price(shape, B.solve(cost, s), split)))
    if not seeded:
        return None, {"seconds": time.monotonic() - start, "predicted": 0, "shapes": 0,
                      "plans": []}
    seeded.sort(key=lambda c: (not c[1]["fits"], c[1]["step_s"]))
    best = seeded[0][1]
    for shape, plan in seeded[:seeds]:
        able = splittable(graph, shape.num_tensor) if shape.num_tensor > 1 else []
        plan = _climb(shape, plan, able, price, start + seconds)
        if (not plan["fits"], plan["step_s"]) < (not best["fits"], best["step_s"]):
            best = plan
        if time.monotonic() > start + seconds:
            break
    return best, {"seconds": time.monotonic() - start, "predicted": evaluated, "shapes": shapes,
                  "plans": explored}


def _climb(shape: Any, plan: Dict[str, Any], able: Sequence[int], price: Any,
           deadline: float) -> Dict[str, Any]:
    """Local moves from `plan` (flip a layer, move a boundary by one) while one is
    faster and fits, until none is or the deadline."""
    improved = True
    while improved and time.monotonic() < deadline:
        improved = False
        split, counts = set(plan["split"]), list(plan["counts"])
        moves: List[Tuple[List[int], List[int]]] = []
        for i in able:
            flipped = sorted(split ^ {i})
            if flipped or shape.num_tensor == 1:
                moves.append((counts, flipped))
        for b in range(len(counts) - 1):
            for d in (-1, 1):
                moved = list(counts)
                moved[b] += d
                moved[b + 1] -= d
                if min(moved) >= 1:
                    moves.append((moved, sorted(split)))
        for moved, chosen in moves:
            if time.monotonic() > deadline:
                break
            other = price(shape, moved, chosen)
            if other["fits"] >= plan["fits"] and other["step_s"] < plan["step_s"] * (1 - 1e-9):
                plan, improved = other, True
                break
    return plan
