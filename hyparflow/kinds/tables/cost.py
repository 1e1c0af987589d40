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

A rank's estimate of a step (`Link`): its bytes to each other rank at that link's
`beta` (within its host or across hosts), four exchanges with every other rank at
that link's `alpha` (every lookup exchange reaches every rank, empty messages too;
none for "data", whose pairs ride in the replicas' gather) and its Python calls
(`call`), its looked-up bytes at `gamma`, the ids it routes and looks up at
`per_id`, and, for an optimizer whose step touches every row (`Table.dense`: Adam),
its stored bytes at `update`. A table's estimate is its busiest rank's; a plan's is
the busiest rank's sum over the tables (`step_seconds`). `auto.choose` places the
tables "auto" by these."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence

import numpy as np

from .plan import Placement, host_groups

__all__ = ["Cost", "Link", "costs", "cost_of", "describe", "step_seconds", "hits", "to_plan",
           "from_plan"]

ID_BYTES = 8
EXCHANGES = 4  # counts, ids, rows, gradients


@dataclass(frozen=True)
class Link:
    """What the estimate charges: `alpha` seconds per message and `beta` seconds per
    byte between two ranks of one host, `alpha_inter` / `beta_inter` between hosts
    (None: as within), `gamma` seconds per byte a rank gathers or scatters (its
    lookups and their gradients), `per_id` seconds per id a rank routes or looks up
    (the bucketing, argsort and index work in numpy), `update` seconds per stored byte
    an optimizer whose step touches every row (Adam, RMSprop: `Table.dense`) steps,
    `call` seconds per sharded table on every rank (its lookup's three Python calls
    from the compiled step into the exchanges). The defaults: a Python-level exchange
    (50 us), 1 GB/s, and what a 2-core machine measured for the rest
    (benchmarks/tables.py, docs/recommenders.md). `hyparflow plan` replaces the link's
    terms with the measured (or told) ones."""

    alpha: float = 50e-6
    beta: float = 1e-9
    alpha_inter: Optional[float] = None
    beta_inter: Optional[float] = None
    gamma: float = 1e-9
    per_id: float = 20e-9
    update: float = 0.2e-9
    call: float = 150e-6

    def terms(self, across: bool):
        if across:
            return (self.alpha if self.alpha_inter is None else self.alpha_inter,
                    self.beta if self.beta_inter is None else self.beta_inter)
        return self.alpha, self.beta


@dataclass(frozen=True)
class Cost:
    """One table's cost per step: its placement, the most bytes one rank stores, the
    bytes each rank sends (of them, `cross`: to other hosts), the values each looks
    up, each rank's estimated seconds (`times`) and the busiest rank's (`seconds`)."""

    placement: Placement
    stored: int
    sent: tuple
    looked_up: tuple
    seconds: float
    cross: tuple = ()
    times: tuple = ()


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


def _matrix(p: Placement, ranks: int, n: float, share: np.ndarray, wire: int):
    """bytes[r, q]: what rank r sends rank q per step; ids[r]: the ids rank r routes
    and looks up; looked[r]: the values it looks up."""
    d, R = p.table.dim, ranks
    out = np.zeros((R, R))
    if p.kind == "data":
        out[:] = n / R * (ID_BYTES + d * 4)  # its gradient pairs, to every replica
        looked = np.full(R, n / R * d)
        ids = np.full(R, n / R)
    elif p.kind == "column":
        w = np.asarray(p.widths or (d,) * R, float)
        # Its ids to q, its columns of q's rows, q's columns of its rows' gradients.
        out[:] = n / R * ID_BYTES + n / R * w[:, None] * wire + n / R * w[None, :] * wire
        looked = n * w
        ids = np.full(R, n / R + n)
    else:
        # Its ids owned by q (and their gradients), and the rows q asked it for.
        out[:] = n / R * (share[None, :] * (ID_BYTES + d * wire) + share[:, None] * d * wire)
        looked = n * share * d
        ids = n / R + n * share
    np.fill_diagonal(out, 0.0)
    return out, ids, looked


def cost_of(p: Placement, ranks: int, n: float, share: np.ndarray, wire: int = 4,
            link: Link = Link(), hosts: Optional[Sequence[str]] = None) -> Cost:
    """The `Cost` of placement `p` looked up `n` times per global batch, `share[r]`
    of the ids owned by rank r (`hits`), over the hosts `hosts[r]` (None: one)."""
    R = ranks
    out, ids, looked = _matrix(p, R, float(n), share, wire)
    host = np.zeros(R, int)
    for k, group in enumerate(host_groups(hosts, R)):
        host[group] = k
    across = host[:, None] != host[None, :]
    (a_in, b_in), (a_x, b_x) = link.terms(False), link.terms(True)
    # A "data" table's pairs ride in the replicas' one gather of every sparse gradient:
    # no exchange of its own. A sharded one has its four, with every rank, and its calls.
    messages, call = (0, 0.0) if p.kind == "data" else (EXCHANGES, link.call)
    peers_x = across.sum(axis=1)
    stored = [p.bytes_on(r) for r in range(R)]
    times = []
    for r in range(R):
        t = (out[r][~across[r]].sum() * b_in + out[r][across[r]].sum() * b_x
             + messages * ((R - 1 - peers_x[r]) * a_in + peers_x[r] * a_x)
             + looked[r] * 4 * link.gamma + ids[r] * link.per_id + call)
        if p.table.dense:
            t += stored[r] * link.update
        times.append(float(t))
    sent = out.sum(axis=1)
    cross = (out * across).sum(axis=1)
    whole = lambda v: tuple(int(round(x)) for x in v)  # noqa: E731
    return Cost(p, max(stored), whole(sent), whole(looked), max(times), whole(cross),
                tuple(times))


def costs(placements: Sequence[Placement], ranks: int, lookups: Mapping[str, float],
          ids: Optional[Mapping[str, np.ndarray]] = None, *, wire_bytes: int = 4,
          alpha: Optional[float] = None, beta: Optional[float] = None,
          gamma: Optional[float] = None, link: Optional[Link] = None,
          hosts: Optional[Sequence[str]] = None) -> List[Cost]:
    """The `Cost` of each placement. `lookups`: {table: ids looked up per global
    batch}; `ids`: {table: ids of the first batches} for the owners' load (uniform
    where missing); `wire_bytes`: 2 with communication_dtype bfloat16 or float16;
    `link` (or `alpha`, `beta`, `gamma` in place of its fields): what is charged;
    `hosts[r]`: rank r's host (the links between hosts cost `link`'s inter terms)."""
    link = link or Link()
    given = {k: v for k, v in (("alpha", alpha), ("beta", beta), ("gamma", gamma))
             if v is not None}
    if given:
        link = Link(**{**link.__dict__, **given})
    ids = ids or {}
    out = []
    for p in placements:
        name = p.table.name
        share = hits(p, ids.get(name), ranks)
        out.append(cost_of(p, ranks, float(lookups.get(name, 0)), share, wire_bytes, link,
                           hosts))
    return out


def describe(rows: Sequence[Cost], ranks: int) -> str:
    """The plan's cost as a table: table, kind, ranks, bytes (the most one rank
    stores, weights + optimizer slots), the most bytes one rank sends per step (and,
    over several hosts, to other hosts), the busiest rank's share of the looked-up
    values (its load), the estimated ms of the busiest rank. The total's ms is the
    busiest rank's sum over the tables (the ranks work at once)."""
    hosts = any(any(c.cross) for c in rows)
    extra = f" {'cross-host':>11}" if hosts else ""
    lines = [f"embedding tables over {ranks} ranks (per step; stored: weights + optimizer "
             "slots, the most on one rank)",
             f"  {'table':<20} {'kind':<9} {'ranks':<10} {'stored bytes':>14} "
             f"{'sent bytes':>12}{extra} {'load':>5} {'est. ms':>8}"]
    for c in rows:
        p = c.placement
        where = ("all (copy)" if p.sizes is None else
                 str(p.ranks[0]) if p.kind == "table" else
                 ",".join(map(str, p.ranks)) if p.kind == "table-row" else f"0-{ranks - 1}")
        load = max(c.looked_up) / max(1, sum(c.looked_up))
        cross = f" {max(c.cross):>11,}" if hosts else ""
        lines.append(f"  {p.table.name:<20} {p.kind:<9} {where:<10} {c.stored:>14,} "
                     f"{max(c.sent):>12,}{cross} {load:>5.0%} {c.seconds * 1e3:>8.3f}")
    cross = (f" {max(sum(c.cross[r] for c in rows) for r in range(ranks)):>11,}"
             if hosts else "")
    lines.append(f"  {'total':<20} {'':<9} {'':<10} "
                 f"{max(sum(c.placement.bytes_on(r) for c in rows) for r in range(ranks)):>14,} "
                 f"{max(sum(c.sent[r] for c in rows) for r in range(ranks)):>12,}{cross} "
                 f"{'':>5} {step_seconds(rows, ranks) * 1e3:>8.3f}")
    return "\n".join(lines)


def step_seconds(rows: Sequence[Cost], ranks: int) -> float:
    """The tables' estimated seconds per step: the busiest rank's sum over them."""
    return max((sum(c.times[r] for c in rows) for r in range(ranks)), default=0.0)


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
