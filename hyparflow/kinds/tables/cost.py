"""What a table placement costs per step (pure: numpy only): storage (weights and
optimizer slots, `Placement.bytes_on`), the bytes each rank sends for a step's
lookups, and the owners' load from the distribution of the ids (the first batches'
ids, or uniform). `hyparflow plan` prints it as a table and stores the kinds in the
plan file (`to_plan`); `fit(plan=...)` reads them back (`from_plan`).

One step, a table looked up `n` times over the global batch (n / R per replica,
each replica's ids drawn alike), R ranks, width d, `w` bytes per value on the wire,
8 bytes per id; `hits[r]`, the share of the ids whose rows rank r owns:

- "table" / "row" / "table-row": rank r sends the ids it does not own (n/R (1 - hits[r]) x 8), the
  rows the others asked it for (n hits[r] (R-1)/R x d w) and the gradients of the
  rows it asked for (n/R (1 - hits[r]) x d w); it looks up n hits[r] rows.
- "column": every id to every rank (n/R (R-1) x 8), its columns of every other
  rank's rows (n (R-1)/R x d_r w) and the other ranks' columns of its rows'
  gradients (n/R (d - d_r) w); it looks up n rows of d_r columns.
- "data" (replicated): its n/R (id, row) gradient pairs to every other rank.

The estimate of a step: the busiest rank's bytes over the link (`beta` seconds per
byte), four exchanges with each other rank (`alpha` each), and its looked-up bytes
(`gamma` seconds per byte)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence

import numpy as np

from .plan import Placement

__all__ = ["Cost", "costs", "describe", "hits", "to_plan", "from_plan"]

ID_BYTES = 8
EXCHANGES = 4  # counts, ids, rows, gradients


@dataclass(frozen=True)
class Cost:
    """One table's cost per step: its placement, the most bytes one rank stores, the
    bytes each rank sends, the rows (times their width share) each looks up, the
    estimated seconds of the busiest rank."""

    placement: Placement
    stored: int
    sent: tuple
    looked_up: tuple
    seconds: float


def hits(placement: Placement, ids: Optional[np.ndarray], ranks: int) -> np.ndarray:
    """The share of the lookups each rank owns the rows of: from `ids` (any shape),
    else uniform over the rows."""
    p = placement
    if p.kind == "column" or p.sizes is None:
        return np.full(ranks, 1.0 / ranks)
    ends = np.cumsum(p.sizes)
    if ids is None or np.size(ids) == 0:
        return np.asarray(p.sizes, float) / p.table.rows
    owner = np.searchsorted(ends, np.clip(np.ravel(ids), 0, p.table.rows - 1), side="right")
    return np.bincount(owner, minlength=ranks)[:ranks] / owner.size


def _one(p: Placement, ranks: int, n: float, share: np.ndarray, wire: int,
         alpha: float, beta: float, gamma: float) -> Cost:
    d, R = p.table.dim, ranks
    if p.kind == "data":
        sent = [n / R * (R - 1) * (ID_BYTES + d * 4)] * R
        looked = [n / R * d] * R
        messages = 2 * (R - 1)  # the pairs' sizes, then the pairs
    elif p.kind == "column":
        widths = p.widths or (d,) * R
        sent = [n / R * (R - 1) * ID_BYTES + n * (R - 1) / R * widths[r] * wire
                + n / R * (d - widths[r]) * wire for r in range(R)]
        looked = [n * widths[r] for r in range(R)]
        messages = EXCHANGES * (R - 1)
    else:
        sent = [n / R * (1 - share[r]) * ID_BYTES + n * share[r] * (R - 1) / R * d * wire
                + n / R * (1 - share[r]) * d * wire for r in range(R)]
        looked = [n * share[r] * d for r in range(R)]
        messages = EXCHANGES * (R - 1)
    seconds = max(sent[r] * beta + messages * alpha + looked[r] * 4 * gamma for r in range(R))
    stored = max(p.bytes_on(r) for r in range(R))
    return Cost(p, stored, tuple(int(s) for s in sent), tuple(int(x) for x in looked), seconds)


def costs(placements: Sequence[Placement], ranks: int, lookups: Mapping[str, float],
          ids: Optional[Mapping[str, np.ndarray]] = None, *, wire_bytes: int = 4,
          alpha: float = 50e-6, beta: float = 1e-9, gamma: float = 1e-9) -> List[Cost]:
    """The `Cost` of each placement. `lookups`: {table: ids looked up per global
    batch}; `ids`: {table: ids of the first batches} for the owners' load (uniform
    where missing); `wire_bytes`: 2 with communication_dtype bfloat16 or float16.
    The defaults: a Python-level exchange (50 us), 1 GB/s, 1 GB/s of gathers."""
    ids = ids or {}
    out = []
    for p in placements:
        name = p.table.name
        share = hits(p, ids.get(name), ranks)
        out.append(_one(p, ranks, float(lookups.get(name, 0)), share, wire_bytes,
                        alpha, beta, gamma))
    return out


def describe(rows: Sequence[Cost], ranks: int) -> str:
    """The plan's cost as a table: table, kind, ranks, bytes (the most one rank
    stores, weights + optimizer slots), the most bytes one rank sends per step, the
    busiest rank's share of the looked-up values (its load), the estimated ms of the
    busiest rank."""
    lines = [f"embedding tables over {ranks} ranks (per step; stored: weights + optimizer "
             "slots, the most on one rank)",
             f"  {'table':<20} {'kind':<9} {'ranks':<10} {'stored bytes':>14} "
             f"{'sent bytes':>12} {'load':>5} {'est. ms':>8}"]
    for c in rows:
        p = c.placement
        where = ("all (copy)" if p.sizes is None else
                 str(p.ranks[0]) if p.kind == "table" else
                 ",".join(map(str, p.ranks)) if p.kind == "table-row" else f"0-{ranks - 1}")
        load = max(c.looked_up) / max(1, sum(c.looked_up))
        lines.append(f"  {p.table.name:<20} {p.kind:<9} {where:<10} {c.stored:>14,} "
                     f"{max(c.sent):>12,} {load:>5.0%} {c.seconds * 1e3:>8.3f}")
    total = sum(c.seconds for c in rows)
    lines.append(f"  {'total':<20} {'':<9} {'':<10} "
                 f"{max(sum(c.placement.bytes_on(r) for c in rows) for r in range(ranks)):>14,} "
                 f"{max(sum(c.sent[r] for c in rows) for r in range(ranks)):>12,} {'':>5} "
                 f"{total * 1e3:>8.3f}")
    return "\n".join(lines)


def to_plan(placements: Sequence[Placement]) -> Dict[str, str]:
    """The plan file's "tables": {layer name: kind} (fit re-places them alike)."""
    return {p.table.name: p.kind for p in placements}


def from_plan(sharding, plan: Optional[Mapping], source: str = "the plan"):
    """`embedding_sharding` for a run: the argument, else the plan's "tables"; both
    given and different is an error naming them."""
    tables = (plan or {}).get("tables")
    if tables is None:
        return sharding
    if not isinstance(tables, dict) or not all(isinstance(k, str) for k in tables):
        raise ValueError(f"{source}: 'tables' must be {{layer name: kind}}. Received: "
                         f"{tables!r}")
    if sharding is None or sharding == tables:
        return dict(tables)
    raise ValueError(
        f"embedding_sharding={sharding!r} and {source}'s tables {tables!r} differ. Leave "
        "embedding_sharding out to use the plan's, or write a new plan with `hyparflow "
        "plan --embedding-sharding`.")
