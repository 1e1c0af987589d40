"""How the replicas keep in step: `replica_sync` of `hyparflow.fit`, as objects.

- "allreduce" (the default): every step sums the replicas' gradients, so every
  replica takes the same step and training ends where `model.fit` ends.
- `LocalSGD(every=k)`: each replica steps on its own slice of the batch; every k
  steps the replicas' weights are averaged (periodic model averaging).
- `LeaderSGD(pull=c, local_every=l, global_every=g)`: each replica steps on its
  own; every l steps the replica with the lowest training loss of each group
  (its host's replicas) is that group's leader, and the others move a fraction c
  of the way to it, x <- (1 - c) x + c x_leader; every g steps the same with the
  global leader (Teng et al., "Leader Stochastic Gradient Descent", NeurIPS 2019).

Only the configuration lives here (pure Python); `hyparflow.replicas` runs it.
The two local methods leave the numerical contract by design: docs/replicas.md
says what they promise instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

__all__ = ["LocalSGD", "LeaderSGD", "resolve", "check", "ALLREDUCE"]

ALLREDUCE = "allreduce"


def _count(name: str, value: Any, owner: str, allow_none: bool = False) -> None:
    if allow_none and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        extra = " or None" if allow_none else ""
        raise ValueError(f"{owner}: `{name}` must be an integer >= 1{extra}. "
                         f"Received: {name}={value!r}")


@dataclass(frozen=True)
class LocalSGD:
    """Periodic model averaging: each replica steps on its own slice of every batch,
    and every `every` steps all replicas' weights (trainable and BatchNorm
    statistics) are replaced by their mean. Optimizer state stays per replica.

    `every=1` with plain SGD (with or without momentum) trains to `model.fit`'s
    weights, to round-off; larger `every` communicates `every` times less."""

    every: int = 8

    def __post_init__(self) -> None:
        _count("every", self.every, "LocalSGD")

    def describe(self) -> str:
        return f"LocalSGD(every={self.every})"


@dataclass(frozen=True)
class LeaderSGD:
    """Leader-based replicas (LSGD). Each replica steps on its own slice of every
    batch. The replicas' training losses of the step are gathered so that every
    rank agrees on the leaders (lowest loss; ties to the lower replica). Every
    `local_every` steps, the leader of each group of replicas broadcasts its
    weights to its group and every other replica moves x <- (1 - pull) x +
    pull x_leader; every `global_every` steps the same with the global leader
    (after the local pull when both fall on one step, as the authors' code
    does). BatchNorm statistics are averaged over the group at each pull; the
    leader itself is not moved. Optimizer state stays per replica.

    Args:
        pull: c, the fraction of the way to the leader, in (0, 1].
        local_every: steps between pulls to each group's leader; None: none.
        global_every: steps between pulls to the global leader; None: none.
        groups: None: a group per host (the hosts the ranks run on: `--hosts`,
            Slurm nodes; one group on one host); an integer n: n groups of
            consecutive replicas (it must divide the replicas).
    """

    pull: float = 0.1
    local_every: Optional[int] = 64
    global_every: Optional[int] = 128
    groups: Optional[int] = None

    def __post_init__(self) -> None:
        if isinstance(self.pull, bool) or not isinstance(self.pull, (int, float)) or not (
                0.0 < float(self.pull) <= 1.0):
            raise ValueError(f"LeaderSGD: `pull` must be a number in (0, 1]: the fraction "
                             f"of the way to the leader. Received: pull={self.pull!r}")
        _count("local_every", self.local_every, "LeaderSGD", allow_none=True)
        _count("global_every", self.global_every, "LeaderSGD", allow_none=True)
        _count("groups", self.groups, "LeaderSGD", allow_none=True)
        if self.local_every is None and self.global_every is None:
            raise ValueError("LeaderSGD: local_every and global_every are both None, so no "
                             "replica would ever move to a leader. Give one of them.")

    def describe(self) -> str:
        return (f"LeaderSGD(pull={self.pull}, local_every={self.local_every}, "
                f"global_every={self.global_every}"
                + (f", groups={self.groups}" if self.groups is not None else "") + ")")


def check(method: Any, num_replicas: int) -> None:
    """Refuse a method that cannot run with `num_replicas` replicas."""
    if isinstance(method, LeaderSGD) and method.groups is not None and (
            num_replicas % method.groups):
        raise ValueError(f"LeaderSGD(groups={method.groups}) must divide the replicas "
                         f"(num_replicas={num_replicas}). Pass a divisor of {num_replicas}, "
                         "or groups=None (one group per host).")


def resolve(value: Any) -> Any:
    """`replica_sync` -> None (allreduce: today's exact training), or the method."""
    if value is None or value == ALLREDUCE:
        return None
    if isinstance(value, (LocalSGD, LeaderSGD)):
        return value
    if isinstance(value, type) and value in (LocalSGD, LeaderSGD):
        raise TypeError(f"replica_sync={value.__name__} is the class; pass an instance, "
                        f"e.g. replica_sync=hf.{value.__name__}().")
    raise ValueError(f"Unknown replica_sync {value!r}; pass 'allreduce' (the default), "
                     "hf.LocalSGD(every=k) or hf.LeaderSGD(pull=..., local_every=..., "
                     "global_every=...).")
