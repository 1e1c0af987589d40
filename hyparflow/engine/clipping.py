"""`global_clipnorm` over the ranks of a run: one norm, as `model.fit` takes it.

Keras clips inside `optimizer.apply`, after the gradient is summed over the batch
(`base_optimizer.clip_by_global_norm`): the square root of the sum, over every
variable that got a gradient, of `sum(square(g))`, then every gradient times
`clip * min(1 / norm, 1 / clip) + (norm - norm)`. Two details decide exactness:

- An Embedding's gradient there is `tf.IndexedSlices`, whose squares are its values'
  (one pair per lookup, repeated ids not added first), and `slices * scale` is a dense
  tensor: Adam then takes a dense step for the table (every row's moments decay).
- A rank of a pipeline, tensor split or sharded table holds a part of the gradients.

So each rank adds the squares of the gradients it holds that no other rank counts:
its stage's variables (a weight tied over stages on the stage that owns it), on
tensor rank 0 for a weight every tensor rank keeps whole (on mesh row 0 for a part
every row of a column keeps), a split layer's or a table's part on the rank holding
it; on replica 0 only, since replicas hold the same sums after the allreduce, but a
table's part on every replica (its rows are that rank's alone). One allreduce of
R + 1 values gives the sum (slot r: replica r's own, slot R: the tables'); replicas
that step on their own (`replica_sync`) each take their own slot. Each rank then
scales its gradients as Keras does and steps the optimizer with its own clipping off
(`unclipped`). `Clip.needed` says when: with one stage, one tensor rank and no sharded
table the optimizer's own clipping already sees the whole summed gradient."""

import contextlib
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple

import numpy as np

__all__ = ["Clip", "needed", "unclipped", "counted_positions"]


def needed(optimizer: Any, num_stages: int, num_tensor: int, tables: bool) -> bool:
    """Whether hyparflow takes the optimizer's `global_clipnorm` over (some rank
    holds only a part of the gradients)."""
    clip = getattr(optimizer, "global_clipnorm", None)
    return clip is not None and clip > 0 and (num_stages > 1 or num_tensor > 1 or tables)


@contextlib.contextmanager
def unclipped(optimizer: Any) -> Iterator[Any]:
    """The optimizer with its `global_clipnorm` off (read when `apply` is traced, or
    at every eager call): hyparflow scaled the gradients already."""
    kept = optimizer.global_clipnorm
    optimizer.global_clipnorm = None
    try:
        yield optimizer
    finally:
        optimizer.global_clipnorm = kept


def _shared_copy(shard: Any, original: Any) -> Optional[str]:
    """Whether `shard` (a split layer's part on this rank) keeps `original`'s part as
    other tensor ranks do: a 1D kind's variable kept whole, or a mesh part cut by
    columns only (every row of a column holds it). Those count on one rank."""
    for entry in getattr(shard, "cuts", ()):
        if entry[0] is not original:
            continue
        how = entry[2]
        if how is None:
            return "whole"
        if isinstance(how, tuple) and len(how) == 2 and how[0] in ("column", "heads"):
            return "rows"
        return None
    return "whole"


def counted_positions(stage: Any, topo: Any, rank: int, owner_stage: Callable[[Any], int],
                      table_positions: Sequence[int] = ()) -> Tuple[List[bool], List[bool]]:
    """(counted, shared): for each position of `stage.trainable`, whether this rank
    adds its gradient's squares, and whether it goes to the tables' slot (counted on
    every replica)."""
    s, t = topo.stage(rank), topo.tensor(rank)
    tables = set(table_positions)
    owner_of: dict[int, Any] = {}
    for shard in stage.shards.values():
        for vid in getattr(shard, "replaces", {}):
            owner_of[vid] = shard
    counted: List[bool] = []
    shared: List[bool] = []
    for k, (original, var) in enumerate(zip(stage.originals, stage.trainable)):
        if k in tables:
            counted.append(True)
            shared.append(True)
            continue
        shared.append(False)
        if owner_stage(original) != s:
            counted.append(False)  # a weight tied with an earlier stage: counted there
            continue
        shard = owner_of.get(id(original))
        kept = "whole" if var is original or shard is None else _shared_copy(shard, original)
        if kept == "whole":
            counted.append(t == 0)
        elif kept == "rows":
            counted.append(getattr(shard, "i", 0) == 0)
        else:
            counted.append(True)
    return counted, shared


def _squares(g: Any) -> float:
    """Keras's `sum(square(g))` for one gradient: dense, `tf.IndexedSlices`, or
    (indices, values) pairs (the values' squares, one per lookup)."""
    if isinstance(g, tuple):
        values = g[1]
    elif hasattr(g, "values") and hasattr(g, "indices"):
        values = g.values
    else:
        values = g
    a = np.asarray(values, dtype=np.float32)
    return float(np.sum(np.square(a), dtype=np.float32))


class Clip:
    """One rank's part in the run's global norm (see the module's docstring)."""

    def __init__(self, clip_norm: float, comm: Any, counted: Sequence[bool],
                 shared: Sequence[bool], replica: int, num_replicas: int,
                 own: bool = False) -> None:
        """`comm`: every rank of the run (its own communicator); `own`: replicas
        step on their own (each its own norm)."""
        self.clip_norm = float(clip_norm)
        self.comm = comm
        self.counted, self.shared = list(counted), list(shared)
        self.replica, self.num_replicas, self.own = replica, num_replicas, own
        self.norm: Optional[float] = None  # the last step's global norm, for logs

    def scale(self, grads: Sequence[Any]) -> float:
        """The factor every gradient of this step is multiplied by, from this rank's
        `grads` (per position: dense, IndexedSlices, pairs or None). Collective: every
        rank of the run calls it once per step."""
        sums = np.zeros(self.num_replicas + 1, np.float64)
        mine = self.own or self.replica == 0
        for k, g in enumerate(grads):
            if g is None or not self.counted[k]:
                continue
            if self.shared[k]:
                sums[-1] += _squares(g)
            elif mine:
                sums[self.replica] += _squares(g)
        if self.comm is not None and self.comm.size > 1:
            self.comm.allreduce(sums)
        total = sums[-1] + sums[self.replica if self.own else 0]
        norm = np.sqrt(np.float32(total))
        clip = np.float32(self.clip_norm)
        with np.errstate(divide="ignore", invalid="ignore"):
            factor = clip * np.minimum(np.float32(1) / norm, np.float32(1) / clip) + (norm - norm)
        self.norm = float(norm)
        # A float32 value (exact as a Python float), as Keras's factor is.
        return float(np.float32(factor))
