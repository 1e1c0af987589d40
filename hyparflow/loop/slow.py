"""Rank 0's warning, before the first step, of a layout whose one-thread ranks share a
node and that the quick cost model (`nodecost`) predicts at under `nodecost.SLOW` of
the node's best ranks x threads: both predictions, and the command for the better one.
Once per process; `HYPARFLOW_LAYOUT_WARNING=0` turns it off."""

from __future__ import annotations

import os
import sys
import time
from typing import Any, Optional

from .. import _env, nodecost, settings
from ..engine import node as _node

__all__ = ["warning", "check"]

_warned = False


def warning(graph: Any, layout: Any, batch: int, local: int, world: int, cores: int,
            rates: nodecost.Rates, passes: int, script: str = "train.py") -> Optional[str]:
    """The warning's text for this layout (`local` of the `world` ranks on this node of
    `cores` cores, one thread each), or None when it is predicted within `SLOW` of the
    best."""
    madds = float(sum(n.cost for n in graph.nodes))
    params = 4.0 * sum(n.params for n in graph.nodes)
    nodes = max(1, world // local)
    here = nodecost.Shape(local, 1, layout.num_stages, layout.num_tensor, layout.num_replicas,
                          layout.num_microbatches, nodes)
    mine = nodecost.step_seconds(here, madds, params, batch, rates, passes)
    shape, fastest = nodecost.best(cores, nodes, madds, params, batch, rates, passes)
    if mine <= 0 or fastest / mine >= nodecost.SLOW:
        return None
    command = (f"hyparflow run -n {shape.ranks * nodes} --threads-per-rank {shape.threads} "
               f"{script}")
    return (f"hyparflow: warning: this layout, {here.describe()}, is predicted at "
            f"{fastest / mine:.2f}x the speed of {shape.describe()} on this node's {cores} "
            f"cores ({mine * 1e3:.1f} against {fastest * 1e3:.1f} ms per step of {batch} "
            f"samples, by the quick cost model: docs/planning.md). For the faster one: "
            f"`{command}`, or `hyparflow run {script}`, which plans the node and launches its "
            "best. HYPARFLOW_LAYOUT_WARNING=0 turns this off.")


def _script() -> str:
    """The script as the user started it ("train.py" for a test runner's or a shell's)."""
    name = sys.argv[0] if sys.argv else ""
    return name if name.endswith(".py") and not name.endswith("__main__.py") else "train.py"


def check(comm: Any, graph: Any, layout: Any, batch: int, local: int,
          optimizer: Any) -> Optional[str]:
    """On rank 0, once per process, where the node's ranks have one thread each and
    share it: measure the rates and print the warning if there is one (returned too)."""
    global _warned
    threads = _env.configured_threads()
    # Ranks as threads of one process (tests) are no layout anyone launches: MPI's only.
    mpi = getattr(getattr(comm, "comm", None), "Split_type", None) is not None
    if (comm.rank != 0 or _warned or local < 2 or threads != 1 or not mpi
            or not settings.layout_warning()):
        return None
    _warned = True
    start = time.perf_counter()
    from . import costs

    slots = costs.optimizer_slots(optimizer) if optimizer is not None else 0
    cores = os.cpu_count() or 1
    text = warning(graph, layout, batch, local, comm.size, max(cores, local),
                   nodecost.Rates(*_node.rates()), 3 + 2 * slots,
                   _script())
    if text is not None:
        print(text + f" (checked in {time.perf_counter() - start:.2f} s)", flush=True)
    return text
