"""What crosses a stage boundary, and how: each edge's tensor, its Keras mask, and,
for shapes known only at run time, a header.

A tensor whose non-batch shape is known (the usual case) moves as it always
has: its receive buffer is sized from the microbatch and posted for the whole
step before the first action. A tensor with a dimension known only at run time
(a sequence length from `Input(shape=(None,))`, an image size) is preceded by a
small header of int64 shapes on a tag of its own; the receiver posts the
header's receive up front and sizes the value's buffer from it when it
arrives. The sender never waits for the receiver, so this costs no round trip,
and each buffer is sized for its message and dropped after it, so memory does
not grow with the number of distinct lengths. The gradient that comes back
has the shape of what was sent, so its receive is posted as the value leaves.

Keras masks (an Embedding's `mask_zero`, padding) travel beside their tensors,
forward only: the receiving stage attaches them again before its layers run.
Whether a value carries its mask is known only when the sending stage runs
(Keras attaches some masks at run time only, and MultiHeadAttention removes its
query's), so a tensor that may carry one always has a header, which says.
"""

import numpy as np

__all__ = ["Boundary"]

_ACT, _GRAD, _MASK, _HEAD = range(4)
_UNSET = -2   # a header's values before it arrives: a short message leaves some


def _np_dtype(dtype):
    if dtype == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return np.dtype(dtype)


class Boundary:
    """One rank's messages for one step: receives posted at `start`, then taken and
    sent as the schedule's actions come (`comm`: the world communicator;
    `rank_of(stage)`: the rank of that stage in this replica and tensor slot)."""

    def __init__(self, comm, graph, cut, rank_of, num_edges):
        self.comm, self.graph, self.cut, self.rank_of = comm, graph, cut, rank_of
        self.num_edges = max(1, num_edges)

    def _tag(self, micro, edge, kind):
        return (micro * self.num_edges + edge.index) * 4 + kind

    def _tensor(self, e):
        return self.graph.tensors[e.tensor]

    def _headed(self, t):
        return t.dynamic or t.mask is not None

    def _head_size(self, t):
        return len(t.shape) + (len(t.mask) if t.mask is not None else 0)

    def _irecv(self, shape, dtype, src, tag):
        buf = np.empty(shape, _np_dtype(dtype))
        return buf, self.comm.irecv(buf, src, tag)

    # -- a step ---------------------------------------------------------------
    def start(self, micro_sizes, training=True):
        """Post every receive whose size is known now: activations (or their headers)
        and the gradients of tensors with a static shape."""
        self.act, self.grad = {}, {}
        for i, n in enumerate(micro_sizes):
            for e in self.cut.recv:
                t = self._tensor(e)
                src = self.rank_of(e.src)
                if self._headed(t):
                    head = np.full(self._head_size(t), _UNSET, np.int64)
                    self.act[(i, e.index)] = ("head", (head, self.comm.irecv(
                        head, src, self._tag(i, e, _HEAD))))
                else:
                    self.act[(i, e.index)] = ("arrays", self._arrays(
                        i, e, src, (n,) + tuple(t.shape[1:]), None))
            for e in self.cut.send:
                t = self._tensor(e)
                if training and t.floating and not t.dynamic:
                    self.grad[(i, e.index)] = self._irecv(
                        (n,) + tuple(t.shape[1:]), t.dtype, self.rank_of(e.dst),
                        self._tag(i, e, _GRAD))

    def _arrays(self, i, e, src, shape, mask_shape):
        t = self._tensor(e)
        value = self._irecv(shape, t.dtype, src, self._tag(i, e, _ACT))
        mask = (self._irecv(mask_shape, np.bool_, src, self._tag(i, e, _MASK))
                if mask_shape is not None else None)
        return value, mask

    def activation_requests(self, i, peer):
        """The requests to wait for before microbatch i's activations from stage
        `peer` are here; call again until it returns none (headers come first)."""
        reqs = []
        for e in self.cut.recv:
            if e.src != peer:
                continue
            state, entry = self.act[(i, e.index)]
            if state == "head":
                buf, req = entry
                if not req.test():
                    reqs.append(req)
                    continue
                t = self._tensor(e)
                n = len(t.shape)
                shape = tuple(int(d) for d in buf[:n])
                mask_shape = tuple(int(d) for d in buf[n:]) if t.mask is not None else None
                if mask_shape is not None and all(d == -1 for d in mask_shape):
                    mask_shape = None  # sent without its mask
                if min(shape + (mask_shape or ()), default=0) < 0:
                    raise RuntimeError(
                        f"hyparflow: the shape header of boundary tensor {e.tensor} (microbatch {i}) "
                        f"from stage {e.src} arrived as {buf.tolist()}: not a header this "
                        f"run sent (a message left on an earlier communicator?). Please "
                        f"report this.")
                self.act[(i, e.index)] = state, entry = "arrays", self._arrays(
                    i, e, self.rank_of(e.src), shape, mask_shape)
            value, mask = entry
            reqs += [r for _, r in [value] + ([mask] if mask else []) if not r.test()]
        return reqs

    def activations(self, i):
        """Microbatch i's received values (by `cut.recv`) and masks (one per tensor
        that may carry one, None where it came without), out of the step's buffers."""
        values, masks = [], []
        for e in self.cut.recv:
            _, (value, mask) = self.act.pop((i, e.index))
            values.append(value[0])
            if self._tensor(e).mask is not None:  # None: sent without its mask
                masks.append(mask[0] if mask is not None else None)
        return values, masks

    def send_activations(self, i, peer, outs, training=True):
        """Send microbatch i's outputs (`outs`: tensor -> value, ("mask", tensor) ->
        mask) to stage `peer`; returns the send requests."""
        sends = []
        dst = self.rank_of(peer)
        for e in self.cut.send:
            if e.dst != peer:
                continue
            t = self._tensor(e)
            value, mask = outs[e.tensor], outs.get(("mask", e.tensor))
            if mask is not None and mask.size == 0 and len(t.mask) and value.size:
                mask = None  # this value carries no mask at run time
            if self._headed(t):
                if t.mask is None:
                    mask_part = ()
                else:
                    mask_part = mask.shape if mask is not None else (-1,) * len(t.mask)
                head = np.array(value.shape + tuple(mask_part), np.int64)
                sends.append(self.comm.isend(head, dst, self._tag(i, e, _HEAD)))
                if training and t.floating and t.dynamic:
                    self.grad[(i, e.index)] = self._irecv(value.shape, t.dtype, dst,
                                                          self._tag(i, e, _GRAD))
            sends.append(self.comm.isend(value, dst, self._tag(i, e, _ACT)))
            if mask is not None:
                sends.append(self.comm.isend(np.ascontiguousarray(mask), dst,
                                             self._tag(i, e, _MASK)))
        return sends

    def gradient_requests(self, i, peer):
        return [self.grad[(i, e.index)][1] for e in self.cut.send
                if e.dst == peer and (i, e.index) in self.grad]

    def gradients(self, i):
        """The gradients of microbatch i's outputs: tensor -> array (a tensor sent to
        several stages gets the sum of theirs)."""
        out = {}
        for e in self.cut.send:
            if (i, e.index) in self.grad:
                buf = self.grad.pop((i, e.index))[0]
                out[e.tensor] = buf if e.tensor not in out else out[e.tensor] + buf
        return out

    def send_gradients(self, i, peer, grads):
        return [self.comm.isend(grads[e.tensor], self.rank_of(e.src), self._tag(i, e, _GRAD))
                for e in self.cut.recv if e.src == peer and e.tensor in grads]
