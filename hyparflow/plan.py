"""A parallel plan as a small JSON file: stages with their layer calls, replicas,
microbatches, schedule and rank mapping. `fit(plan=...)` reads it; `hyparflow plan`
writes it.

    {
      "format": "hyparflow-plan", "version": 1,
      "num_stages": 2, "num_replicas": 2, "num_microbatches": 8, "schedule": "1f1b",
      "num_tensor": 1,                          # optional: ranks per stage splitting layers
      "tensor_layers": ["dense_1", ...],        # optional: which layers they split
      "rank_mapping": "replica-major",          # rank = (replica * S + stage) * T + tensor
      "stages": [{"layers": ["conv2d", "batch_normalization", ...]}, {"layers": [...]}],
      "predicted": {...}                        # optional: the planner's cost estimate
    }

Layer calls are named as `hyparflow.graph` names them: the layer's name, with `#2`,
`#3`... for its second and later calls.
"""

import json

__all__ = ["Plan", "read", "write", "counts_for"]

FORMAT, VERSION = "hyparflow-plan", 1


class Plan(dict):
    """The plan's fields, as read from JSON."""

    @property
    def counts(self):
        return [len(s["layers"]) for s in self["stages"]]


def write(path, graph, counts, num_replicas, num_microbatches, schedule, predicted=None,
          num_tensor=1, tensor_layers=None):
    stages, start = [], 0
    for c in counts:
        stages.append({"layers": [n.name for n in graph.nodes[start:start + c]]})
        start += c
    plan = {"format": FORMAT, "version": VERSION, "num_stages": len(counts),
            "num_replicas": num_replicas, "num_microbatches": num_microbatches,
            "schedule": schedule, "rank_mapping": "replica-major", "stages": stages}
    if num_tensor > 1:
        plan["num_tensor"] = num_tensor
        if tensor_layers:
            plan["tensor_layers"] = list(tensor_layers)
    if predicted:
        plan["predicted"] = predicted
    with open(path, "w") as f:
        json.dump(plan, f, indent=1)
    return Plan(plan)


def read(path):
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
    if len(plan["stages"]) != plan["num_stages"]:
        raise ValueError(f"{path}: {len(plan['stages'])} stages listed for num_stages="
                         f"{plan['num_stages']}.")
    return Plan(plan)


def counts_for(plan, graph):
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
    return plan.counts
