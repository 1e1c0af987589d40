"""Pipeline schedules as plain data: builders, lowering, validation, simulation.

A schedule is, for each stage, an ordered list of `Action`s. Builders
(`gpipe`, `one_f_one_b`, `zb_h1`, `zb_batched`) give compute-only lists;
`fuse` turns a forward followed at once by its backward on a stage that sends
nothing into one `FB` action (one compiled call; the executor and the planner
both read it); `lower` inserts the communication for a given stage graph and
closes the step with `ALLREDUCE` and `STEP`; `validate` and `simulate` check
the result without MPI or TensorFlow. Short string forms ("F0 F1 B0 B1") keep
tests readable.

Split backward (the zero-bubble schedules of Qi et al., ICLR 2024): `B` then
computes only what the stage's inputs need (sent upstream at once) and keeps,
for the layers whose weight gradients can wait, their inputs and output
gradients; `W` computes those weight gradients later, for one microbatch
(`W3`) or for several at once over their concatenated rows (`W0-3`: 0 to 3),
where the products run at the size the kernels are fast at.

The package, by part: `actions` (the words), `builders`, `table` (one record per
schedule: builder, chunked, split, fills idle slots, tried by `auto`), `lower` (fuse,
lower, validate) and `simulate`. Everything is re-exported here.
"""

from .actions import (ALLREDUCE, B, F, FB, RECV_ACT, RECV_GRAD, SEND_ACT, SEND_GRAD, STEP, W,
                      Action, chunks_of, format_actions, parse, splits)
from .builders import (check_interleaved, forward_only, gpipe, interleaved, one_f_one_b,
                       one_f_one_b_w, zb_batched, zb_h1)
from .lower import fuse, lower, validate
from .simulate import Simulation, simulate
from .table import (AUTO, CHUNKED, FILLS, PLANNED, SCHEDULES, SPLIT, TABLE, Schedule, build,
                    effective, program)

__all__ = [
    "Action", "F", "B", "W", "FB", "SEND_ACT", "RECV_ACT", "SEND_GRAD", "RECV_GRAD",
    "ALLREDUCE", "STEP", "gpipe", "one_f_one_b", "one_f_one_b_w", "zb_h1", "zb_batched",
    "forward_only", "build", "fuse", "lower", "validate", "simulate", "Simulation", "parse",
    "format_actions", "SCHEDULES", "SPLIT", "FILLS", "splits", "interleaved",
    "check_interleaved", "chunks_of", "CHUNKED", "AUTO", "PLANNED", "TABLE", "Schedule",
    "effective", "program",
]
