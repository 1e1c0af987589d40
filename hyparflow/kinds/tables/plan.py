"""Where each embedding table lives (pure: no TensorFlow, Keras or MPI).

A table is "table"-wise (all its rows on one rank), "row"-wise (its rows cut into R
contiguous ranges, one per rank), "column"-wise (its embedding dimension cut into R
contiguous slices, one per rank: every rank holds every row's slice) or "data" (every
rank holds it whole: hyparflow's replicated path, its gradient pairs gathered over
the replicas). `place` turns the
user's `embedding_sharding` ("auto", {layer name: kind}, or one kind for every table
that can take it: `expand`) into one `Placement` per
table: the rows each rank owns. "auto" chooses each table's kind and ranks by cost
(`auto.choose`, as TorchRec's planner does); `by_bytes` is the first rule, by bytes
alone (biggest table first, row-wise when it is larger than one rank's share of all
the tables or than `memory_limit`, otherwise whole on the least-loaded rank), kept
as the benchmark's baseline.

"table-row" (TorchRec's TABLE_ROW_WISE) is a "row" table whose owners are the ranks of
one host instead of every rank: its rows cut evenly over that host's ranks (that
host's lookups of it never leave the host; the other hosts' ids go there and rows come
back from it), the table-row tables spread over the hosts biggest first, each on the
host whose ranks hold the fewest bytes. Its `Placement` is a "row" one with zero rows
on the other hosts' ranks, so the lookups and parts are the row-wise ones. On one host
it is "row"."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

__all__ = ["Table", "Placement", "KINDS", "place", "expand", "by_bytes", "host_groups", "describe",
           "storage_factor", "dense_update"]

KINDS = ("table", "row", "column", "data", "table-row")


@dataclass(frozen=True)
class Table:
    """An Embedding layer as the planner sees it: its name, rows, width, bytes per
    value, and `factor`: stored values per weight (1 + the optimizer's slots)."""

    name: str
    rows: int
    dim: int
    itemsize: int = 4
    factor: int = 1
    dense: bool = False  # the optimizer steps every stored row each step (Adam's moments)

    @property
    def bytes(self) -> int:
        return self.rows * self.dim * self.itemsize * self.factor


@dataclass(frozen=True)
class Placement:
    """Where `table` lives: `kind`, and `sizes[r]`, the rows rank r owns (contiguous:
    rank r owns rows sum(sizes[:r]) .. sum(sizes[:r+1])); None for "data". For
    "column", `sizes` is every row on every rank and `widths[r]` the columns rank r
    owns (contiguous, like the rows)."""

    table: Table
    kind: str
    sizes: Optional[Tuple[int, ...]] = None
    why: str = ""
    widths: Optional[Tuple[int, ...]] = None

    @property
    def columns(self) -> List[int]:
        """The first column each rank owns (0 for all but "column")."""
        out, n = [], 0
        for w in self.widths or (0,) * len(self.sizes or ()):
            out.append(n)
            n += w
        return out

    @property
    def starts(self) -> List[int]:
        out, n = [], 0
        for s in self.sizes or ():
            out.append(n)
            n += s
        return out

    def bytes_on(self, rank: int) -> int:
        if self.sizes is None:
            return self.table.bytes
        width = self.table.dim if self.widths is None else self.widths[rank]
        return self.sizes[rank] * width * self.table.itemsize * self.table.factor

    @property
    def ranks(self) -> List[int]:
        if self.sizes is None:
            return []
        return [r for r, s in enumerate(self.sizes)
                if s and (self.widths is None or self.widths[r])]


def storage_factor(optimizer_name: str, *, momentum: float = 0.0, amsgrad: bool = False,
                   centered: bool = False) -> int:
    """Values stored per weight: the weight and the optimizer's slots for it."""
    slots = {"SGD": 1 if momentum else 0, "Adagrad": 1, "Adam": 2, "AdamW": 2, "Adamax": 2,
             "Nadam": 2, "RMSprop": 1 + (1 if momentum else 0) + (1 if centered else 0),
             "Ftrl": 2, "Lion": 1, "Adadelta": 2}.get(optimizer_name, 2)
    return 1 + slots + (1 if amsgrad else 0)


def dense_update(optimizer_name: str, *, momentum: float = 0.0) -> bool:
    """Whether the optimizer's step touches every row of a table, looked up or not
    (Adam's moments decay everywhere), so its time grows with the rows a rank
    stores; SGD without momentum and Adagrad scatter the looked-up rows only."""
    return not (optimizer_name == "Adagrad" or (optimizer_name == "SGD" and not momentum))


def _even(rows: int, n: int) -> Tuple[int, ...]:
    base, extra = divmod(rows, n)
    return tuple(base + (1 if r < extra else 0) for r in range(n))


def host_groups(hosts: Optional[Sequence[str]], ranks: int) -> List[List[int]]:
    """The ranks of each host, hosts in the order of their first rank (`hosts[r]`: rank
    r's host; None: one host)."""
    if hosts is None:
        return [list(range(ranks))]
    if len(hosts) != ranks:
        raise ValueError(f"hosts names {len(hosts)} ranks' hosts, but there are {ranks} "
                         f"ranks. Received: hosts={list(hosts)!r}")
    groups: Dict[str, List[int]] = {}
    for r, h in enumerate(hosts):
        groups.setdefault(h, []).append(r)
    return list(groups.values())


def by_bytes(tables: Sequence[Table], ranks: int, memory_limit: Optional[float] = None,
             refused: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """The kinds of the first planner, by bytes alone (the benchmark's baseline):
    "row" for a table larger than one rank's share of all the tables (or than
    `memory_limit`), else "table"; `place` then puts the whole tables on the
    least-loaded rank, biggest first."""
    refused = refused or {}
    total = sum(t.bytes for t in tables if t.name not in refused)
    cap = total / ranks if memory_limit is None else min(total / ranks, float(memory_limit))
    return {t.name: "data" if t.name in refused else
            "row" if t.bytes > cap and t.rows >= ranks else "table" for t in tables}


def expand(kind: str, tables: Sequence[Table], ranks: int,
           refused: Optional[Dict[str, str]] = None) -> Tuple[Dict[str, str], Dict[str, str]]:
    """`embedding_sharding=kind` (one kind name) as {layer name: kind}: the kind for
    every table that can take it, "data" for the others; and {name: why} of those
    others (a table that cannot be sharded, or has fewer rows or columns than the
    kind cuts it into)."""
    if kind not in KINDS or kind == "data":
        raise ValueError(
            f"embedding_sharding={kind!r} is not a sharding kind. Use 'auto', one of "
            f"{[k for k in KINDS if k != 'data']} for every table, or a dict {{layer name: "
            f"kind}}; leave embedding_sharding out to shard nothing.")
    refused = refused or {}
    wanted, kept = {}, {}
    for t in tables:
        if t.name in refused:
            kept[t.name] = refused[t.name]
        elif kind in ("row", "table-row") and t.rows < ranks:
            kept[t.name] = f"{t.rows} rows, fewer than {ranks} ranks"
        elif kind == "column" and t.dim < ranks:
            kept[t.name] = f"{t.dim} columns, fewer than {ranks} ranks"
        else:
            wanted[t.name] = kind
            continue
        wanted[t.name] = "data"
    return wanted, kept


def place(tables: Sequence[Table], sharding: Union[str, Dict[str, str]], ranks: int,
          memory_limit: Optional[float] = None, refused: Optional[Dict[str, str]] = None,
          hosts: Optional[Sequence[str]] = None, **costed: Any) -> List[Placement]:
    """One `Placement` per table, in the order of `tables`. `refused`: {name: why it
    cannot be sharded}: "auto" keeps those as "data"; naming one is an error.
    `hosts[r]`: rank r's host, for "table-row" (None: every rank on one host).
    "auto" is `auto.place`'s (it costs the placements: `costed` are its `lookups`,
    `ids`, `link`, `wire_bytes`); this module, which it imports, places named kinds."""
    groups = host_groups(hosts, ranks)
    refused = refused or {}
    names = [t.name for t in tables]
    if sharding == "auto" or costed:
        raise ValueError("plan.place places named kinds: place embedding_sharding='auto' "
                         "with kinds.tables.auto.place (it costs the candidates).")
    if isinstance(sharding, dict):
        unknown = sorted(set(sharding) - set(names))
        if unknown:
            raise ValueError(
                f"embedding_sharding names {unknown}, which are not Embedding layers of the "
                f"model. Its Embedding layers: {names}. Use their names (layer.name), or "
                "embedding_sharding='auto'.")
        for name, kind in sharding.items():
            if kind not in KINDS:
                raise ValueError(
                    f"embedding_sharding[{name!r}] = {kind!r} is not a sharding kind. Use one "
                    f"of {list(KINDS)}.")
            if kind != "data" and name in refused:
                raise ValueError(
                    f"embedding_sharding[{name!r}] = {kind!r}, but layer {name!r} cannot be "
                    f"sharded: {refused[name]}. Use {name!r}: 'data' (replicated).")
        wanted = dict(sharding)
    else:
        raise ValueError(
            f"embedding_sharding must be 'auto', one kind for every table ('table', 'row', "
            f"'column' or 'table-row') or a dict {{layer name: 'table' | 'row' | "
            f"'column' | 'data' | 'table-row'}}. Received: embedding_sharding={sharding!r}")
    load = [0] * ranks
    chosen: Dict[str, Placement] = {}
    # Biggest first, row-wise ones before the whole tables are placed on the loads.
    order = sorted(tables, key=lambda t: -t.bytes)
    for t in order:
        kind = wanted.get(t.name, "data")
        if kind == "row":
            if t.rows < ranks:
                raise ValueError(
                    f"embedding_sharding[{t.name!r}] = 'row' needs at least as many rows as "
                    f"ranks ({t.rows} < {ranks}). Use 'table' for it.")
            sizes = _even(t.rows, ranks)
            chosen[t.name] = Placement(t, "row", sizes)
            for r in range(ranks):
                load[r] += chosen[t.name].bytes_on(r)
        elif kind == "column":
            if t.dim < ranks:
                raise ValueError(
                    f"embedding_sharding[{t.name!r}] = 'column' needs at least as many "
                    f"columns (output_dim) as ranks ({t.dim} < {ranks}). Use 'row' or "
                    "'table' for it.")
            chosen[t.name] = Placement(t, "column", (t.rows,) * ranks,
                                       widths=_even(t.dim, ranks))
            for r in range(ranks):
                load[r] += chosen[t.name].bytes_on(r)
        elif kind == "data":
            chosen[t.name] = Placement(t, "data")
            for r in range(ranks):
                load[r] += t.bytes
    # Table-row tables next, biggest first, each on the host whose ranks hold the
    # fewest bytes on average (the fixed kinds above already counted).
    for t in order:
        if wanted.get(t.name) != "table-row" or t.name in chosen:
            continue
        few = min(len(g) for g in groups)
        if t.rows < few:
            raise ValueError(
                f"embedding_sharding[{t.name!r}] = 'table-row' needs at least as many rows "
                f"as a host has ranks ({t.rows} < {few}). Use 'table' for it.")
        fits = [g for g in groups if len(g) <= t.rows]
        group = min(fits, key=lambda g: (sum(load[q] for q in g) / len(g), g[0]))
        cut = dict(zip(group, _even(t.rows, len(group))))
        chosen[t.name] = Placement(t, "table-row", tuple(cut.get(q, 0) for q in range(ranks)))
        for q in group:
            load[q] += chosen[t.name].bytes_on(q)
    for t in order:
        if t.name in chosen:
            continue
        r = min(range(ranks), key=lambda q: (load[q], q))  # the least-loaded rank
        chosen[t.name] = Placement(t, "table", tuple(t.rows if q == r else 0
                                                     for q in range(ranks)))
        load[r] += t.bytes
    if memory_limit is not None and max(load) > memory_limit:
        worst = max(range(ranks), key=lambda q: load[q])
        raise ValueError(
            f"The embedding tables need {load[worst]:,} bytes on rank {worst} (weights and "
            f"optimizer slots), over memory_limit={memory_limit:,}. Shard more of them "
            "row-wise ('row'), run on more ranks, or raise memory_limit.")
    return [chosen[n] for n in names]


def describe(placements: Sequence[Placement], ranks: int) -> str:
    """The plan as a table of lines: table, kind, ranks, bytes per rank."""
    lines = [f"embedding sharding over {ranks} ranks (bytes: weights + optimizer slots)",
             f"  {'table':<24} {'kind':<9} {'rows':>10} {'ranks':<12} bytes per rank"]
    for p in placements:
        if p.sizes is None:
            where = "all (copy)"
        elif p.kind == "table":
            where = str(p.ranks[0])
        elif p.kind == "column":
            where = f"0-{ranks - 1} (cols)"
        elif p.kind == "table-row":
            where = ",".join(map(str, p.ranks))  # one host's ranks
        else:
            where = f"0-{ranks - 1}"
        per = [p.bytes_on(r) for r in range(ranks)]
        lines.append(f"  {p.table.name:<24} {p.kind:<9} {p.table.rows:>10,} {where:<12} "
                     + " ".join(f"{b:,}" for b in per)
                     + (f"  ({p.why})" if p.why else ""))
    totals = [sum(p.bytes_on(r) for p in placements) for r in range(ranks)]
    lines.append(f"  {'total':<24} {'':<9} {'':>10} {'':<12} " + " ".join(f"{b:,}" for b in totals))
    return "\n".join(lines)
