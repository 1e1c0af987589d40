"""The global batch's normalisers, for losses that divide by a count over the whole batch.

Keras divides a masked `sum_over_batch_size` loss by the number of unmasked
entries of the *whole* batch (and a `mean_with_sample_weight` loss by the sum of
the whole batch's weights). A microbatch cannot know that count when it runs, so
the last stage returns, per microbatch and per such loss ("GLOBAL" in
`_compat.loss_kinds`), the weighted sum of its values and its part of the count.
After the step's last forward, the counts of every microbatch are summed and
allreduced over the last stage's replicas (one small allreduce of one number per
loss), and each microbatch's backward is seeded with weight / global count: the
gradients, summed over microbatches and replicas, are those of the batch's loss.

What it costs: the backward of the first microbatch must wait until every
microbatch of every replica has run its forward, so a step whose loss needs it
runs GPipe's order (all forwards, then all backwards: M microbatches'
activations alive on every stage, as `schedule="gpipe"`), the last stage keeps
each forward's tape instead of fusing it with its backward, and the last stage's
replicas meet once per step in the allreduce.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence

import numpy as np
import numpy.typing as npt

from .comm import Communicator, Request

Vector = npt.NDArray[np.float64]

__all__ = ["Normaliser"]


class Normaliser:
    """One rank's sums and counts of the GLOBAL losses over a step's microbatches.

    `weights`: each GLOBAL loss's weight in the total (compile's `loss_weights`);
    `comm`: the last stage's replicas at this tensor rank (None: one replica, or
    a rank not on the last stage, which only needs to know the step's order)."""

    def __init__(self, weights: Sequence[float], comm: Optional[Communicator] = None) -> None:
        self.weights: Vector = np.asarray(weights, np.float64)
        self.comm = comm
        self.reset()

    def reset(self) -> None:
        k = len(self.weights)
        self.sums: Vector = np.zeros(k)
        self.counts: Vector = np.zeros(k)
        self.share = 0.0
        self.totals: Optional[Vector] = None

    @property
    def agreed(self) -> bool:
        return self.totals is not None

    def add(self, terms: npt.NDArray[Any], share: float) -> None:
        """One microbatch's [sums..., counts...] (`Stage.terms`), `share` of the batch."""
        k = len(self.weights)
        self.sums += terms[:k]
        self.counts += terms[k:]
        self.share += share

    def agree(self, wait: Callable[[List[Request]], object]) -> None:
        """The global counts: this rank's summed with its replicas' (a collective
        over `comm`, waited for with `wait(requests)`)."""
        totals = self.counts.copy()
        if self.comm is not None and self.comm.size > 1:
            wait([self.comm.iallreduce(totals)])
        self.totals = totals

    def scales(self) -> Vector:
        """What each microbatch's sum is multiplied by: weight / global count (0 where
        the batch has nothing to count, as Keras's `divide_no_nan`); after `agree`."""
        assert self.totals is not None, "Normaliser.scales before agree"
        out = np.zeros(len(self.weights))
        np.divide(self.weights, self.totals, out=out, where=self.totals != 0)
        return out

    def contribution(self) -> float:
        """This rank's part of the step's loss from the GLOBAL losses."""
        return float(np.sum(self.sums * self.scales()))
