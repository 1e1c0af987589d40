"""The quick cost model of a node's ranks x threads, pure and typed: what `hf.fit` weighs
at its start, in milliseconds, to warn of a layout whose one-thread ranks share a node
(`engine/node.py` measures the two rates it needs; `loop/trainer.py` warns).

The planner (`planning/`) measures a model's layers and the node's network and plays
every schedule; the training path never loads it. This model is what can be known
without it: the model's multiply-adds and parameter bytes (`graph.py`), one thread's
matrix-product rate and memory-copy rate, both measured in the rank. A step is

- compute: 3 x multiply-adds per sample x batch (forward, and a backward of twice
  it), shared by every rank and thread at the matrix-product rate; a pipeline idles
  (S - 1) / (M + S - 1) of it (GPipe's and 1F1B's bubble);
- the replicas' gradient sum: a ring, 2 (R - 1) / R x a rank's parameter bytes, each
  passing memory `SUM_PASSES` times (the node's ranks sum through shared memory: a
  message is copied in and out, then added, reading two and writing one);
- the optimizer step: every replica steps its stage's parameters, `passes` passes
  over their bytes (Adam: reads the variable, its gradient and two moments, writes
  three: 7) at the memory rate times the rank's threads.

It assumes compute scales with threads, which small layers do not quite do: it only
sees what one-thread ranks pay in gradient sums and in every replica repeating the
optimizer step, and so never calls a layout slow for what threads would lose.
"""

from __future__ import annotations

from typing import List, NamedTuple, Optional

__all__ = ["Rates", "Shape", "shapes", "step_seconds", "best", "SLOW", "SUM_PASSES"]

SLOW = 0.8   # a layout predicted under this fraction of the best one's speed is named
SUM_PASSES = 5   # memory passes per byte of a ring step through shared memory (above)


class Rates(NamedTuple):
    """One thread's multiply-adds per second (a matrix product) and bytes copied per
    second, measured in the rank (`engine.node.rates`)."""
    madds_per_s: float
    bytes_per_s: float


class Shape(NamedTuple):
    """A layout on `nodes` nodes: `ranks` per node x `threads` each, S x T x R, M."""
    ranks: int
    threads: int
    stages: int = 1
    tensor: int = 1
    replicas: int = 1
    microbatches: int = 1
    nodes: int = 1

    def describe(self) -> str:
        return (f"{self.ranks} rank{'s' if self.ranks != 1 else ''} on the node x "
                f"{self.threads} thread{'s' if self.threads != 1 else ''} (S={self.stages} "
                f"T={self.tensor} R={self.replicas} M={self.microbatches})")


def shapes(cores: int) -> List[int]:
    """The ranks on a node of `cores` cores that a planner tries, each rank with
    cores // ranks threads: every power of two from 2 that divides the cores, and one
    per core (one rank with all cores is the baseline every choice is held to)."""
    found = [n for n in (2 ** k for k in range(1, cores.bit_length())) if cores % n == 0]
    return sorted(set(found + [cores])) if cores > 1 else []


def step_seconds(shape: Shape, madds_per_sample: float, param_bytes: float, batch: int,
                 rates: Rates, passes: int = 7) -> float:
    """The quick model's seconds per step of `batch` samples (the module's terms)."""
    workers = shape.ranks * shape.nodes * shape.threads
    compute = 3.0 * madds_per_sample * batch / (rates.madds_per_s * workers)
    s, m, r = shape.stages, shape.microbatches, shape.replicas
    compute *= (m + s - 1) / m
    mine = param_bytes / (s * shape.tensor)   # a rank's parameters
    sums = 2.0 * (r - 1) / r * mine * SUM_PASSES / rates.bytes_per_s
    optimizer = passes * mine / (rates.bytes_per_s * shape.threads)
    return compute + sums + optimizer


def best(cores: int, nodes: int, madds_per_sample: float, param_bytes: float, batch: int,
         rates: Rates, passes: int = 7) -> tuple[Shape, float]:
    """The node shape predicted fastest for data parallelism over `nodes` nodes of
    `cores` cores (n ranks per node x cores // n threads, n = 1 or `shapes`), and its
    seconds per step."""
    found: Optional[tuple[Shape, float]] = None
    for n in [1] + shapes(cores):
        shape = Shape(n, cores // n, replicas=n * nodes, nodes=nodes)
        seconds = step_seconds(shape, madds_per_sample, param_bytes, batch, rates, passes)
        if found is None or seconds < found[1]:
            found = (shape, seconds)
    assert found is not None
    return found
