"""`hyparflow plan --explore-all --dataset space.csv`: every candidate the planner
predicted, one CSV row each, made on the user's machine; `--measure K` runs K of them
for real (docs/planning.md, "The explored space as a dataset").

Columns (in this order):

- `model`: the model's fingerprint, 12 hex digits of the SHA-256 of its layer calls
  (name, class, weights, output shape) and the global batch size;
- `machine`: the machine's, of its CPU model, cores, memory, nodes, ranks per node
  and hosts (a projection with --nodes is another machine);
- `ranks`, `stages`, `tensor`, `replicas`, `microbatches`, `schedule`, `chunks`;
- `search`: "global" (a tuple of `planner.search`, the rule's split layers) or
  "layers" (a strategy of `search.layers`);
- `strategy`: the candidate as a strategy file's JSON, inline (docs/strategy.md);
- `predicted_step_s`, `predicted_samples_s`, `memory_per_rank_bytes` (the largest
  rank's), `fits` (1/0 under --memory-per-rank);
- `measured_step_s`: the median step of `hf.fit` with that strategy under mpiexec,
  random data (`probes.strategy_steps`), for the `--measure K` rows; empty otherwise.
"""

from __future__ import annotations

import csv
import hashlib
import json
import os
import platform
import tempfile
from typing import Any, Dict, List, Mapping, Optional, Sequence

__all__ = ["COLUMNS", "model_fingerprint", "machine_fingerprint", "rows", "spread", "write",
           "measure"]

COLUMNS = ("model", "machine", "ranks", "stages", "tensor", "replicas", "microbatches",
           "schedule", "chunks", "search", "strategy", "predicted_step_s",
           "predicted_samples_s", "memory_per_rank_bytes", "fits", "measured_step_s")


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:12]


def model_fingerprint(graph: Any, batch: int) -> str:
    return _digest({"batch": batch, "calls": [
        [n.name, type(n.op).__name__, n.params, [list(graph.tensors[t].shape)
                                                 for t in n.outputs]]
        for n in graph.nodes]})


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_fingerprint(cores: Optional[int], memory: Optional[int], nodes: int,
                        ranks_per_node: Optional[int], hosts: Optional[str]) -> str:
    return _digest({"cpu": _cpu(), "cores": cores, "memory": memory, "nodes": nodes,
                    "ranks_per_node": ranks_per_node, "hosts": hosts})


def rows(plans: Sequence[Mapping[str, Any]], graph: Any, model: str, machine: str,
         ranks: int, strategy_of: Any) -> List[Dict[str, Any]]:
    """One row per plan, the first of any the search priced twice; `strategy_of(plan)`:
    its strategy file's JSON."""
    out, seen = [], set()
    for p in plans:
        text = json.dumps(strategy_of(p), separators=(",", ":"))
        key = (p.get("search", "global"), text)
        if key in seen:
            continue
        seen.add(key)
        out.append({"model": model, "machine": machine, "ranks": ranks,
                    "stages": p["stages"], "tensor": p["tensor"], "replicas": p["replicas"],
                    "microbatches": p["microbatches"], "schedule": p["schedule"],
                    "chunks": p.get("chunks", 1), "search": p.get("search", "global"),
                    "strategy": text,
                    "predicted_step_s": p["step_s"], "predicted_samples_s": p["samples_s"],
                    "memory_per_rank_bytes": int(max(p["memory_bytes"])),
                    "fits": int(bool(p["fits"])), "measured_step_s": ""})
    return out


def spread(count: int, k: int) -> List[int]:
    """`k` row indices spread evenly over `count` rows ranked by prediction: the
    first, the last and evenly between."""
    if k <= 0 or count == 0:
        return []
    if k >= count:
        return list(range(count))
    if k == 1:
        return [0]
    return sorted({round(j * (count - 1) / (k - 1)) for j in range(k)})


def measure(table: List[Dict[str, Any]], k: int, ranks: int, source: str, function: str,
            batch: int, steps: int = 5) -> List[int]:
    """Run `k` rows (spread over the ranking, those that fit) for real under mpiexec and
    fill their `measured_step_s`; returns the indices measured."""
    from . import measure as M

    order = sorted((i for i, r in enumerate(table) if r["fits"]),
                   key=lambda i: table[i]["predicted_step_s"])
    chosen = [order[j] for j in spread(len(order), k)]
    for i in chosen:
        handle, path = tempfile.mkstemp(suffix=".json")
        with os.fdopen(handle, "w") as f:
            f.write(table[i]["strategy"])
        try:
            table[i]["measured_step_s"] = M.strategy_steps(ranks, source, function, path,
                                                           batch, steps)
        finally:
            os.unlink(path)
        print(f"  measured S={table[i]['stages']} T={table[i]['tensor']} "
              f"R={table[i]['replicas']} M={table[i]['microbatches']} {table[i]['schedule']} "
              f"({table[i]['search']}): {table[i]['measured_step_s']:.4f} s, predicted "
              f"{table[i]['predicted_step_s']:.4f} s", flush=True)
    return chosen


def write(path: str, table: Sequence[Mapping[str, Any]]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(COLUMNS))
        writer.writeheader()
        for row in table:
            writer.writerow(row)
