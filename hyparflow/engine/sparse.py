"""Sparse gradients: an Embedding's `tf.IndexedSlices`, kept as (row, value) pairs.

Keras hands the optimizer an Embedding's gradient as `tf.IndexedSlices`: one
(row, value) pair per looked-up id, duplicates included, in the order of the
batch. The optimizers apply it pair by pair (Adam squares each pair's value
for its second moment, then scatter-adds), so neither the summed (dense)
gradient nor pairs merged by row give the same weights: the only way to end
where `model.fit` ends is to hand the optimizer the same pairs in the same
order. So a stage keeps each microbatch's pairs, and the replicas of a stage
gather them (`Exchange`) in rank order, which is the global batch's order:
replica r holds the r-th contiguous slice of every batch, its microbatches are
contiguous slices of that, and the pairs of a microbatch come in its order.
The bytes exchanged are those of the rows the batch touched, not the table's.

A lookup whose ids do not depend on the batch (a position table looked up with
`arange(sequence)` for every sample, broadcast over the batch) is different:
TensorFlow sums the batch's gradient before the lookup's, so `model.fit`'s
IndexedSlices holds one pair per looked-up id with the *whole batch's* sum, and
Adam squares that sum. Gathering each microbatch's pairs would square partial
sums instead. So for such "fixed" lookups (found in the stage's traced forward:
the ids of its gather have a static shape, `fixed_lookups`) the pairs of a
step's microbatches, and then of the replicas, are merged: the same ids, their
values added in order (`merge`), which is the pair list `model.fit` hands on.

The rule for reducing densely instead: only for an optimizer whose step is
linear in the gradient (plain `keras.optimizers.SGD`, with or without
momentum, where pairs and their sum step alike), and only when the dense
table is smaller than the pairs every rank would receive. A variable whose
gradient is dense on any rank of its group (an embedding tied to an output
projection on another stage) is reduced densely: `model.fit` also gets a
dense gradient for it, since TensorFlow adds a lookup's slices to a dense
gradient as a dense sum.
"""


import numpy as np
from .. import settings

__all__ = ["Exchange", "linear", "merge", "merge_pairs", "fixed_lookups", "enabled"]

SPARSE, DENSE, NONE = "s", "d", "-"


def enabled():
    """HYPARFLOW_SPARSE=0 reduces every gradient densely, as hyparflow did before it
    kept pairs: only to measure what pairs save (Adam, RMSprop and the like then
    step differently from `model.fit`)."""
    return settings.sparse()


def linear(optimizer):
    """Whether `optimizer` steps a sum of gradients as it steps its parts."""
    import keras

    return type(optimizer) is keras.optimizers.SGD


def merge(kinds):
    """The group's kind for one variable from every member's: dense if any is dense,
    sparse if any is sparse, else none (no gradient anywhere yet)."""
    if DENSE in kinds:
        return DENSE
    return SPARSE if SPARSE in kinds else NONE


def merge_pairs(pieces):
    """The (indices, values) of several microbatches or ranks of a fixed lookup as one
    lookup over all of them: the same ids, the values added in order."""
    indices, values = pieces[0]
    if len(pieces) == 1:
        return indices, values
    total = np.array(values, np.float32, copy=True)
    for other, more in pieces[1:]:
        if not np.array_equal(other, indices):
            raise ValueError(
                "A lookup whose ids have a fixed shape (not one per sample) looked up "
                "different ids in different microbatches, so its gradient over the batch "
                "cannot be put together from theirs as model.fit's one lookup gives it. "
                "Look the table up with ids that have the batch dimension, or train with "
                "num_microbatches=1 and num_replicas=1.")
        total += more
    return indices, total


def fixed_lookups(graph, handles):
    """{position: True} for the variables (`handles`: resource handle id -> position)
    that a traced function's graph looks up only with ids of a static shape (no batch
    dimension); a variable also looked up per sample is not fixed."""
    captured = {internal.ref(): external for external, internal in graph.captures}
    fixed = {}
    for op in graph.get_operations():
        if "Gather" not in op.type:
            continue
        source = op.inputs[0]
        while source.op.type in ("ReadVariableOp", "Identity", "IdentityN") and source.op.inputs:
            source = source.op.inputs[0]
        external = captured.get(source.ref())
        k = handles.get(id(external)) if external is not None else None
        if k is None:
            continue
        static = op.inputs[1].shape.is_fully_defined()
        fixed[k] = fixed.get(k, True) and static
    return {k for k, f in fixed.items() if f}


class Exchange:
    """Gathers the pairs of a group's sparse variables from every member (a request:
    `test()` advances it; `result()` once done).

    `local`: {position: (indices, values)} of this rank (missing: no pairs);
    `shapes`: {position: the variable's shape}, for every position the group
    treats as sparse. First every member's pair counts are gathered, then (in
    one call each) the indices and the values, or, where `dense_ok` and the
    table is smaller, each variable is scattered into a dense sum instead."""

    def __init__(self, comm, local, shapes, dense_ok=False, fixed=()):
        """`fixed`: positions of fixed lookups, whose ranks' pairs are merged."""
        self.comm, self.shapes, self.dense_ok = comm, shapes, dense_ok
        self.fixed = set(fixed)
        self.positions = sorted(shapes)
        self.local = {k: local.get(k) for k in self.positions}
        self.rows = {k: int(np.prod(shapes[k][1:])) for k in self.positions}
        counts = np.array([0 if self.local[k] is None else len(self.local[k][0])
                           for k in self.positions], np.int64)
        self.counts = np.zeros(comm.size * len(self.positions), np.int64)
        self._reqs = [comm.iallgatherv(counts, self.counts, [len(counts)] * comm.size)]
        self._phase = 0
        self._result = None
        self.bytes = 0  # what this rank received, for the benchmark

    def test(self):
        if self._phase == 2:
            return True
        if not all(r.test() for r in self._reqs):
            return False
        if self._phase == 0:
            self._start_pairs()
            self._phase = 1
            return self.test()
        self._finish()
        self._phase = 2
        return True

    def _start_pairs(self):
        n = self.comm.size
        counts = self.counts.reshape(n, len(self.positions))
        self.per_rank = counts
        totals = counts.sum(axis=0)
        # Dense where allowed and smaller: the table against the pairs received.
        self.dense = [k for j, k in enumerate(self.positions) if self.dense_ok and
                      int(np.prod(self.shapes[k])) < int(totals[j]) * (self.rows[k] + 1)]
        reqs = []
        self.sums = {}
        for k in self.dense:
            table = np.zeros(self.shapes[k], np.float32)
            if self.local[k] is not None:
                indices, values = self.local[k]
                np.add.at(table, indices, values)
            self.sums[k] = table
            reqs.append(self.comm.iallreduce(table.reshape(-1)))
        sparse = [j for j, k in enumerate(self.positions) if k not in self.dense]
        send_i = [self.local[self.positions[j]][0] for j in sparse
                  if self.local[self.positions[j]] is not None]
        send_v = [self.local[self.positions[j]][1].reshape(-1) for j in sparse
                  if self.local[self.positions[j]] is not None]
        self.sparse = [self.positions[j] for j in sparse]
        index_counts = [int(counts[p, sparse].sum()) for p in range(n)]
        value_counts = [int(sum(counts[p, j] * self.rows[self.positions[j]] for j in sparse))
                        for p in range(n)]
        self.indices = np.empty(sum(index_counts), np.int64)
        self.values = np.empty(sum(value_counts), np.float32)
        mine_i = np.concatenate(send_i).astype(np.int64) if send_i else np.zeros(0, np.int64)
        mine_v = np.concatenate(send_v).astype(np.float32) if send_v else np.zeros(0, np.float32)
        if self.sparse:
            reqs.append(self.comm.iallgatherv(mine_i, self.indices, index_counts))
            reqs.append(self.comm.iallgatherv(mine_v, self.values, value_counts))
        self.bytes = 8 * len(self.indices) + 4 * len(self.values) + sum(
            t.nbytes for t in self.sums.values())
        self._sparse_columns = sparse
        self._reqs = reqs

    def _finish(self):
        """Cut the gathered arrays back into each variable's pairs, rank by rank."""
        counts, n = self.per_rank, self.comm.size
        pieces = {k: ([], []) for k in self.sparse}
        i = v = 0
        for p in range(n):
            for j in self._sparse_columns:
                k, c = self.positions[j], int(counts[p, j])
                width = self.rows[k]
                pieces[k][0].append(self.indices[i:i + c])
                pieces[k][1].append(self.values[v:v + c * width].reshape(
                    (c,) + tuple(self.shapes[k][1:])))
                i += c
                v += c * width
        self._result = {}
        for k, (ix, vs) in pieces.items():
            held = [(i, v) for i, v in zip(ix, vs) if len(i)]
            self._result[k] = merge_pairs(held) if k in self.fixed and held else (
                np.concatenate(ix), np.concatenate(vs))
        self._result.update(self.sums)

    def result(self):
        """{position: (indices, values) in rank order, or a dense sum (an array)}."""
        return self._result
