"""One rank's part of a layer on the mesh (`MeshPart`): its blocks of the layer's
variables and the kind's call. The interface is the 1D `Shard`'s (replaces, load,
gather, slots, gathered, sliced, call), so the runtime, checkpoints and the optimizer
treat both alike; what differs is how a variable is cut:

- `BLOCK`: a kernel [in, out] cut on both axes, block (i, j) on rank (i, j);
- `COLUMN`: a vector cut on its last axis by j, the same copy on every rank of a
  column (a bias, a LayerNormalization's scale and offset: their gradients are summed
  over the column's ranks, so the copies step alike);
- `HEADS_BLOCK`, `HEADS`: as `BLOCK` and `COLUMN` but on the heads axis, the one
  before the last (an attention projection's kernel [in, heads, size] and bias
  [heads, size]: a rank's columns are whole heads)."""

import inspect
from typing import Any, Dict, List, Set, Tuple

import numpy as np

from ... import _compat
from ..tensor.shard import part_variable
from .grid import mesh_tag, sizes_of

__all__ = ["MeshPart", "BLOCK", "COLUMN", "HEADS_BLOCK", "HEADS"]

BLOCK, COLUMN, HEADS_BLOCK, HEADS = "block", "column", "heads-block", "heads"
# (axis cut by the mesh row i, or None: every row holds it; axis cut by the column j)
_AXES = {BLOCK: (0, -1), COLUMN: (None, -1), HEADS_BLOCK: (0, -2), HEADS: (None, -2)}
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
        rows, cols = _AXES[how[0]]
        value = _take(value, cols, sizes_of(value.shape[cols], self.q), self.j)
        if rows is not None:
            value = _take(value, rows, sizes_of(value.shape[rows], self.q), self.i)
        return value

    def gathered(self, value: Any, how: Tuple[str, Tuple[int, ...]]) -> Any:
        """The whole of a variable cut `how`, from every rank's part `value`."""
        mesh, q = self.coll, self.q
        cut, whole = how
        rows, cols = _AXES[cut]
        widths = sizes_of(whole[cols], q)
        if rows is None:  # the row's ranks hold every column's copy
            shapes = [_with(value.shape, {cols: n}) for n in widths]
            return np.concatenate(mesh.exchange(value, shapes, self.what, self.tag(WEIGHTS),
                                                mesh.row()), axis=cols)
        heights = sizes_of(whole[rows], q)
        shapes = [_with(value.shape, {rows: h, cols: w}) for h in heights for w in widths]
        blocks = mesh.exchange(value, shapes, self.what, self.tag(WEIGHTS), mesh.everyone())
        return np.concatenate([np.concatenate(blocks[r * q:(r + 1) * q], axis=cols)
                               for r in range(q)], axis=rows)

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
        return _masked(self.op, args, kwargs, self.kind.run(self, args, kwargs, training))


def _masked(op: Any, args: Any, kwargs: Any, out: Any) -> Any:
    """`out` with the Keras mask `Layer.__call__` gives the layer's output (its
    `compute_mask` of the first argument and that argument's mask, or the `mask=` given),
    whole as the inputs' masks are (`grid`): what the layers after it, the loss and the
    next stage read, as in model.fit."""
    if not getattr(op, "supports_masking", False):
        return out
    if args:
        first = args[0]
    else:
        name = next(iter(inspect.signature(op.call).parameters))
        first = kwargs[name]
    previous = kwargs.get("mask")
    if previous is None:
        previous = _compat.tree.map_structure(_compat.get_mask, first)
    masks = op.compute_mask(first, previous)
    if masks is None:
        return out
    for value, mask in zip(_compat.tree.flatten(out), _compat.tree.flatten(masks)):
        if mask is not None and _compat.get_mask(value) is None:
            _compat.set_mask(value, mask)
    return out


def _take(value: Any, axis: int, sizes: List[int], k: int) -> Any:
    """Block `k` of `value` on `axis`, cut in `sizes`."""
    index = [slice(None)] * len(value.shape)
    index[axis] = slice(sum(sizes[:k]), sum(sizes[:k + 1]))
    return value[tuple(index)]


def _with(shape: Tuple[int, ...], sizes: Dict[int, int]) -> Tuple[int, ...]:
    """`shape` with the axes in `sizes` (negative ones counted from the end) replaced."""
    out = list(shape)
    for axis, n in sizes.items():
        out[axis] = n
    return tuple(out)
