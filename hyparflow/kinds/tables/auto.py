"""`embedding_sharding="auto"`: the kind and the ranks of each table chosen by cost,
as TorchRec's planner does (pure: numpy only).

Per table, the candidates: "data" for a tiny table (under `TINY` of one rank's share
of all the tables: sharding it would cost its exchanges and save no memory to speak
of), else "table" on each rank, "row" (rows >= R), "column" (output_dim >= R) and,
on more than one host, "table-row" on each host. Each candidate is costed as
`cost.cost_of` does: the bytes it stores on each rank (weights and optimizer slots)
and each rank's time per step (its bytes over the links, within a host or across,
its messages, its lookups from the id distribution of the first batches, its
optimizer's step). The tables go costliest first (each by the larger of its share of
all the bytes and of all the time), each to the candidate that fits under
`memory_limit` with the smallest busiest rank's time once added to what is already
placed; ties go to the smallest total time, then the fewest bytes on the fullest
rank. So skewed ids, which pile a "row" table's hot rows onto one owner, pick
"column" (every rank does 1/R of every lookup) or spread the tables over the ranks;
a table over `memory_limit` goes "row", "column" or "table-row"; across hosts,
"table-row" keeps the lookups of a host's own tables on the host."""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Sequence, Union

import numpy as np

from . import cost as C
from . import plan as _plan
from .plan import Placement, Table, _even, host_groups

__all__ = ["place", "choose", "candidates", "TINY", "DEFAULT_LOOKUPS"]

TINY = 0.01  # of one rank's share of all the tables' bytes: below it, "data"
DEFAULT_LOOKUPS = 1024  # ids per step of a table when the caller does not say
_ORDER = {"data": 0, "table": 1, "table-row": 2, "row": 3, "column": 4}  # last tie-break


def candidates(t: Table, ranks: int, groups: List[List[int]], tiny: bool) -> List[Placement]:
    """The placements `t` may take (see the module's docstring)."""
    if tiny:
        return [Placement(t, "data", why="tiny: replicated")]
    out = [Placement(t, "table", tuple(t.rows if q == r else 0 for q in range(ranks)))
           for r in range(ranks)]
    if t.rows >= ranks:
        out.append(Placement(t, "row", _even(t.rows, ranks)))
    if t.dim >= ranks:
        out.append(Placement(t, "column", (t.rows,) * ranks, widths=_even(t.dim, ranks)))
    if len(groups) > 1:
        for g in groups:
            if len(g) > 1 and t.rows >= len(g):
                cut = dict(zip(g, _even(t.rows, len(g))))
                out.append(Placement(t, "table-row", tuple(cut.get(q, 0) for q in range(ranks))))
    return out


def place(tables: Sequence[Table], sharding: Union[str, Dict[str, str]], ranks: int,
          memory_limit: Optional[float] = None, refused: Optional[Dict[str, str]] = None,
          hosts: Optional[Sequence[str]] = None, **costed: Any) -> List[Placement]:
    """`plan.place`, with "auto" chosen by cost (`choose`; `costed`: its keywords)."""
    if sharding == "auto":
        return choose(tables, ranks, memory_limit, refused, hosts, **costed)
    return _plan.place(tables, sharding, ranks, memory_limit, refused, hosts)


def choose(tables: Sequence[Table], ranks: int, memory_limit: Optional[float] = None,
           refused: Optional[Dict[str, str]] = None, hosts: Optional[Sequence[str]] = None,
           *, lookups: Optional[Mapping[str, float]] = None,
           ids: Optional[Mapping[str, np.ndarray]] = None, link: Optional[C.Link] = None,
           wire_bytes: int = 4) -> List[Placement]:
    """One `Placement` per table (in the order of `tables`), chosen by cost.
    `lookups`: {table: ids looked up per global batch} (missing: `DEFAULT_LOOKUPS`);
    `ids`: {table: ids of the first batches} (missing: uniform); `link`: what the
    estimate charges (`cost.Link`); `hosts[r]`: rank r's host."""
    refused, lookups, ids = refused or {}, lookups or {}, ids or {}
    link = link or C.Link()
    groups = host_groups(hosts, ranks)
    shardable = [t for t in tables if t.name not in refused]
    share = sum(t.bytes for t in shardable) / ranks
    time, mem = np.zeros(ranks), np.zeros(ranks)
    chosen: Dict[str, Placement] = {}

    def priced(p: Placement) -> C.Cost:
        n = float(lookups.get(p.table.name, DEFAULT_LOOKUPS))
        return C.cost_of(p, ranks, n, C.hits(p, ids.get(p.table.name), ranks), wire_bytes,
                         link, hosts)

    # What cannot be sharded is on every rank first: the others fit around it.
    for t in tables:
        if t.name in refused:
            chosen[t.name] = p = Placement(t, "data", why=refused[t.name])
            c = priced(p)
            time += c.times
            mem += [p.bytes_on(r) for r in range(ranks)]
    options = {t.name: [(p, priced(p)) for p in
                        candidates(t, ranks, groups, t.bytes < TINY * share)]
               for t in shardable}
    # Costliest first: a table's weight is the larger of its share of all the bytes
    # and its share of all the time (each priced at its cheapest candidate).
    least = {n: min(sum(c.times) for _, c in opts) for n, opts in options.items()}
    total_time = sum(least.values()) or 1.0
    total_bytes = sum(t.bytes for t in shardable) or 1
    order = sorted(shardable, key=lambda t: (-max(t.bytes / total_bytes,
                                                  least[t.name] / total_time), t.name))
    for t in order:
        best, best_key = None, None
        for p, c in options[t.name]:
            stored = mem + [p.bytes_on(r) for r in range(ranks)]
            if memory_limit is not None and stored.max() > memory_limit:
                continue
            # To 0.1 us: equal costs (a table on either of two idle ranks) tie exactly.
            key = (round(float((time + c.times).max()) * 1e7), round(sum(c.times) * 1e7),
                   stored.max(), _ORDER[p.kind], p.ranks)
            if best_key is None or key < best_key:
                best, best_key = (p, c), key
        if best is None:
            fewest = min(max(p.bytes_on(r) for r in range(ranks)) for p, _ in options[t.name])
            raise ValueError(
                f"Embedding table {t.name!r} ({t.rows:,} x {t.dim}, {t.bytes:,} bytes with "
                f"the optimizer's slots) fits under no placement: its smallest share is "
                f"{fewest:,} bytes on one rank, and with the tables placed before it no rank "
                f"has room under memory_limit={int(memory_limit or 0):,} (bytes per rank, "
                f"{int(mem.min()):,} already used on the emptiest). Raise memory_limit, run "
                "on more ranks, or name the kinds (embedding_sharding={...}).")
        p, c = best
        chosen[t.name] = p
        time += c.times
        mem += [p.bytes_on(r) for r in range(ranks)]
    return [chosen[t.name] for t in tables]
