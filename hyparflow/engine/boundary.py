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

With a 16-bit `wire` (`communication_dtype`'s "stages" path, `engine.wire`), floating
float32 values and their gradients travel in it and are cast back on arrival; masks,
headers and integer tensors never change. Gradients in float16 carry the edge's loss
scale (`LossScale`, multiplied before the cast, divided after). A float16 message that
would hold an inf or nan is sent again in float32 on a tag of its own: the sender sees
it as it casts, the receiver as it takes the value, and both note it (the edge's scale
halves at the next step's `start`): no round trip, and the result is what float32 gives.
"""

import numpy as np

from .comm import poll, timeout_seconds
from . import wire as _wire

__all__ = ["Boundary"]

_ACT, _GRAD, _MASK, _HEAD, _ACT32, _GRAD32 = range(6)
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
        self.set_wire(None)

    def set_wire(self, wire):
        """The dtype floating values travel in (None: as they are), and the bytes of
        floating values this rank sent (`sent`, for the benchmark and tests)."""
        self.wire = wire
        self.kinds = 4 if wire is None else 6  # the float32 redo tags only with a wire
        self.scales = {}  # edge index -> LossScale of its gradients (float16)
        self.overflowed = set()  # edges whose gradients overflowed this step
        self.sent = 0

    def _tag(self, micro, edge, kind):
        return (micro * self.num_edges + edge.index) * self.kinds + kind

    def _wire_of(self, t):
        """The dtype tensor `t` travels in: the wire for wider floats, else its own."""
        if self.wire is None or not t.floating or np.dtype(_np_dtype(t.dtype)).itemsize <= 2:
            return _np_dtype(t.dtype)
        return self.wire

    def _scale(self, e):
        if not _wire.scaled(self.wire):
            return 1.0
        if e.index not in self.scales:
            self.scales[e.index] = _wire.LossScale()
        return self.scales[e.index].value

    def _send(self, value, t, dst, tag, redo_tag, scale=1.0):
        """Send a floating value in its wire dtype (times `scale`), and in float32 on
        `redo_tag` too when the float16 cast holds an inf or nan; returns (the
        requests, whether it was sent again)."""
        value = np.asarray(value)
        wire = self._wire_of(t)
        if wire == value.dtype:
            self.sent += value.nbytes if t.floating else 0
            return [self.comm.isend(value, dst, tag)], False
        with np.errstate(over="ignore", invalid="ignore"):  # an overflow is sent again
            cast = (value * np.float32(scale) if scale != 1.0 else value).astype(wire)
        reqs = [self.comm.isend(cast, dst, tag)]
        self.sent += cast.nbytes
        if _wire.scaled(wire) and not np.isfinite(cast).all():
            value = np.ascontiguousarray(value)
            reqs.append(self.comm.isend(value, dst, redo_tag))
            self.sent += value.nbytes
            return reqs, True
        return reqs, False

    def _arrived(self, buf, t, src, redo_tag, scale=1.0):
        """A received value in its own dtype (`buf` in the wire's): cast back and
        divided by `scale`, or, if it holds an inf or nan in float16, the float32
        value sent again (waited for: the sender posted it with the first). Returns
        (the value, whether it was sent again)."""
        dtype = np.dtype(_np_dtype(t.dtype))
        if buf.dtype == dtype:
            return buf, False
        if _wire.scaled(buf.dtype) and not np.isfinite(buf).all():
            value = np.empty(buf.shape, dtype)
            req = self.comm.irecv(value, src, redo_tag)
            poll(req.test, timeout_seconds(), f"the float32 resend of a boundary tensor "
                 f"from rank {src}", getattr(self.comm, "spin", None))
            return value, True
        value = buf.astype(dtype)
        if scale != 1.0:
            value *= dtype.type(1.0 / scale)
        return value, False

    def _tensor(self, e):
        return self.graph.tensors[e.tensor]

    def _headed(self, t):
        return t.dynamic or t.mask is not None

    def _head_size(self, t):
        return len(t.shape) + (len(t.mask) if t.mask is not None else 0)

    def _irecv(self, shape, t, src, tag):
        buf = np.empty(shape, self._wire_of(t))
        return buf, self.comm.irecv(buf, src, tag)

    # -- a step ---------------------------------------------------------------
    def start(self, micro_sizes, training=True):
        """Post every receive whose size is known now: activations (or their headers)
        and the gradients of tensors with a static shape."""
        # The last training step's gradient overflows, which both ends of each edge saw.
        if training:
            for index, scale in self.scales.items():
                scale.update(index in self.overflowed)
            self.overflowed = set()
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
                        (n,) + tuple(t.shape[1:]), t, self.rank_of(e.dst),
                        self._tag(i, e, _GRAD))

    def _arrays(self, i, e, src, shape, mask_shape):
        t = self._tensor(e)
        value = self._irecv(shape, t, src, self._tag(i, e, _ACT))
        mask = None
        if mask_shape is not None:
            buf = np.empty(mask_shape, np.bool_)
            mask = buf, self.comm.irecv(buf, src, self._tag(i, e, _MASK))
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
            arrived, _ = self._arrived(value[0], self._tensor(e), self.rank_of(e.src),
                                       self._tag(i, e, _ACT32))
            values.append(arrived)
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
                    self.grad[(i, e.index)] = self._irecv(value.shape, t, dst,
                                                          self._tag(i, e, _GRAD))
            if self.wire is None:
                declared = _np_dtype(t.dtype)
                if value.dtype != declared:  # a layer whose run gives another dtype than
                    value = value.astype(declared)  # its graph says (StringLookup's ints)
                sends.append(self.comm.isend(value, dst, self._tag(i, e, _ACT)))
                self.sent += np.asarray(value).nbytes if t.floating else 0
            else:
                sends += self._send(value, t, dst, self._tag(i, e, _ACT),
                                    self._tag(i, e, _ACT32))[0]
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
                if self.wire is not None:
                    buf, again = self._arrived(buf, self._tensor(e), self.rank_of(e.dst),
                                               self._tag(i, e, _GRAD32), self._scale(e))
                    if again:
                        self.overflowed.add(e.index)
                out[e.tensor] = buf if e.tensor not in out else out[e.tensor] + buf
        return out

    def send_gradients(self, i, peer, grads):
        if self.wire is None:
            out = [e for e in self.cut.recv if e.src == peer and e.tensor in grads]
            self.sent += sum(np.asarray(grads[e.tensor]).nbytes for e in out)
            return [self.comm.isend(grads[e.tensor], self.rank_of(e.src),
                                    self._tag(i, e, _GRAD)) for e in out]
        sends = []
        for e in self.cut.recv:
            if e.src == peer and e.tensor in grads:
                reqs, again = self._send(grads[e.tensor], self._tensor(e), self.rank_of(e.src),
                                         self._tag(i, e, _GRAD), self._tag(i, e, _GRAD32),
                                         self._scale(e))
                sends += reqs
                if again:
                    self.overflowed.add(e.index)
        return sends
