"""Placement of (stage, replica) pairs on ranks; pure Python."""

from dataclasses import dataclass

__all__ = ["Topology"]


@dataclass(frozen=True)
class Topology:
    """`num_stages` x `num_replicas` ranks; a replica's stages are consecutive ranks.

    Consecutive ranks usually share a node, so a pipeline's activations cross
    shared memory while the (less frequent) gradient allreduce crosses nodes.
    """

    num_stages: int
    num_replicas: int

    def __post_init__(self):
        if self.num_stages < 1 or self.num_replicas < 1:
            raise ValueError(
                "num_stages and num_replicas must be >= 1. "
                f"Received: num_stages={self.num_stages}, num_replicas={self.num_replicas}"
            )

    @property
    def size(self):
        return self.num_stages * self.num_replicas

    def rank(self, stage, replica):
        if not (0 <= stage < self.num_stages and 0 <= replica < self.num_replicas):
            raise ValueError(f"No rank for stage={stage}, replica={replica} in {self}")
        return replica * self.num_stages + stage

    def stage(self, rank):
        return rank % self.num_stages

    def replica(self, rank):
        return rank // self.num_stages

    def stage_ranks(self, stage):
        """Ranks that hold `stage`, one per replica (they allreduce its gradients)."""
        return [self.rank(stage, r) for r in range(self.num_replicas)]

    def pipeline_ranks(self, replica):
        return [self.rank(s, replica) for s in range(self.num_stages)]
