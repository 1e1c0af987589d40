"""How ZeRO's sums reach the owners of the rows (`Reduce`): messages to each owner,
or, on one node with a shared window (`engine.shm`), every rank's bucket written once
and each owner adding its rows over every copy."""

import numpy as np

from ... import settings

__all__ = ["SETTLE_TAG", "Reduce", "even", "row_width", "rows_of", "tag", "window"]


SETTLE_TAG = 999  # below every variable's tags


def tag(index, phase):
    """The tag of variable number `index` of its group in `phase` (0: reduce, 1: gather):
    one message per variable, pair of ranks and phase in a step, so no two messages
    that may be in flight at once share a tag (thread ranks match receives when they
    are tested, not when posted). Below the tags of the ring allreduce (comm.py)."""
    return 1000 + (2 * index) % 27000 + phase


def rows_of(x, a, b):
    """Rows [a, b) of `x` (a 0-d value is its own single row)."""
    return x if np.ndim(x) == 0 else x[a:b]


def row_width(x):
    """Elements per row of `x` (its first axis; 1 for a 0-d value or no rows), so
    that rows [a, b) of the flat `x` are elements [a * width, b * width)."""
    return x.size // x.shape[0] if x.ndim and x.shape[0] else 1


def window(comm, buf):
    """The node's shared window ZeRO's sums of `buf` go through, or None: messages.
    Only where HYPARFLOW_SHARED_SUMS=1 asks, and on one node. Measured (MLP 8 x 1024,
    batch 256, R=4 on 2 cores, docs/performance.md), the owners' messages were
    faster: MPICH moves megabytes between ranks of a node in one copy, where the
    window copies each bucket in first."""
    if settings.shared_sums() is not True:
        return None
    shared = comm.window(buf)
    return shared if shared is not None and shared.cross is None else None


def even(spans, n):
    """The (first, end) `spans` cut into `n` runs of about equal length, in order:
    [(first, end, rank)]."""
    total = sum(b - a for a, b in spans)
    cuts = [total * r // n for r in range(n + 1)]
    out, at, r = [], 0, 0
    for a, b in spans:
        while a < b:
            while at >= cuts[r + 1]:
                r += 1
            take = min(b - a, cuts[r + 1] - at)
            out.append((a, a + take, r))
            a, at = a + take, at + take
    return out


class Reduce:
    """The reduce-to-owner of one bucket (a request: `test()` advances it). On one
    node with a shared window (`engine.shm`) every rank writes the bucket once and
    each owner adds its rows over every rank's copy; else messages to the owners."""

    def __init__(self, zero, comm, bucket, flat):
        self.done = False
        self.sums = []  # (own rows, {rank: received rows})
        n = len(bucket)
        self.reqs = [comm.iallreduce(flat[len(flat) - n:])]  # one flag per variable
        shared = window(comm, flat)
        if shared is not None:
            self.reqs.append(shared.ireduce(flat, zero.ranges(comm, bucket, flat)))
            return
        for k in bucket:
            view = zero.stage.grads.view(k)
            if k not in zero.parts:  # stepped whole (a tensor-split part): summed whole
                self.reqs.append(comm.iallreduce(view.reshape(-1)))
                continue
            for r, a, b in zero.parts[k]:
                rows = rows_of(view, a, b)
                if r == comm.rank:
                    got = {p: zero.buffer(("reduce", k, a, b, p), rows.shape)
                           for p in range(comm.size) if p != r}
                    self.reqs += [comm.irecv(buf, p, tag(zero.index[k], 0))
                                  for p, buf in got.items()]
                    got[r] = rows
                    self.sums.append((rows, got))
                else:
                    self.reqs.append(comm.isend(rows, r, tag(zero.index[k], 0)))

    def test(self):
        if self.done:
            return True
        self.reqs = [q for q in self.reqs if not q.test()]
        if self.reqs:
            return False
        for rows, got in self.sums:
            for p in sorted(got):  # the others' rows added to this rank's, in rank order
                if got[p] is not rows:
                    rows += got[p]
        self.done = True
        return True
