"""A schedule's words: `Action` (one thing a stage does), its kinds, and the short
string forms ("F0 F1 B0 B1", "sa0@1") that keep tests readable."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Iterable, Sequence

__all__ = ["Action", "F", "B", "W", "FB", "SEND_ACT", "RECV_ACT", "SEND_GRAD", "RECV_GRAD",
           "ALLREDUCE", "STEP", "parse", "format_actions", "chunks_of", "splits", "message"]

F, B, W, FB = "F", "B", "W", "FB"
SEND_ACT, RECV_ACT = "SEND_ACT", "RECV_ACT"
SEND_GRAD, RECV_GRAD = "SEND_GRAD", "RECV_GRAD"
ALLREDUCE, STEP = "ALLREDUCE", "STEP"

_SHORT = {SEND_ACT: "sa", RECV_ACT: "ra", SEND_GRAD: "sg", RECV_GRAD: "rg"}
_LONG = {v: k for k, v in _SHORT.items()}


@dataclass(frozen=True)
class Action:
    """One thing a stage does: `kind` on `microbatch`, with `peer` stage for messages."""

    kind: str
    microbatch: int = -1
    peer: int = -1
    count: int = 1  # W: microbatches microbatch .. microbatch + count - 1 in one call
    # Interleaved schedules: which of the rank's model chunks the action is for. Rank
    # s of S ranks runs chunk c as virtual stage s + c * S; `peer` is then a virtual
    # stage too. 0 (every other schedule): the rank's one stage, and stage = rank.
    chunk: int = 0

    @property
    def microbatches(self) -> range:
        return range(self.microbatch, self.microbatch + self.count)

    def __str__(self) -> str:
        tail = f".{self.chunk}" if self.chunk else ""
        if self.kind == W and self.count > 1:
            return f"W{self.microbatch}-{self.microbatch + self.count - 1}{tail}"
        if self.kind in (F, B, W, FB):
            return f"{self.kind}{self.microbatch}{tail}"
        if self.kind in _SHORT:
            return f"{_SHORT[self.kind]}{self.microbatch}{tail}@{self.peer}"
        return self.kind


def parse(text: str) -> list[Action]:
    """`"F0 F1 B0 B1"` -> list of Actions (the inverse of `format_actions`); a chunk
    other than 0 is a suffix: `F3.1` (microbatch 3 of chunk 1), `sa3.1@2`."""
    actions = []
    for word in text.split():
        head, _, rest = word.partition("@")
        if "." in head:
            head, _, c = head.rpartition(".")
            if not c.isdigit():
                raise ValueError(f"Cannot parse schedule word {word!r} in {text!r}")
            plain = head + ("@" + rest if rest else "")
            actions += [replace(a, chunk=int(c)) for a in parse(plain)]
            continue
        if word in (ALLREDUCE, STEP):
            actions.append(Action(word))
        elif word[:2] == FB and word[2:].isdigit():
            actions.append(Action(FB, int(word[2:])))
        elif word[0] == W and "-" in word and all(p.isdigit() for p in word[1:].split("-")):
            first, last = map(int, word[1:].split("-"))
            actions.append(Action(W, first, count=last - first + 1))
        elif word[0] in (F, B, W) and word[1:].isdigit():
            actions.append(Action(word[0], int(word[1:])))
        elif word[:2] in _LONG and "@" in word:
            micro, peer = word[2:].split("@")
            actions.append(Action(_LONG[word[:2]], int(micro), int(peer)))
        else:
            raise ValueError(f"Cannot parse schedule word {word!r} in {text!r}")
    return actions


def format_actions(actions: Iterable[Action]) -> str:
    return " ".join(str(a) for a in actions)


def chunks_of(lists: Sequence[Sequence[Action]]) -> int:
    """How many model chunks each rank of these lists runs (1 unless interleaved)."""
    return 1 + max((a.chunk for actions in lists for a in actions), default=0)


def splits(actions: Iterable[Action]) -> bool:
    """Whether a stage's list splits its backward (has W actions)."""
    return any(a.kind == W for a in actions)


def message(action: Action, stage: int, ranks: int) -> tuple[object, ...]:
    """The (kind, source, destination, microbatch) a send or a receive on `stage` (of
    `ranks` lists) is about; with chunks, source and destination are virtual stages."""
    kind = "act" if action.kind in (SEND_ACT, RECV_ACT) else "grad"
    here = stage + action.chunk * ranks
    if action.kind in (SEND_ACT, SEND_GRAD):
        return kind, here, action.peer, action.microbatch
    return kind, action.peer, here, action.microbatch
