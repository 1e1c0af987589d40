"""A parallel plan as a small JSON file: stages with their layer calls, replicas,
microbatches, schedule and rank mapping. `fit(plan=...)` reads it; `hyparflow plan`
writes it.

    {
      "format": "hyparflow-plan", "version": 1,
      "num_stages": 2, "num_replicas": 2, "num_microbatches": 8, "schedule": "1f1b",
      "num_tensor": 1,                          # optional: ranks per stage splitting layers
      "tensor_layers": ["dense_1", ...],        # optional: which layers they split
      "tensor_mesh": [2, 2],                    # optional: the T ranks as a 2D mesh
      "rank_mapping": "replica-major",          # rank = (replica * S + stage) * T + tensor
      "stages": [{"layers": ["conv2d", "batch_normalization", ...]}, {"layers": [...]}],
      "predicted": {...},                       # optional: the planner's cost estimate
      "tables": {"user": "row", "item": "table"}  # optional: embedding_sharding
    }

Layer calls are named as `hyparflow.graph` names them: the layer's name, with `#2`,
`#3`... for its second and later calls.
"""

from __future__ import annotations

import json
from typing import Any, Mapping, Optional

__all__ = ["Plan", "read", "write", "counts_for"]

FORMAT, VERSION = "hyparflow-plan", 1


class Plan(dict):  # type: ignore[type-arg]
    """The plan's fields, as read from JSON."""

    @property
    def counts(self) -> list[int]:
        return [len(s["layers"]) for s in self["stages"]]


def write(path: str, graph: Any, layout: Any,
          predicted: Optional[Mapping[str, float]] = None,
          tables: Optional[Mapping[str, str]] = None) -> "Plan":
    """Write `layout` (a hyparflow.layout.Layout whose `balance` is the layer-call count
    of each stage) as a plan for `graph`'s model; `tables`: the Embedding tables'
    sharding kinds ({layer name: kind}), which `fit(plan=...)` uses as its
    `embedding_sharding` (kinds/tables/cost.py)."""
    counts = list(layout.balance)
    chunks = getattr(layout, "num_chunks", 1)  # interleaved: S x chunks virtual stages
    if len(counts) != layout.num_stages * chunks or sum(counts) != len(graph.nodes):
        raise ValueError(f"A plan needs the layer-call count of each of the "
                         f"{layout.num_stages * chunks} stages, {len(graph.nodes)} in all. "
                         f"Received: balance={counts}")
    stages, start = [], 0
    for c in counts:
        stages.append({"layers": [n.name for n in graph.nodes[start:start + c]]})
        start += c
    plan = {"format": FORMAT, "version": VERSION, "num_stages": layout.num_stages,
            "num_replicas": layout.num_replicas, "num_microbatches": layout.num_microbatches,
            "schedule": layout.schedule, "rank_mapping": "replica-major", "stages": stages}
    if chunks > 1:
        plan["num_chunks"] = chunks
    if layout.num_tensor > 1:
        plan["num_tensor"] = layout.num_tensor
        if layout.tensor_layers:
            plan["tensor_layers"] = list(layout.tensor_layers)
        if getattr(layout, "tensor_mesh", None):
            plan["tensor_mesh"] = list(layout.tensor_mesh)
    if predicted:
        plan["predicted"] = predicted
    if tables:
        plan["tables"] = dict(tables)
    with open(path, "w") as f:
        json.dump(plan, f, indent=1)
    return Plan(plan)


def read(path: str) -> "Plan":
    try:
        with open(path) as f:
            plan = json.load(f)
    except (OSError, ValueError) as exc:
        raise ValueError(f"Cannot read plan {path}: {exc}") from None
    if plan.get("format") != FORMAT or plan.get("version") != VERSION:
        raise ValueError(f"{path} is not a {FORMAT} file of version {VERSION}.")
    if plan.get("rank_mapping", "replica-major") != "replica-major":
        raise ValueError(f"{path}: only rank_mapping 'replica-major' is supported. "
                         f"Received: {plan.get('rank_mapping')!r}")
    for key in ("num_stages", "num_microbatches", "stages"):
        if key not in plan:
            raise ValueError(f"{path} has no {key!r}.")
    if len(plan["stages"]) != plan["num_stages"] * plan.get("num_chunks", 1):
        raise ValueError(f"{path}: {len(plan['stages'])} stages listed for num_stages="
                         f"{plan['num_stages']} x num_chunks={plan.get('num_chunks', 1)}.")
    return Plan(plan)


def counts_for(plan: Mapping[str, Any], graph: Any) -> list[int]:
    """The plan's stage sizes, after checking its layer calls are the model's, in order."""
    names = [n.name for n in graph.nodes]
    listed = [name for stage in plan["stages"] for name in stage["layers"]]
    if listed != names:
        missing = sorted(set(names) - set(listed))[:5]
        unknown = sorted(set(listed) - set(names))[:5]
        raise ValueError(
            "The plan's layer calls are not this model's, in order"
            + (f"; missing: {missing}" if missing else "")
            + (f"; not in the model: {unknown}" if unknown else "")
            + ". Write the plan for this model with `hyparflow plan`.")
    return [len(s["layers"]) for s in plan["stages"]]
