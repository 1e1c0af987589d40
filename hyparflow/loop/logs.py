"""Global loss and metrics: metric state summed exactly over every rank."""

from __future__ import annotations

from typing import Any, Dict

import numpy as np

from .. import _compat
from ..engine import weights
from ..engine.comm import Communicator, timeout_seconds

__all__ = ["GlobalLogs"]


class GlobalLogs:
    """The compiled metrics' state variables (totals, counts, confusion matrices)
    are summed over all ranks (only the last stage updates them; other ranks add
    zeros), so every rank computes the `result()` one process would: never a
    mean of per-rank means. `loss` is the sample-weighted mean of the steps'
    global losses, as Keras's loss tracker computes it. (The model and its metrics are
    Keras's: Any.)"""

    def __init__(self, model: Any, comm: Communicator, counted: bool = True) -> None:
        # `counted`: False on all but one of the ranks computing the same loss and
        # metrics (the tensor ranks of the last stage), which add zeros.
        self.model, self.comm, self.counted = model, comm, counted
        tracker = _compat.loss_tracker(model)
        self.metrics = [m for m in model.metrics if m is not tracker]
        self.variables = [v for m in self.metrics for v in m.variables]
        self.reset()

    def reset(self) -> None:
        for m in self.metrics:
            m.reset_state()
        self.loss_sum, self.count = 0.0, 0

    def add(self, contribution: float, batch_size: int) -> None:
        """A step's loss contribution from this rank, for a global batch of `batch_size`."""
        self.loss_sum += contribution * batch_size
        self.count += batch_size

    def result(self) -> Dict[str, float]:
        """The global logs dict, identical on every rank (a collective call)."""
        local = [np.asarray(v.numpy(), np.float64) for v in self.variables]
        flat = weights.pack(local + [np.array([self.loss_sum])], np.float64)
        if not self.counted:
            flat[:] = 0
        self.comm.allreduce(flat, timeout_seconds())
        for v, s in zip(self.variables, weights.unpack(flat, self.variables)):
            v.assign(s.astype(v.dtype))
        logs = {"loss": float(flat[-1] / max(1, self.count))}
        for m in self.metrics:
            r = m.result()
            if isinstance(r, dict):
                logs.update({k: float(np.asarray(val)) for k, val in r.items()})
            else:
                logs[m.name] = float(np.asarray(r))
        for v, a in zip(self.variables, local):
            v.assign(a.astype(v.dtype))
        return logs
