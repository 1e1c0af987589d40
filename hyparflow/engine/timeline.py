"""A timeline of every action on every rank: record, merge into Chrome-trace JSON, measure, draw.

The JSON is the Chrome trace event format (load it in Perfetto or
chrome://tracing): one track (`tid`) per rank, complete events (`ph: "X"`)
with microsecond times from a common zero taken after a barrier.
"""

from __future__ import annotations

import json
import time
from typing import Any, Dict, List, Mapping, Protocol, Tuple, TypedDict, cast

__all__ = ["Timeline", "TraceEvent", "Trace", "load", "bubble", "theoretical_bubble", "draw",
           "COLOURS"]


class TraceEvent(TypedDict, total=False):
    """One Chrome-trace event: a complete action (ph "X") or a track's name (ph "M")."""

    name: str
    cat: str
    ph: str
    ts: float                # microseconds from the common zero
    dur: float
    pid: int
    tid: int                 # the rank
    args: Dict[str, Any]     # JSON: what the recorder attached (e.g. the microbatch)


class Trace(TypedDict, total=False):
    """The file fit(trace=...) writes."""

    traceEvents: List[TraceEvent]
    displayTimeUnit: str
    otherData: Dict[str, Any]   # JSON metadata: num_stages, num_microbatches, schedule, ...


class _Comm(Protocol):
    """What a timeline needs of a communicator (engine.comm.Communicator)."""

    rank: int
    size: int

    def barrier(self) -> Any: ...
    def allgather_obj(self, obj: Any) -> Any: ...


# (name, category, start, end, args) in seconds from the timeline's zero.
_Event = Tuple[str, str, float, float, Dict[str, Any]]

COLOURS = {
    "forward": "#4c72b0", "backward": "#dd8452", "weight": "#64b5cd", "send": "#55a868",
    "wait": "#d9d9d9", "allreduce": "#c44e52", "optimizer": "#8172b3", "allgather": "#937860",
    "transpose": "#da8bc3",
}


class Timeline:
    """Events of one rank: (name, category, start, end, args) in seconds from `zero`."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.zero = time.perf_counter()
        self.events: List[_Event] = []

    def start(self, comm: _Comm) -> None:
        """Agree on time zero: every rank takes it right after the same barrier."""
        comm.barrier()
        self.zero = time.perf_counter()

    def add(self, name: str, category: str, start: float, end: float, **args: Any) -> None:
        self.events.append((name, category, start - self.zero, end - self.zero, args))

    def chrome_events(self) -> List[TraceEvent]:
        return [{"name": n, "cat": c, "ph": "X", "ts": round(s * 1e6, 1),
                 "dur": round((e - s) * 1e6, 1), "pid": 0, "tid": self.rank, "args": a}
                for n, c, s, e, a in self.events]

    def write(self, comm: _Comm, path: str, metadata: Mapping[str, Any]) -> None:
        """Gather every rank's events on rank 0 and write one JSON file there."""
        everyone: List[List[TraceEvent]] = comm.allgather_obj(self.chrome_events())
        if comm.rank == 0:
            events = [ev for rank_events in everyone for ev in rank_events]
            names: List[TraceEvent] = [{"name": "thread_name", "ph": "M", "pid": 0, "tid": r,
                      "args": {"name": f"rank {r}"}} for r in range(comm.size)]
            with open(path, "w") as f:
                json.dump({"traceEvents": names + events, "displayTimeUnit": "ms",
                           "otherData": metadata}, f)


def load(path: str) -> Trace:
    """A trace file (JSON, taken to have the shape `Trace` describes)."""
    with open(path) as f:
        return cast(Trace, json.load(f))


def theoretical_bubble(num_stages: int, num_microbatches: int, chunks: int = 1) -> float:
    """Idle share of a pipeline of equal stages: (S-1) / (M+S-1), with `chunks` per rank
    (interleaved) (S-1) / (vM+S-1)."""
    return (num_stages - 1) / (chunks * num_microbatches + num_stages - 1)


def bubble(trace: Trace, skip_first: bool = True) -> float:
    """Measured idle share of the pipeline part of each step, averaged over ranks.

    The pipeline part of a step runs from its start to the start of its
    allreduce; busy time is forward + backward. The first step (tracing,
    warm-up) is left out when there are others."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    ranks = sorted({e["tid"] for e in events})
    fractions: List[float] = []
    for r in ranks:
        mine = [e for e in events if e["tid"] == r]
        steps = sorted((e for e in mine if e["cat"] == "step"), key=lambda e: e["ts"])
        if skip_first and len(steps) > 1:
            steps = steps[1:]
        busy = span = 0.0
        for st in steps:
            lo, hi = st["ts"], st["ts"] + st["dur"]
            inside = [e for e in mine if lo <= e["ts"] < hi]
            reduce_start = min((e["ts"] for e in inside if e["cat"] == "allreduce"), default=hi)
            span += reduce_start - lo
            busy += sum(e["dur"] for e in inside if e["cat"] in ("forward", "backward", "weight"))
        if span > 0:
            fractions.append(1.0 - busy / span)
    return sum(fractions) / len(fractions) if fractions else 0.0


def draw(trace: Trace, path: str, steps: int = 2) -> None:
    """One row per rank, actions coloured by kind, idle time left blank; the last
    `steps` steps (so the picture is readable)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    step_events = sorted((e for e in events if e["cat"] == "step"), key=lambda e: e["ts"])
    ranks = sorted({e["tid"] for e in events})
    lo = 0.0
    if step_events:
        per_rank = len(step_events) // max(1, len(ranks))
        starts = sorted({round(e["ts"]) for e in step_events})
        lo = starts[max(0, len(starts) - steps * len(ranks))] if per_rank > steps else starts[0]
    shown = [e for e in events if e["ts"] >= lo and e["cat"] in COLOURS]
    fig, ax = plt.subplots(figsize=(12, 0.6 * len(ranks) + 1.2))
    for e in shown:
        ax.broken_barh([((e["ts"] - lo) / 1e3, e["dur"] / 1e3)], (e["tid"] - 0.4, 0.8),
                       facecolors=COLOURS[e["cat"]], edgecolor="none")
        if e["cat"] in ("forward", "backward", "weight") and "microbatch" in e.get("args", {}):
            ax.text((e["ts"] - lo + e["dur"] / 2) / 1e3, e["tid"], str(e["args"]["microbatch"]),
                    ha="center", va="center", fontsize=7, color="white")
    ax.set_yticks(ranks, [f"rank {r}" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    meta = trace.get("otherData", {})
    s, m = meta.get("num_stages"), meta.get("num_microbatches")
    title = f"measured bubble {bubble(trace):.3f}"
    if s and m:
        title += f", theoretical (S-1)/(M+S-1) = {theoretical_bubble(s, m):.3f}  (S={s}, M={m}, {meta.get('schedule')})"
    ax.set_title(title, pad=28)
    ax.legend(handles=[Patch(color=c, label=k) for k, c in COLOURS.items()],
              loc="lower center", bbox_to_anchor=(0.5, 1.08), ncol=len(COLOURS), fontsize=8,
              frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
