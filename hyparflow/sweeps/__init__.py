"""Hyper-parameter sweeps as one job: N configs of one model fused layer by layer into
one array model that trains all N at once (horizontally fused training arrays, HFTA:
Wang et al., MLSys 2021). `hyparflow.sweep` is the entry point; see docs/sweeps.md.

Modules: `run` (the public call and its epochs), `fuse` (the graphs checked, the fused
array), `kinds` (fused layer kinds), `variables` (stacked weights), `optimizers` (fused
optimizers), `steps` (compiled steps), `members` (configs, logs, callbacks, results),
`table` (rank 0's progress table).
"""

from .members import job_configs, read_configs
from .run import SweepResult, sweep

__all__ = ["sweep", "SweepResult", "job_configs", "read_configs"]
