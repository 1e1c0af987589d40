"""A pipeline schedule as torch pipelining's action-list CSV, out and in, so that a
schedule can be compared across tools.

torch.distributed.pipelining (`_PipelineScheduleRuntime._load_csv`, format
"compute_only") reads one row per rank, one cell per action in the rank's order,
each cell `{stage}{F|I|W|B}{microbatch}`: F forward, B a whole backward, I the
backward for the stage's input only and W the weight gradients (a split backward,
as hyparflow's zero-bubble schedules run it); an empty cell is nothing. Stages are
virtual stages: rank r runs chunk c of an interleaved schedule as stage r + c x S.

hyparflow's "B" of a split schedule is torch's "I"; a W of several microbatches
(`W0-3`, one call) is written as one W cell per microbatch, and read back so. Pure:
no TensorFlow."""

from __future__ import annotations

import csv
import io
import re
from typing import List, Optional, Sequence, Tuple

from ..schedules import B, F, TABLE, W, Action, build, lower, simulate, validate
from ..schedules.actions import splits

__all__ = ["export", "parse", "match", "check"]

_CELL = re.compile(r"^(\d+)([FIWB])(\d+)$")


def export(lists: Sequence[Sequence[Action]]) -> str:
    """Compute-only lists (one per rank, `schedules.build`) as CSV text."""
    ranks = len(lists)
    split = any(splits(actions) for actions in lists)
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    for r, actions in enumerate(lists):
        row = []
        for a in actions:
            stage = r + a.chunk * ranks
            if a.kind == F:
                row.append(f"{stage}F{a.microbatch}")
            elif a.kind == B:
                row.append(f"{stage}{'I' if split else 'B'}{a.microbatch}")
            elif a.kind == W:
                row += [f"{stage}W{m}" for m in a.microbatches]
            else:
                raise ValueError(f"Rank {r}: {a} is not a compute action; export the "
                                 "compute-only lists (schedules.build), not lowered ones.")
        writer.writerow(row)
    return out.getvalue()


def parse(text: str) -> List[List[Action]]:
    """CSV text (one row per rank) as compute-only lists; a bad cell is named by its
    row and column."""
    rows = [row for row in csv.reader(io.StringIO(text))]
    while rows and not any(c.strip() for c in rows[-1]):
        rows.pop()
    ranks = len(rows)
    lists: List[List[Action]] = []
    for r, row in enumerate(rows):
        actions: List[Action] = []
        for c, cell in enumerate(row):
            cell = cell.strip()
            if not cell:
                continue
            found = _CELL.match(cell)
            if not found:
                raise ValueError(f"row {r} (rank {r}), column {c}: cannot read {cell!r}; a cell "
                                 "is {stage}{F|I|W|B}{microbatch}, e.g. 0F3 or 1I0.")
            stage, kind, micro = int(found.group(1)), found.group(2), int(found.group(3))
            if stage % ranks != r:
                raise ValueError(f"row {r}, column {c}: {cell!r} is stage {stage}, which rank "
                                 f"{r} of {ranks} does not run (stage s runs on rank s % "
                                 f"{ranks}). Move it to row {stage % ranks}.")
            chunk = stage // ranks
            actions.append(Action(W if kind == W else F if kind == F else B, micro, chunk=chunk))
        lists.append(actions)
    return lists


def check(lists: Sequence[Sequence[Action]], microbatches: int) -> Tuple[float, float]:
    """Validate `lists` as a chain of stages (every microbatch forward and backward once
    per stage, messages matched) and play it with a forward of 1 and a backward of 2
    (I 1 and W 1 when split): (makespan, bubble)."""
    ranks = len(lists)
    chunks = 1 + max((a.chunk for actions in lists for a in actions), default=0)
    stages = ranks * chunks
    dests = [[s + 1] if s < stages - 1 else [] for s in range(stages)]
    sources = [[s - 1] if s > 0 else [] for s in range(stages)]
    lowered = lower(lists, sources, dests)
    validate(lowered, microbatches)
    split = any(splits(actions) for actions in lists)
    sim = simulate(lowered, 1.0, 1.0 if split else 2.0, weight_time=1.0 if split else 0.0)
    return sim.makespan, sim.bubble


def match(lists: Sequence[Sequence[Action]], microbatches: int) -> Optional[str]:
    """The name of hyparflow's schedule that gives exactly `lists` (its W's taken one
    microbatch each), or None."""
    ranks = len(lists)
    chunks = 1 + max((a.chunk for actions in lists for a in actions), default=0)

    def single(actions: Sequence[Action]) -> List[Tuple[str, int, int]]:
        return [(a.kind, m, a.chunk) for a in actions for m in a.microbatches]

    mine = [single(a) for a in lists]
    for name, schedule in TABLE.items():
        if schedule.chunked != (chunks > 1):
            continue
        try:
            built = build(name, ranks, microbatches, chunks)
        except ValueError:
            continue
        if [single(a) for a in built] == mine:
            return name
    return None
