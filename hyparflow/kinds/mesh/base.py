"""What the mesh kinds share: `MeshKind` (a `SplitKind` whose parts are `MeshPart`s
and whose call takes and gives blocks), the roles of the collectives every kind has
(entering the mesh, leaving it), and which activations work on blocks."""

from typing import Any, List, Set, Tuple

import numpy as np
import tensorflow as tf

from ..tensor.split import SplitKind
from .grid import is_block

__all__ = ["MeshKind", "ENTER", "GATHER", "elementwise", "ELEMENTWISE"]

# Roles (`grid.mesh_tag`): ENTER + k for the k-th whole input made a block, GATHER for
# the output made whole again; each kind numbers its own from 8 on.
ENTER, GATHER = 0, 7

# Activations that act on each entry alone, so a block of features can take them.
# (softmax, log_softmax and glu read a whole row: a Dense with them stays whole.)
ELEMENTWISE = frozenset({
    "linear", "relu", "relu6", "leaky_relu", "elu", "selu", "celu", "gelu", "silu", "swish",
    "tanh", "sigmoid", "hard_sigmoid", "hard_silu", "hard_swish", "softplus", "softsign",
    "exponential", "mish", "log_sigmoid"})


def elementwise(activation: Any) -> bool:
    return activation is None or getattr(activation, "__name__", None) in ELEMENTWISE


class MeshKind(SplitKind):
    """A kind of layer on the q x q mesh. Besides `SplitKind`'s `claims`, `why_not` and
    `cuts(op)` ([(variable, BLOCK or COLUMN)]), a mesh kind has `run(part, args, kwargs,
    training)`: the layer's call on this rank's blocks (a whole input made a block
    first, the output made whole when `part.split.gather`)."""

    # A rank holds 1/q**share of the layer's weights: a kernel's block (2), or a vector
    # cut over the columns and alike down a column (1: a norm's scale and offset).
    share = 2

    def cuts(self, op: Any) -> List[Tuple[Any, str]]:
        return []

    def products(self, in_bytes: float, weight_bytes: float) -> List[Tuple[float, float]]:
        """The SUMMA products the layer makes per microbatch, for the planner
        (`planning.planner.mesh_costs`): [(its whole input's bytes, its kernel's)]."""
        return []

    def sums(self, rows: float, out_bytes: float, q: int) -> Tuple[List[float], List[float]]:
        """Bytes a rank exchanges in its row or column group per microbatch besides
        SUMMA, one entry per exchange, (forward, backward), for the planner. `rows`:
        the microbatch's rows (tokens for a sequence), `out_bytes`: the whole output."""
        return [], []

    def run(self, part: Any, args: Any, kwargs: Any, training: Any) -> Any:
        raise NotImplementedError

    def kept_per_row(self, part: Any, args: Any, seen: Set[int]) -> float:
        """Bytes per sample of the values this rank's call keeps for the backward (its
        inputs, each once (`seen`), as blocks: a block holds 1/q of the rows and 1/q of
        the features)."""
        q, total = int(part.q), 0.0
        for x in tf.nest.flatten(args):
            if (not tf.is_tensor(x) or not x.dtype.is_floating or x.shape.rank is None
                    or id(x) in seen):
                continue
            seen.add(id(x))
            entries = float(np.prod([d or 1 for d in x.shape.as_list()[1:]]))
            total += entries * x.dtype.size / (q if is_block(x) else q * q)
        return total
