"""A rank's gradient sums for one step, and the optimizer step taken with them.

Dense gradients are summed, as each microbatch's backward returns them, into one
persistent float32 buffer per allreduce bucket (`set_buckets`), each variable's part on
a 64-byte boundary so TensorFlow takes it back without a copy; an Embedding's gradients
are kept as (row, value) pairs per microbatch (`hyparflow.engine.sparse`). A `Stage`
holds one (`Stage.grads`); model chunks sum into their accumulator's; ZeRO uses the
buffers (`view`, `slices_of`) and the helpers here."""

import numpy as np
import tensorflow as tf

from . import sparse as _sparse
from . import clipping as _clipping

__all__ = ["Gradients", "Packing", "aligned_empty", "as_tensor", "compiled_step", "scaled"]


def aligned_empty(n):
    """A float32 numpy buffer of `n` values on 64-byte-aligned memory, so that
    TensorFlow can take parts of it without a copy (`as_tensor`)."""
    raw = np.empty(n + 16, np.float32)
    start = (-raw.ctypes.data % 64) // 4
    return raw[start:start + n]


def as_tensor(array):
    """The numpy buffer as a tensor, zero-copy when it is aligned (dlpack)."""
    if array.ctypes.data % 64 == 0 and array.flags.c_contiguous:
        try:
            return tf.experimental.dlpack.from_dlpack(array.__dlpack__())
        except Exception:  # noqa: BLE001 - an older TensorFlow or numpy: copy instead
            pass
    return tf.convert_to_tensor(array)


class Packing:
    """One float32 buffer holding several variables' gradients, each starting on a
    64-byte boundary (so TensorFlow can take a part without copying), then one
    flag per variable."""

    def __init__(self, shapes):
        sizes = [int(np.prod(shape)) for shape in shapes]
        starts, n = [], 0
        for size in sizes:
            starts.append(n)
            n += size + (-size % 16)
        self.flat = aligned_empty(n + len(shapes))
        self.flat[...] = 0  # the padding stays zero
        self.views = [self.flat[a:a + size].reshape(shape)
                      for a, size, shape in zip(starts, sizes, shapes)]
        self.flags = self.flat[n:]


def scaled(grads, scale):
    """Keras's `clip_by_global_norm`'s last line: every gradient times `scale` (a
    `tf.IndexedSlices` times a tensor is a dense tensor, as there)."""
    return [g * tf.cast(scale, g.dtype) if g is not None else g for g in grads]


def compiled_step(optimizer, variables, sparse, eager=False, clipped=False):
    """`optimizer.apply(grads, variables)` compiled once, as Keras's train function
    compiles its step; the gradients at positions `sparse` come as `tf.IndexedSlices`.
    `clipped`: the step takes a second argument, the global norm's factor
    (`engine.clipping`), and applies the scaled gradients with the optimizer's own
    clipping off."""
    signature = [[tf.IndexedSlicesSpec(tuple(v.shape), v.dtype, tf.int64, tf.int64)
                  if k in sparse else tf.TensorSpec(v.shape, v.dtype)
                  for k, v in enumerate(variables)]]
    def plain(gs):
        return optimizer.apply(gs, variables)

    def clipping(gs, scale):
        with _clipping.unclipped(optimizer):
            return optimizer.apply(scaled(gs, scale), variables)

    if clipped:
        signature.append(tf.TensorSpec((), tf.float32))
    step = clipping if clipped else plain
    return step if eager else tf.function(step, input_signature=signature, autograph=False)


class Gradients:
    """The summed gradients of `variables` (a stage's trainable ones) for this step:
    `touched[k]`: variable k has a dense sum; `arrived[k]`: a hook added it during the
    current backward; `slices`: {k: [(microbatch, indices, values)]} kept pairs;
    `fixed`: positions whose lookups have ids of a fixed shape (their microbatches'
    pairs are merged; found at the first sparse gradient)."""

    def __init__(self, variables, eager=False):
        self.variables, self.eager = variables, eager
        self.touched = np.zeros(len(variables), dtype=bool)
        self.arrived = np.zeros(len(variables), dtype=bool)
        self.slices = {}
        self.fixed = None
        self._steps = {}  # the optimizer step compiled, by its sparse positions
        # `direct`: no other rank shares these sums (the executor sets it), so a
        # variable's only gradient of the step is kept as the tensor it came as
        # (`_held`) and handed to the optimizer as it is: with one microbatch, no
        # copy of the gradients at all (a 32 MB copy was 5% of the MLP's step).
        self.direct = False
        self._held = {}
        # `engine.clipping.Clip` when hyparflow takes global_clipnorm over (the norm
        # is summed over ranks); None: the optimizer clips, if it does.
        self.clip = None
        self.set_buckets([])

    def keep(self, k, microbatch, indices, values):
        """Keep microbatch `microbatch`'s (row, value) pairs of variable k."""
        self.slices.setdefault(k, []).append((microbatch, indices, values))

    def hold(self, k, g):
        """Add variable k's float32 gradient tensor `g`: kept as it is when it is the
        step's first and no other rank shares the sums (`direct`), else summed."""
        if self.direct and not self.touched[k]:
            self._held[k] = g
            self.touched[k] = True
            return
        self.add(k, np.asarray(g))

    def _settle(self, k=None):
        """Held tensors (all, or variable k's) into their buffers."""
        if not self._held or (k is not None and k not in self._held):
            return
        if self.views is None:
            self.make_buffers()
        for j in ([k] if k is not None else list(self._held)):
            np.copyto(self.views[j], np.asarray(self._held.pop(j)))

    def add(self, k, g):
        """Add variable k's float32 gradient `g` to its buffer (copy when it is the
        step's first). Summed at once into the same memory every step: keeping a
        fresh tensor per microbatch doubled the backward's time here, faulting in
        new pages each step."""
        self._settle(k)
        view = self.views[k]
        if self.touched[k]:
            np.add(view, g, out=view)
        else:
            np.copyto(view, g)
        self.touched[k] = True

    def set_buckets(self, buckets, sparse=()):
        """Lay the gradient buffers out as `buckets` (lists of positions in
        `trainable`, each one allreduce); positions in none get a bucket of their own,
        but `sparse` ones (whose pairs are kept instead) none at all. The buffers are
        made at the first backward (none for inference)."""
        covered = {k for b in buckets for k in b} | set(sparse)
        rest = [k for k in range(len(self.variables)) if k not in covered]
        self.layout = [list(b) for b in buckets] + ([rest] if rest else [])
        self.buffers, self.views = None, None

    def make_buffers(self):
        self.buffers, self.views = {}, [None] * len(self.variables)
        for bucket in self.layout:
            packing = Packing([tuple(self.variables[k].shape) for k in bucket])
            self.buffers[tuple(bucket)] = packing
            for k, view in zip(bucket, packing.views):
                self.views[k] = view

    def kinds(self):
        """Per trainable position: what this rank holds for the step so far ("d" a
        dense sum, "s" sparse pairs, "-" nothing)."""
        return "".join("d" if t else ("s" if k in self.slices else "-")
                       for k, t in enumerate(self.touched))

    def take_slices(self):
        """{position: (indices, values)}: this step's pairs, microbatches in order,
        forgotten here."""
        out = {}
        for k, pieces in self.slices.items():
            pieces = sorted(pieces, key=lambda p: p[0])
            if k in (self.fixed or ()):
                out[k] = _sparse.merge_pairs([(p[1], p[2]) for p in pieces])
                continue
            out[k] = (np.concatenate([p[1] for p in pieces]),
                      np.concatenate([p[2] for p in pieces]))
        self.slices = {}
        return out

    def densify(self, k, indices, values):
        """Add pairs into variable k's dense buffer (its group reduces it densely)."""
        if self.views is None:
            self.make_buffers()
        self._settle(k)
        view = self.views[k]
        if not self.touched[k]:
            view[...] = 0
        np.add.at(view, indices, values)
        self.touched[k] = True

    def flat_grads(self, positions):
        """The summed gradients of variables `positions` (a bucket of `set_buckets`) in
        one writable float32 buffer (zeros where none), followed by one flag per
        variable: 1 if it got a gradient. Each variable's part starts on a 64-byte
        boundary, so that `apply` hands it back to TensorFlow without a copy."""
        self._settle()
        packing = self.buffers[tuple(positions)]
        for view, k in zip(packing.views, positions):
            if not self.touched[k]:
                view[...] = 0
        packing.flags[...] = self.touched[positions]
        return packing.flat

    def apply_local(self, optimizer):
        """Step `optimizer` with the summed gradients when no other rank shares them
        (one replica): straight from the buffers, and sparse pairs as they are."""
        grads = [self._held[k] if k in self._held else (
                 as_tensor(self.views[k]) if touched else None)
                 for k, touched in enumerate(self.touched)]
        for k, pairs in self.take_slices().items():
            grads[k] = pairs
        self.reset()
        self.step(optimizer, grads)

    def scale(self, factor):
        """Multiply this step's summed gradients (dense buffers and kept pairs) by
        `factor`, in place (replicas that step on their own: `hyparflow.replicas`)."""
        self._settle()
        if self.views is not None:
            for k, view in enumerate(self.views):
                if view is not None and self.touched[k]:
                    view *= np.float32(factor)
        for pieces in self.slices.values():
            for j, (microbatch, indices, values) in enumerate(pieces):
                pieces[j] = (microbatch, indices, values * np.float32(factor))

    def reset(self):
        self._held = {}
        self.touched[:] = False
        self.arrived[:] = False
        self.slices = {}

    def apply(self, optimizer, buckets, sparse=None):
        """Step `optimizer` with the reduced buffers of `flat_grads` (`buckets`: their
        positions) and `sparse`: {position: (indices, values) or a dense sum}."""
        grads = [None] * len(self.variables)
        for k, view in self.reduced(buckets).items():
            grads[k] = as_tensor(view)
        for k, value in (sparse or {}).items():
            grads[k] = value
        self.step(optimizer, grads)

    def reduced(self, buckets):
        """{position: its gradient buffer} of the variables of `buckets` whose flag
        (summed with the other ranks') says some rank had a gradient."""
        self._settle()
        out = {}
        for positions in buckets:
            packing = self.buffers[tuple(positions)]
            for k, view, flag in zip(positions, packing.views, packing.flags):
                if flag > 0:
                    out[k] = view
        return out

    def view(self, k):
        """Variable k's gradient buffer (None for a variable whose pairs are kept)."""
        if self.views is None:
            self.make_buffers()
        self._settle(k)
        return self.views[k]

    def slices_of(self, k, pairs):
        """(indices, values) -> the `tf.IndexedSlices` Keras would hand the optimizer."""
        indices, values = pairs
        v = self.variables[k]
        return tf.IndexedSlices(tf.cast(values, v.dtype), tf.convert_to_tensor(indices),
                                tf.constant(tuple(v.shape), tf.int64))

    def step(self, optimizer, grads):
        """When every variable got a gradient (the usual case) the step is one compiled
        call, as in Keras's own train function; otherwise the variables without one
        are skipped, as Keras skips them. Sparse gradients ((indices, values) pairs)
        go in as `tf.IndexedSlices`, as Keras's own train step passes them."""
        # The run's global norm (a collective: before anything a rank may skip).
        scale = self.clip.scale(grads) if self.clip is not None else None
        grads = [self.slices_of(k, g) if isinstance(g, tuple) else g
                 for k, g in enumerate(grads)]
        if grads and all(g is not None for g in grads):
            sparse = tuple(k for k, g in enumerate(grads) if isinstance(g, tf.IndexedSlices))
            key = ("direct", sparse, scale is not None)
            if key not in self._steps:
                self._steps[key] = compiled_step(optimizer, self.variables, sparse, self.eager,
                                                 clipped=scale is not None)
            args = [[g if isinstance(g, tf.IndexedSlices) else tf.cast(g, v.dtype)
                     for g, v in zip(grads, self.variables)]]
            if scale is not None:
                args.append(tf.constant(scale, tf.float32))
            self._steps[key](*args)
            return
        pairs = [(g, v) for g, v in zip(grads, self.variables) if g is not None]
        if pairs and scale is not None:
            gs = scaled([tf.cast(g, v.dtype) if not isinstance(g, tf.IndexedSlices) else g
                         for g, v in pairs], tf.constant(scale, tf.float32))
            with _clipping.unclipped(optimizer):
                optimizer.apply_gradients(list(zip(gs, [v for _, v in pairs])))
        elif pairs:
            optimizer.apply_gradients(pairs)
