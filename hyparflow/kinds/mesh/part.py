"""One rank's part of a layer on the mesh (`MeshPart`): its blocks of the layer's
variables and the kind's call. The interface is the 1D `Shard`'s (replaces, load,
gather, slots, gathered, sliced, call), so the runtime, checkpoints and the optimizer
treat both alike; what differs is how a variable is cut:

- `BLOCK`: a kernel [in, out] cut on both axes, block (i, j) on rank (i, j);
- `COLUMN`: a vector cut on its last axis by j, the same copy on every rank of a
  column (a bias, a LayerNormalization's scale and offset: their gradients are summed
  over the column's ranks, so the copies step alike)."""

from typing import Any, Dict, List, Set, Tuple

import numpy as np

from ..tensor.shard import part_variable
from .grid import mesh_tag, sizes_of

__all__ = ["MeshPart", "BLOCK", "COLUMN"]

BLOCK, COLUMN = "block", "column"
WEIGHTS = 60  # the role of the parts' weight gathers (`grid.mesh_tag`)


class MeshPart:
    def __init__(self, op: Any, split: Any, rank: int, mesh: Any, kind: Any) -> None:
        self.op, self.split, self.coll, self.kind = op, split, mesh, kind
        self.q: int = mesh.q
        self.i, self.j = divmod(rank, self.q)
        self.what = f"layer {op.name!r} on the {self.q}x{self.q} mesh"
        # `how` is (BLOCK or COLUMN, the whole variable's shape): what the gathers of the
        # variable and of its optimizer slots need to know of the other ranks' parts.
        self.cuts: List[Tuple[Any, Any, Tuple[str, Tuple[int, ...]]]] = []
        for var, cut in kind.cuts(op):
            how = (cut, tuple(var.shape))
            self.cuts.append((var, part_variable(var, self.sliced(var.numpy(), how)), how))

    def tag(self, role: int) -> int:
        return mesh_tag(self.split.node, role)

    @property
    def replaces(self) -> Dict[int, Any]:
        return {id(var): part for var, part, _ in self.cuts}

    def sliced(self, value: Any, how: Tuple[str, Tuple[int, ...]]) -> Any:
        """This rank's part of a whole value cut `how`."""
        cols = sizes_of(value.shape[-1], self.q)
        start = sum(cols[:self.j])
        value = value[..., start:start + cols[self.j]]
        if how[0] == BLOCK:
            rows = sizes_of(value.shape[0], self.q)
            value = value[sum(rows[:self.i]):sum(rows[:self.i + 1])]
        return value

    def gathered(self, value: Any, how: Tuple[str, Tuple[int, ...]]) -> Any:
        """The whole of a variable cut `how`, from every rank's part `value`."""
        mesh, q = self.coll, self.q
        cut, whole = how
        widths = sizes_of(whole[-1], q)
        if cut == COLUMN:  # the row's ranks hold every column's copy
            shapes = [value.shape[:-1] + (n,) for n in widths]
            return np.concatenate(mesh.exchange(value, shapes, self.what, self.tag(WEIGHTS),
                                                mesh.row()), axis=-1)
        heights = sizes_of(whole[0], q)
        shapes = [(h,) + value.shape[1:-1] + (w,) for h in heights for w in widths]
        blocks = mesh.exchange(value, shapes, self.what, self.tag(WEIGHTS), mesh.everyone())
        return np.concatenate([np.concatenate(blocks[r * q:(r + 1) * q], axis=-1)
                               for r in range(q)], axis=0)

    def load(self) -> None:
        for var, part, how in self.cuts:
            part.assign(self.sliced(var.numpy(), how))

    def gather(self) -> None:
        for var, part, how in self.cuts:
            var.assign(self.gathered(part.numpy(), how))

    def slots(self, optimizer: Any) -> List[Tuple[Any, Any]]:
        """[(optimizer variable, how)] for the optimizer state of this rank's parts."""
        out: List[Tuple[Any, Any]] = []
        for _, part, how in self.cuts:
            prefix = part.path.replace("/", "_") + "_"
            out += [(slot, how) for slot in optimizer.variables
                    if slot.name.startswith(prefix) and tuple(slot.shape) == tuple(part.shape)]
        return out

    def kept_per_row(self, args: Any, seen: Set[int]) -> float:
        return float(self.kind.kept_per_row(self, args, seen))

    def __call__(self, args: Any, kwargs: Any, training: Any = None) -> Any:
        return self.kind.run(self, args, kwargs, training)
