"""Tensor (intra-layer) parallelism: a stage's widest layers split over T ranks.

Each of the T ranks of a stage runs the whole stage, but holds only its share
of the split layers' weights (and of their gradients and optimizer state):

- Dense, alone: a column split (each rank computes some output units); the
  outputs are gathered, so the next layer sees the whole tensor.
- Dense followed by Dense (the first's output used by the second only): the
  first is split by columns, the second by rows (each rank multiplies its own
  slice of the hidden units and the partial sums are added), so one sum serves
  both layers, as Megatron-LM pairs them.
- Conv2D: a filter (output channel) split, gathered on the channel axis.
- Embedding: a row split (each rank owns a range of ids); the lookups are summed.
- MultiHeadAttention: a split by heads (Megatron-LM's layout): each rank holds
  its heads' slices of the query/key/value projections and of the output
  projection, computes their attention as Keras does, and the partial outputs
  are summed (one sum forward; one sum of the input gradient backward). A layer
  that holds attention layers inside (Keras Hub's TransformerEncoder) gets them
  split the same way while it runs, and its feed-forward Dense pair paired.

Shares may be uneven (a rank twice as fast takes twice the columns/filters/rows).
Around a split layer the values are replicated, so every other layer, the loss
and the gradients of unsplit weights are computed identically by all T ranks.
The collectives run inside the compiled stage function (as `py_function`s with
their own gradients) and always sum in rank order, so every rank gets the same
bits.

By part: `split` (Split, SplitKind, shares and sizes), one file per kind (`dense`:
Column and Row, `conv`: Filters, `embedding`: Rows, `attention`: Heads and Inner),
`registry` (the kinds in order; choose, why_not, shard, exchange), `shard` (a rank's
part), `collectives` (sums and gathers with gradients). Re-exported here.
"""

from .collectives import Collectives
from .registry import BY_NAME, KINDS, choose, describe, exchange, kind_of, shard, why_not
from .shard import Shard
from .split import MIN_PARAMS, Split, SplitKind, shares_of, split_sizes

__all__ = ["MIN_PARAMS", "Split", "SplitKind", "KINDS", "BY_NAME", "choose", "why_not",
           "describe", "kind_of", "exchange", "split_sizes", "shares_of", "shard", "Shard",
           "Collectives"]
