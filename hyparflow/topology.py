"""Placement of (stage, tensor, replica) triples on ranks; pure Python."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Topology"]


@dataclass(frozen=True)
class Topology:
    """`num_stages` x `num_tensor` x `num_replicas` ranks.

    The T tensor ranks of a stage are consecutive, then a replica's stages:
    rank = (replica * S + stage) * T + tensor. Consecutive ranks usually share
    a node, so the most frequent messages (the tensor ranks' sums, several per
    microbatch) stay on it, then a pipeline's activations; the gradient
    allreduce, once per step, is the one most likely to cross nodes.
    """

    num_stages: int
    num_replicas: int
    num_tensor: int = 1

    def __post_init__(self) -> None:
        if self.num_stages < 1 or self.num_replicas < 1 or self.num_tensor < 1:
            raise ValueError(
                "num_stages, num_replicas and num_tensor must be >= 1. Received: "
                f"num_stages={self.num_stages}, num_replicas={self.num_replicas}, "
                f"num_tensor={self.num_tensor}"
            )

    @property
    def size(self) -> int:
        return self.num_stages * self.num_replicas * self.num_tensor

    def rank(self, stage: int, replica: int, tensor: int = 0) -> int:
        if not (0 <= stage < self.num_stages and 0 <= replica < self.num_replicas
                and 0 <= tensor < self.num_tensor):
            raise ValueError(f"No rank for stage={stage}, replica={replica}, tensor={tensor} "
                             f"in {self}")
        return (replica * self.num_stages + stage) * self.num_tensor + tensor

    def stage(self, rank: int) -> int:
        return (rank // self.num_tensor) % self.num_stages

    def replica(self, rank: int) -> int:
        return rank // (self.num_tensor * self.num_stages)

    def tensor(self, rank: int) -> int:
        return rank % self.num_tensor

    def stage_ranks(self, stage: int, tensor: int = 0) -> list[int]:
        """Ranks that hold `stage`'s part `tensor`, one per replica (they allreduce its gradients)."""
        return [self.rank(stage, r, tensor) for r in range(self.num_replicas)]

    def pipeline_ranks(self, replica: int, tensor: int = 0) -> list[int]:
        return [self.rank(s, replica, tensor) for s in range(self.num_stages)]

    def tensor_ranks(self, stage: int, replica: int) -> list[int]:
        """The ranks that split `stage` of `replica` between them."""
        return [self.rank(stage, replica, t) for t in range(self.num_tensor)]
