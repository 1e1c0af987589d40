"""Plan files: the layout `hyparflow plan` writes and `fit(plan=...)` reads.

`hyparflow plan` writes a strategy file (`hyparflow.strategy`, docs/strategy.md: the
mesh (stage, tensor, replica), each layer call's stage and split, each stage's
recompute). The plan files it wrote before, of format "hyparflow-plan", still load:

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

Either way `read` gives a `Plan`: those fields (a strategy's as `strategy.to_plan`
makes them), and the file as a strategy (`Plan.strategy`). Layer calls are named as
`hyparflow.graph` names them: the layer's name, with `#2`, `#3`... for its second
and later calls.
"""

from __future__ import annotations

import json
import re
from typing import Any, Dict, Mapping, Optional, Sequence

from . import strategy as _strategy

__all__ = ["Plan", "read", "write", "counts_for", "local_names", "local_keys"]

FORMAT, VERSION = "hyparflow-plan", 1


class Plan(dict):  # type: ignore[type-arg]
    """The plan's fields, as read from JSON."""

    @property
    def counts(self) -> list[int]:
        return [len(s["layers"]) for s in self["stages"]]

    @property
    def strategy(self) -> Dict[str, Any]:
        """The plan as a strategy file's JSON (an old plan file: default entries)."""
        found = self.get("strategy")
        return dict(found) if found is not None else _strategy.from_plan(self)


def write(path: str, graph: Any, layout: Any,
          predicted: Optional[Mapping[str, float]] = None,
          splits: Optional[Mapping[str, str]] = None,
          recompute: Sequence[bool] = (),
          tables: Optional[Mapping[str, str]] = None,
          threads_per_rank: Optional[int] = None) -> "Plan":
    """Write `layout` (a hyparflow.layout.Layout whose `balance` is the layer-call count
    of each stage) as a strategy file for `graph`'s model. `splits`: {layer call: split
    kind} of the split layers (by default those of `layout.tensor_layers`, "split",
    or with none named "auto", the engine's default); `recompute`: per stage; `tables`:
    the Embedding tables' sharding kinds ({layer name: kind}), which `fit(plan=...)`
    uses as its `embedding_sharding` (kinds/tables/cost.py); `threads_per_rank`: the
    intra-op threads each rank was planned with (`hyparflow run --plan` gives them)."""
    counts = list(layout.balance)
    chunks = getattr(layout, "num_chunks", 1)  # interleaved: S x chunks virtual stages
    if len(counts) != layout.num_stages * chunks or sum(counts) != len(graph.nodes):
        raise ValueError(f"A plan needs the layer-call count of each of the "
                         f"{layout.num_stages * chunks} stages, {len(graph.nodes)} in all. "
                         f"Received: balance={counts}")
    names = [n.name for n in graph.nodes]
    if splits is None and layout.num_tensor > 1 and layout.tensor_layers:
        named = set(layout.tensor_layers)
        splits = {n.name: "split" for n in graph.nodes if n.op.name in named}
    mesh = getattr(layout, "tensor_mesh", None)
    if splits is not None and mesh is not None:
        splits = {n: "mesh" for n in splits}
    doc = _strategy.make(names, counts, stages=layout.num_stages, tensor=layout.num_tensor,
                         replicas=layout.num_replicas, microbatches=layout.num_microbatches,
                         schedule=layout.schedule, chunks=chunks, splits=splits,
                         recompute=recompute, tensor_mesh=mesh, predicted=predicted,
                         threads_per_rank=threads_per_rank)
    shares = getattr(layout, "tensor_shares", None)
    if isinstance(shares, tuple):
        doc["tensor_shares"] = list(shares)
    if tables:
        doc["tables"] = dict(tables)
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    return Plan(_strategy.to_plan(doc))


def read(path: str) -> "Plan":
    """A strategy file, or a plan file of format "hyparflow-plan", as a `Plan`."""
    try:
        with open(path) as f:
            plan = json.load(f)
    except (OSError, ValueError) as exc:
        raise ValueError(f"Cannot read plan {path}: {exc}") from None
    if isinstance(plan, dict) and plan.get("format") == _strategy.FORMAT:
        return Plan(_strategy.to_plan(_strategy.check(plan, path)))
    if not isinstance(plan, dict) or plan.get("format") != FORMAT or plan.get("version") != VERSION:
        raise ValueError(f"{path} is neither a {_strategy.FORMAT} file of version "
                         f"{_strategy.VERSION} nor a {FORMAT} file of version {VERSION}.")
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
    if len(listed) != len(names) or not all(map(_same_call, listed, graph.nodes)):
        missing = sorted(set(names) - set(listed))[:5]
        unknown = sorted(set(listed) - set(names))[:5]
        raise ValueError(
            "The plan's layer calls are not this model's, in order"
            + (f"; missing: {missing}" if missing else "")
            + (f"; not in the model: {unknown}" if unknown else "")
            + ". Write the plan for this model with `hyparflow plan`.")
    return [len(s["layers"]) for s in plan["stages"]]


def _auto_base(name: str) -> str:
    """A Keras auto-name without its call number and its `_N` ('dense_3#2': 'dense')."""
    return re.sub(r"_[0-9]+$", "", name.split("#")[0])


def _same_call(listed: str, node: Any) -> bool:
    """Whether a plan's layer call `listed` is `node` (at the same position): by name,
    or, where Keras made the node's name up (`Node.given`), by the auto-name's class
    and call number: the process that wrote the plan may have built other models
    before, and so numbered its names otherwise ('dense_4' here is 'dense_1' there)."""
    if listed == node.name:
        return True
    return (not node.given and _auto_base(listed) == _auto_base(node.name)
            and listed.partition("#")[2] == str(node.name).partition("#")[2])


def local_names(plan: Optional[Mapping[str, Any]], graph: Any) -> Dict[str, str]:
    """{the plan's name of a layer call or layer: this graph's name}, matched by
    position (`counts_for` checked they are the same calls); empty without a plan."""
    if plan is None:
        return {}
    listed = [name for stage in plan["stages"] for name in stage["layers"]]
    names: Dict[str, str] = {}
    for theirs, node in zip(listed, graph.nodes):
        names[theirs] = node.name
        names.setdefault(theirs.split("#")[0], node.op.name)
    return names


def local_keys(mapping: Any, plan: Optional[Mapping[str, Any]], graph: Any) -> Any:
    """`mapping` ({layer name: value}, as a plan's "tables") keyed by this graph's names
    (`local_names`); anything else as it is."""
    if not isinstance(mapping, dict) or plan is None:
        return mapping
    local = local_names(plan, graph)
    return {local.get(k, k): v for k, v in mapping.items()}
