"""One record per schedule: its builder and what the rest of hyparflow asks of it.

Adding a schedule is a builder (`builders.py`) and one line in `TABLE`; the layout's
check, the executor (`auto`'s trials, W in the waits), the planner's defaults and its
memory rule (the simulation's peak live activations) all read the table."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from .actions import Action
from .builders import gpipe, interleaved, one_f_one_b, one_f_one_b_w, zb_batched, zb_h1
from .lower import fuse

__all__ = ["Schedule", "TABLE", "SCHEDULES", "CHUNKED", "SPLIT", "FILLS", "AUTO", "PLANNED",
           "build", "effective", "program"]

Lists = list[list[Action]]


@dataclass(frozen=True)
class Schedule:
    """`builder(S, M)` (or `builder(S, M, chunks)` when `chunked`) gives compute-only
    lists, one per rank. `chunked`: a rank runs several model chunks. `split`: the
    backward is split into B and W. `fills`: the executor also runs W wherever a
    stage would wait for a message (`Executor._fill`), on top of the W's placed by
    the builder. `auto`: tried by `schedule="auto"` (in this order). `planned`: in
    `hyparflow plan`'s default search."""
    name: str
    builder: Callable[..., Lists]
    chunked: bool = False
    split: bool = False
    fills: bool = False
    auto: bool = False
    planned: bool = True


TABLE: dict[str, Schedule] = {s.name: s for s in (
    Schedule("gpipe", gpipe),
    Schedule("1f1b", one_f_one_b, auto=True),
    Schedule("1f1b-w", one_f_one_b_w, split=True, auto=True),
    Schedule("zb-h1", zb_h1, split=True, auto=True),
    Schedule("zb-batched", zb_batched, split=True, fills=True, auto=True),
    Schedule("interleaved", interleaved, chunked=True, planned=False),
)}

# Views of the table, by the names callers used before it.
SCHEDULES: dict[str, Callable[..., Lists]] = {n: s.builder for n, s in TABLE.items()}
CHUNKED: tuple[str, ...] = tuple(n for n, s in TABLE.items() if s.chunked)
SPLIT: tuple[str, ...] = tuple(n for n, s in TABLE.items() if s.split)
FILLS: tuple[str, ...] = tuple(n for n, s in TABLE.items() if s.fills)
AUTO: tuple[str, ...] = tuple(n for n, s in TABLE.items() if s.auto)
PLANNED: tuple[str, ...] = tuple(n for n, s in TABLE.items() if s.planned)


def build(name: str, num_stages: int, num_microbatches: int, chunks: int = 1) -> Lists:
    """Compute-only lists of schedule `name` (F, B and, for split schedules, W), one per
    rank; `chunks`: model chunks per rank, for the schedules in `CHUNKED` only."""
    try:
        schedule = TABLE[name]
    except KeyError:
        raise ValueError(
            f"Unknown schedule {name!r}; choose one of {sorted(TABLE)}. "
            f"Received: schedule={name!r}"
        ) from None
    if schedule.chunked:
        return schedule.builder(num_stages, num_microbatches, chunks)
    if chunks != 1:
        raise ValueError(f"num_chunks={chunks} model chunks per rank need "
                         f"schedule={' or '.join(repr(n) for n in CHUNKED)}; {name!r} runs "
                         f"one stage per rank. Received: schedule={name!r}, num_chunks={chunks}")
    return schedule.builder(num_stages, num_microbatches)


def effective(name: str, num_stages: int) -> str:
    """The schedule a training step runs: with one stage, 1F1B's order (F0 B0 F1 B1 ...)
    sums the same gradients in the same order as any other, and lets each backward
    fuse with its forward."""
    return "1f1b" if num_stages == 1 else name


def program(name: str, num_stages: int, num_microbatches: int, dests: Sequence[Sequence[int]],
            chunks: int = 1, recompute: bool = False, gathered: bool = False) -> Lists:
    """The compute lists of one training step, which the executor runs and the planner
    times (one program for both, so they cannot disagree). `dests`: per virtual stage,
    the stages it sends activations to. `gathered`: the losses wait for a global count
    (`normaliser`): all forwards, then all backwards, nothing fused. A short batch whose
    microbatches are no whole groups of S under model chunks runs GPipe's order too
    (same sums, same order)."""
    if gathered:
        return gpipe(num_stages, num_microbatches, chunks)
    if chunks > 1 and num_microbatches % num_stages:
        compute = gpipe(num_stages, num_microbatches, chunks)
    else:
        compute = build(effective(name, num_stages), num_stages, num_microbatches, chunks)
    return fuse(compute, dests, recompute)
