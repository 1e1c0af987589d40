"""Strategy files: a layout written per layer (docs/strategy.md, schema in
docs/strategy.schema.json). Pure: no TensorFlow, Keras or MPI, so `fit(plan=...)`
reads it on the training path and `hyparflow strategy validate` runs without TF.

    {
      "format": "hyparflow-strategy", "version": 1,
      "mesh": {"axes": ["stage", "tensor", "replica"], "shape": [2, 2, 1]},
      "num_microbatches": 4, "schedule": "1f1b",
      "stages": [{"recompute": false}, {"recompute": true}],
      "layers": [{"name": "dense", "stage": 0, "split": "whole"},
                 {"name": "wide", "stage": 0, "split": "column"}, ...]
    }

The mesh's axes are named as `keras.distribution.DeviceMesh`'s are: rank =
(replica x S + stage) x T + tensor. A layer's `split` is "whole" (every tensor rank
holds it), a split kind's name ("column", "row", "heads", ...: the engine checks it
is the kind it would split that layer by), "split" (split, by whichever kind claims
the layer) or "auto" (on every layer: the engine's default rule picks, as a plan
without `tensor_layers`); "mesh" on a `tensor_mesh` [q, q].

Plan files of format "hyparflow-plan" (what `hyparflow plan` wrote before) are read
as a strategy with default entries (`from_plan`); `to_plan` gives the fields the
layout takes (`hyparflow.plan.Plan`)."""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Sequence

__all__ = ["FORMAT", "VERSION", "AXES", "SPLITS", "StrategyError", "validate", "check",
           "from_plan", "to_plan", "make", "table", "figure", "check_kinds", "recomputes"]

FORMAT, VERSION = "hyparflow-strategy", 1
AXES = ("stage", "tensor", "replica")
# The 1D split kinds' names (kinds/tensor/registry.py; tests/planning/test_strategy.py checks
# this list against the registry, so the two cannot drift apart), and the words above.
KINDS = ("column", "row", "filters", "rows", "heads", "decoder", "query_groups",
         "einsum_column", "einsum_row", "inner")
SPLITS = ("whole", "split", "auto", "mesh") + KINDS
TOP = {"format", "version", "mesh", "num_microbatches", "schedule", "num_chunks",
       "tensor_mesh", "tensor_shares", "stages", "layers", "predicted", "rank_mapping",
       "tables", "threads_per_rank"}


class StrategyError(ValueError):
    """A strategy file that does not hold; the message names each bad field."""


def _int(value: Any, least: int = 1) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def validate(doc: Any) -> List[str]:
    """Every problem of `doc` (a strategy file's JSON), each naming the field path, the
    value and the fix; an empty list when it holds."""
    if not isinstance(doc, dict):
        return [f"$: a strategy is a JSON object. Received: {type(doc).__name__}"]
    errors: List[str] = []
    bad = errors.append
    if doc.get("format") != FORMAT:
        bad(f"format: must be {FORMAT!r}. Received: {doc.get('format')!r}")
    if doc.get("version") != VERSION:
        bad(f"version: must be {VERSION} (the only version). Received: {doc.get('version')!r}")
    for key in sorted(set(doc) - TOP):
        bad(f"{key}: not a field of a strategy (fields: {sorted(TOP)}). Remove it.")
    mesh = doc.get("mesh")
    shape: Sequence[Any] = (1, 1, 1)
    if not isinstance(mesh, dict):
        bad(f"mesh: must be {{\"axes\": {list(AXES)}, \"shape\": [S, T, R]}}. Received: {mesh!r}")
    else:
        if list(mesh.get("axes", [])) != list(AXES):
            bad(f"mesh.axes: must be {list(AXES)} (rank = (replica x S + stage) x T + "
                f"tensor). Received: {mesh.get('axes')!r}")
        shape = mesh.get("shape") or ()
        if not isinstance(shape, list) or len(shape) != 3:
            bad(f"mesh.shape: must be [stages, tensor ranks, replicas]. Received: {shape!r}")
            shape = (1, 1, 1)
        for axis, value in zip(AXES, shape):
            if not (_int(value) or (axis == "replica" and value is None)):
                bad(f"mesh.shape[{AXES.index(axis)}] ({axis}): must be an integer >= 1"
                    + (" (or null: the world size decides)" if axis == "replica" else "")
                    + f". Received: {value!r}")
    if not _int(doc.get("num_microbatches")):
        bad(f"num_microbatches: must be an integer >= 1. Received: "
            f"{doc.get('num_microbatches')!r}")
    if not isinstance(doc.get("schedule"), str):
        bad(f"schedule: must be a schedule's name (e.g. \"1f1b\"). Received: "
            f"{doc.get('schedule')!r}")
    chunks = doc.get("num_chunks", 1)
    if not _int(chunks):
        bad(f"num_chunks: must be an integer >= 1. Received: {chunks!r}")
        chunks = 1
    if doc.get("rank_mapping", "replica-major") != "replica-major":
        bad(f"rank_mapping: only \"replica-major\" is supported. Received: "
            f"{doc.get('rank_mapping')!r}")
    tmesh = doc.get("tensor_mesh")
    if tmesh is not None and not (isinstance(tmesh, list) and len(tmesh) == 2
                                  and all(_int(v, 2) for v in tmesh)):
        bad(f"tensor_mesh: must be [q, q] with q >= 2 (or left out). Received: {tmesh!r}")
    tables = doc.get("tables")
    if tables is not None and not (isinstance(tables, dict) and all(
            isinstance(k, str) and isinstance(v, str) for k, v in tables.items())):
        bad(f"tables: must map Embedding layer names to sharding kinds, as fit's "
            f"embedding_sharding (docs/recommenders.md). Received: {tables!r}"[:300])
    threads = doc.get("threads_per_rank")
    if threads is not None and not _int(threads):
        bad(f"threads_per_rank: must be a whole number of threads, 1 or more (what "
            f"`hyparflow run --plan` gives each rank). Received: {threads!r}")
    stages = _int(shape[0]) and shape[0] * chunks or 1
    _check_stages(doc.get("stages"), stages, bad)
    _check_layers(doc.get("layers"), stages, shape, tmesh, bad)
    return errors


def _check_stages(entries: Any, stages: int, bad: Any) -> None:
    if not isinstance(entries, list) or len(entries) != stages:
        bad(f"stages: must list {stages} entries (mesh.shape[0] x num_chunks), each "
            f"{{\"recompute\": false}}. Received: {entries!r}"[:300])
        return
    for s, entry in enumerate(entries):
        if not isinstance(entry, dict) or set(entry) - {"recompute"}:
            bad(f"stages[{s}]: must be {{\"recompute\": true|false}}. Received: {entry!r}")
        elif not isinstance(entry.get("recompute", False), bool):
            bad(f"stages[{s}].recompute: must be true or false. Received: "
                f"{entry['recompute']!r}")


def _check_layers(layers: Any, stages: int, shape: Sequence[Any], tmesh: Any,
                  bad: Any) -> None:
    if not isinstance(layers, list) or not layers:
        bad(f"layers: must list every layer call, in the model's order, each "
            f"{{\"name\", \"stage\", \"split\"}}. Received: {layers!r}"[:300])
        return
    last, seen, splits = 0, set(), []
    for k, entry in enumerate(layers):
        where = f"layers[{k}]"
        if not isinstance(entry, dict):
            bad(f"{where}: must be {{\"name\", \"stage\", \"split\"}}. Received: {entry!r}")
            continue
        for key in sorted(set(entry) - {"name", "stage", "split"}):
            bad(f"{where}.{key}: not a field of a layer entry (name, stage, split). Remove it.")
        name = entry.get("name")
        if not isinstance(name, str) or not name:
            bad(f"{where}.name: must be the layer call's name (as hyparflow.graph names it). "
                f"Received: {name!r}")
        elif name in seen:
            bad(f"{where}.name: {name!r} is listed twice; a shared layer's later calls are "
                f"{name}#2, {name}#3, ...")
        seen.add(name)
        stage: Any = entry.get("stage")
        if not _int(stage, 0) or stage >= stages:
            bad(f"{where}.stage: must be an integer in 0..{stages - 1}. Received: {stage!r}")
        elif stage < last or stage > last + 1:
            bad(f"{where}.stage: {stage} after a layer on stage {last}; a stage's layers are "
                f"contiguous in the model's order and stages follow each other (stage "
                f"{last} or {last + 1} here).")
        else:
            last = stage
        split = entry.get("split", "whole")
        splits.append(split)
        if split not in SPLITS:
            bad(f"{where}.split: unknown split {split!r}; one of {list(SPLITS)}.")
        elif split == "mesh" and tmesh is None:
            bad(f"{where}.split: \"mesh\" needs a tensor_mesh [q, q]; add it, or use a 1D "
                f"kind ({', '.join(KINDS[:3])}, ...).")
        elif split in KINDS and tmesh is not None:
            bad(f"{where}.split: {split!r} is a 1D kind, but tensor_mesh is "
                f"{tmesh!r}: use \"mesh\" (or \"whole\").")
        elif split != "whole" and shape[1] == 1:
            bad(f"{where}.split: {split!r} with mesh.shape[1] (tensor) = 1: one tensor "
                f"rank splits nothing. Use \"whole\", or a tensor axis of 2 or more.")
    if last != stages - 1 and layers:
        bad(f"layers: no layer on stage {last + 1}..{stages - 1}; every stage holds at least "
            f"one layer call.")
    if "auto" in splits and any(s != "auto" for s in splits):
        bad("layers[*].split: \"auto\" (the engine's default choice) must be on every layer "
            "or on none; name the split layers (\"split\" or a kind) and the rest \"whole\".")


def check(doc: Any, path: str = "the strategy") -> Dict[str, Any]:
    """`doc`, or a StrategyError listing every problem."""
    errors = validate(doc)
    if errors:
        raise StrategyError(f"{path} is not a valid strategy ({len(errors)} problem"
                            f"{'s' if len(errors) > 1 else ''}):\n  " + "\n  ".join(errors))
    return dict(doc)


def to_plan(doc: Mapping[str, Any]) -> Dict[str, Any]:
    """The layout's fields of a (valid) strategy, as `hyparflow.plan` gives them:
    counts per stage, tensor ranks and split layers, schedule; `recompute` per stage
    and `splits` ({layer: split}) for the runtime's checks."""
    stages, tensor, replicas = doc["mesh"]["shape"]
    chunks = doc.get("num_chunks", 1)
    cut: List[Dict[str, Any]] = [{"layers": []} for _ in range(stages * chunks)]
    for entry in doc["layers"]:
        cut[entry["stage"]]["layers"].append(entry["name"])
    plan: Dict[str, Any] = {"num_stages": stages, "num_microbatches": doc["num_microbatches"],
                            "schedule": doc["schedule"], "stages": cut,
                            "rank_mapping": "replica-major"}
    if replicas is not None:
        plan["num_replicas"] = replicas
    if chunks > 1:
        plan["num_chunks"] = chunks
    splits = {e["name"]: e.get("split", "whole") for e in doc["layers"]}
    if tensor > 1:
        plan["num_tensor"] = tensor
        if any(s != "auto" for s in splits.values()):
            plan["tensor_layers"] = [n for n, s in splits.items() if s != "whole"]
        # "mesh" is whichever mesh kind claims the layer, as "split" is for 1D.
        plan["splits"] = {n: s for n, s in splits.items()
                          if s not in ("whole", "split", "auto", "mesh")}
    for key in ("tensor_mesh", "tensor_shares", "predicted", "tables", "threads_per_rank"):
        if doc.get(key) is not None:
            plan[key] = doc[key]
    recompute = [bool(s.get("recompute", False)) for s in doc["stages"]]
    if any(recompute):
        plan["recompute"] = recompute
    plan["strategy"] = dict(doc)
    return plan


def check_kinds(plan: Optional[Mapping[str, Any]], chosen: Mapping[str, str]) -> None:
    """Raise when a strategy names a split kind for a layer that the engine splits by
    another kind (`chosen`: {layer call: kind}, the runtime's choice)."""
    wanted = (plan or {}).get("splits") or {}
    names = [e["name"] for e in ((plan or {}).get("strategy") or {}).get("layers", [])]
    for name, kind in wanted.items():
        if chosen.get(name) != kind:
            k = names.index(name) if name in names else "?"
            found = chosen.get(name)
            raise StrategyError(
                f"layers[{k}].split: the strategy splits {name!r} as {kind!r}, but the engine "
                + (f"splits it as {found!r} here" if found else "does not split it by that "
                   "kind here (no kind claims it, or its partner is not split with it)")
                + f". Write split: {found or 'whole'!r} for it (or \"split\": whichever "
                  "kind claims it).")


def recomputes(plan: Optional[Mapping[str, Any]], stage: int) -> bool:
    """Whether a strategy has (virtual) stage `stage` recompute its forward."""
    flags = (plan or {}).get("recompute") or ()
    return bool(flags[stage]) if stage < len(flags) else False


def from_plan(plan: Mapping[str, Any]) -> Dict[str, Any]:
    """A plan file ("hyparflow-plan") as a strategy with default entries: its split
    layers "split" (whichever kind claims them), or "auto" on every layer when it
    names none, the rest "whole"; no stage recomputes."""
    tensor = plan.get("num_tensor", 1)
    named = plan.get("tensor_layers")
    layers = []
    for s, stage in enumerate(plan["stages"]):
        for name in stage["layers"]:
            split = "whole" if tensor == 1 else "auto" if named is None else (
                "split" if name.split("#")[0] in named else "whole")
            layers.append({"name": name, "stage": s, "split": split})
    doc: Dict[str, Any] = {
        "format": FORMAT, "version": VERSION,
        "mesh": {"axes": list(AXES), "shape": [plan["num_stages"], tensor,
                                              plan.get("num_replicas")]},
        "num_microbatches": plan["num_microbatches"], "schedule": plan.get("schedule", "1f1b"),
        "stages": [{"recompute": False} for _ in plan["stages"]], "layers": layers}
    for key in ("num_chunks", "tensor_mesh", "tensor_shares", "predicted", "tables",
                "threads_per_rank"):
        if plan.get(key) is not None:
            doc[key] = plan[key]
    return doc


def make(names: Sequence[str], counts: Sequence[int], *, stages: int, tensor: int,
         replicas: Optional[int], microbatches: int, schedule: str, chunks: int = 1,
         splits: Optional[Mapping[str, str]] = None, recompute: Sequence[bool] = (),
         tensor_mesh: Any = None, predicted: Optional[Mapping[str, Any]] = None,
         threads_per_rank: Optional[int] = None) -> Dict[str, Any]:
    """A strategy from a layout's cut (`counts` layer calls per stage, `names` in the
    model's order) and `splits` ({layer call: split kind}; None with tensor > 1:
    "auto", the engine's default choice)."""
    if sum(counts) != len(names) or len(counts) != stages * chunks:
        raise ValueError(f"A strategy needs the layer-call count of each of the "
                         f"{stages * chunks} stages, {len(names)} in all. Received: "
                         f"counts={list(counts)}")
    stage_of = [s for s, c in enumerate(counts) for _ in range(c)]
    layers = [{"name": n, "stage": s,
               "split": "whole" if tensor == 1 else "auto" if splits is None
               else splits.get(n, "whole")}
              for n, s in zip(names, stage_of)]
    doc: Dict[str, Any] = {
        "format": FORMAT, "version": VERSION,
        "mesh": {"axes": list(AXES), "shape": [stages, tensor, replicas]},
        "num_microbatches": microbatches, "schedule": schedule,
        "stages": [{"recompute": bool(recompute[s]) if s < len(recompute) else False}
                   for s in range(stages * chunks)],
        "layers": layers}
    if chunks > 1:
        doc["num_chunks"] = chunks
    if tensor_mesh is not None:
        doc["tensor_mesh"] = list(tensor_mesh)
    if predicted:
        doc["predicted"] = dict(predicted)
    if threads_per_rank is not None:
        doc["threads_per_rank"] = threads_per_rank
    return check(doc)


def table(doc: Mapping[str, Any]) -> str:
    """One line per layer call: its stage, its split, the ranks that hold it."""
    stages, tensor, _ = doc["mesh"]["shape"]
    rows = [f"{'#':>4}  {'layer call':<28} {'stage':>5}  {'split':<14} ranks (replica 0)"]
    for k, e in enumerate(doc["layers"]):
        position = e["stage"] % stages
        ranks = [position * tensor + t for t in range(tensor)]
        held = (f"{ranks[0]}" if len(ranks) == 1 else
                f"{ranks[0]}-{ranks[-1]}" + (" (copies)" if e.get("split") == "whole" else ""))
        rows.append(f"{k:>4}  {e['name']:<28} {e['stage']:>5}  {e.get('split', 'whole'):<14} "
                    f"{held}")
    recompute = [s for s, e in enumerate(doc["stages"]) if e.get("recompute")]
    rows.append(f"recompute: stages {recompute}" if recompute else "recompute: none")
    return "\n".join(rows)


def figure(doc: Mapping[str, Any], most: int = 40) -> str:
    """The mesh drawn as text: a box per stage (its layer calls, split ones marked *)
    holding its tensor ranks, one row of boxes per replica (`?` replicas: the world
    size decides); a box lists at most `most` characters of names."""
    stages, tensor, replicas = doc["mesh"]["shape"]
    chunks = doc.get("num_chunks", 1)
    names: List[List[str]] = [[] for _ in range(stages * chunks)]
    for e in doc["layers"]:
        mark = "*" if e.get("split", "whole") != "whole" else ""
        names[e["stage"]].append(e["name"] + mark)
    lines = [f"mesh (stage={stages}, tensor={tensor}, replica={replicas or '?'})"
             + (f", {chunks} chunks per rank" if chunks > 1 else "")
             + "; * split over the tensor ranks"]
    for r in range(replicas or 1):
        boxes = []
        for s in range(stages):
            first = (r * stages + s) * tensor
            ranks = f"ranks {first}-{first + tensor - 1}" if tensor > 1 else f"rank {first}"
            calls = [n for j in range(s, stages * chunks, stages) for n in names[j]]
            shown = ", ".join(calls)
            if len(shown) > most:
                shown = shown[:most - 5].rsplit(", ", 1)[0] + ", ..."
            boxes.append([f"stage {s}: {ranks}", shown])
        width = max(len(text) for box in boxes for text in box)
        lines.append(f"replica {r}" if replicas else "replica r (each alike)")
        for row in range(2):
            lines.append(" -> ".join(f"[{b[row]:<{width}}]" for b in boxes))
    return "\n".join(lines)
