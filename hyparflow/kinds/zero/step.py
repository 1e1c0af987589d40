"""One rank's share of ZeRO-1's step (`Zero`): the parts it owns, the optimizer
stepped on them, the new rows handed out, and the optimizer state in checkpoints."""

import contextlib

import numpy as np

from .reduce import SETTLE_TAG, Reduce, even, row_width, rows_of, tag, window

__all__ = ["VARIABLE_COST", "Zero", "ownership"]


# What one variable costs in an optimizer step beyond its elements, counted in
# elements: Keras's compiled Adam step took ~40 us per variable and ~0.25 ns per
# element on one thread here, so ResNet-110's ~330 variables cost more than their
# 1.7 M elements. Ownership balances elements plus this per variable.
VARIABLE_COST = 1 << 17


def ownership(shapes, n, fixed=0):
    """For variables of `shapes` (in order) and `n` ranks: per variable, the list of
    (rank, first row, end row) it is cut into; ranks own about equal shares of the
    cost (elements, plus `fixed` per variable, spread over its rows so that a single
    large variable is still cut evenly), contiguous in this order. A 0-d variable
    has one row."""
    sizes = [int(np.prod(s)) for s in shapes]
    total = sum(sizes) + fixed * len(sizes)
    targets = [total * r / n for r in range(n + 1)]
    out, offset = [], 0
    for shape, size in zip(shapes, sizes):
        rows = int(shape[0]) if len(shape) else 1
        width = (size + fixed) / rows if rows else 0
        cuts = [0]
        for r in range(1, n):
            c = rows if width == 0 else int(np.clip(np.ceil((targets[r] - offset) / width), 0, rows))
            cuts.append(max(c, cuts[-1]))
        cuts.append(rows)
        out.append([(r, cuts[r], cuts[r + 1]) for r in range(n) if cuts[r + 1] > cuts[r]])
        offset += size + fixed
    return out


def _named_like(var, value):
    """A variable holding `value`, with `var`'s path (so its optimizer slots are
    named as `var`'s, which checkpoints read)."""
    import keras

    prefix = var.path.rsplit("/", 1)[0] if "/" in var.path else ""
    with contextlib.ExitStack() as scopes:
        for name in prefix.split("/") if prefix else ():
            scopes.enter_context(keras.name_scope(name))
        part = keras.Variable(value, dtype=var.dtype, trainable=True, name=var.name)
    if part.path != var.path:
        raise RuntimeError(
            f"hyparflow could not name this rank's part of {var.path!r} as the variable (it "
            f"got {part.path!r}); call hyparflow.fit outside any keras.name_scope, or set "
            "HYPARFLOW_ZERO=0.")
    return part


class Zero:
    """One rank's share of the optimizer step of its stage's shared variables.

    `groups`: [(communicator, positions in stage.trainable)] as the executor sums
    them; a group of one rank is not shared, its variables are stepped whole."""

    def __init__(self, stage, groups, optimizer, eager=False):
        self.stage, self.optimizer, self.eager = stage, optimizer, eager
        split = {id(part) for shard in stage.shards.values()
                 for vid, part in shard.replaces.items() if id(part) != vid}
        self.groups = []  # [(comm, positions it shards)]
        self.parts = {}  # position -> [(rank in its group, first row, end row)]
        self.index = {}  # position -> its number in its group (the same on every member)
        self.mine = []  # [(position, first row, end row, part variable)] stepped here
        cache = optimizer.__dict__.setdefault("_hyparflow_zero", {})
        for comm, positions in groups:
            if comm is None or comm.size < 2:
                continue
            ks = [k for k in positions if id(stage.trainable[k]) not in split]
            self.groups.append((comm, ks))
            for j, (k, parts) in enumerate(zip(ks, ownership(
                    [tuple(stage.trainable[k].shape) for k in ks], comm.size, VARIABLE_COST))):
                self.parts[k], self.index[k] = parts, j
                var = stage.trainable[k]
                for r, a, b in parts:
                    if r == comm.rank:
                        key = (id(var), a, b)
                        if key not in cache:
                            cache[key] = _named_like(var, rows_of(var.numpy(), a, b))
                        self.mine.append((k, a, b, cache[key]))
        self.whole = [k for k in range(len(stage.trainable)) if k not in self.parts]
        self.variables = [p for *_, p in self.mine] + [stage.trainable[k] for k in self.whole]
        self._buffers, self._staging, self._functions = {}, {}, {}
        self.sent = 0  # bytes of floating values this rank handed to the others
        self._sent_per_step = {}  # (comm, bucket, reduce) -> `_bytes`

    def __bool__(self):
        return bool(self.parts)

    def buffer(self, key, shape):
        """A float32 array kept from step to step (fresh pages each step cost time)."""
        buf = self._buffers.get(key)
        if buf is None or buf.shape != tuple(shape):
            buf = self._buffers[key] = np.empty(shape, np.float32)
        return buf

    def load(self):
        """Parts take their rows of the variables' current values (after the weights
        were broadcast, or restored from a checkpoint)."""
        for k, a, b, part in self.mine:
            part.assign(rows_of(self.stage.trainable[k].numpy(), a, b))

    def start_reduce(self, comm, bucket, flat):
        """Start summing bucket `bucket` (its flat buffer `flat`, flags last) into
        the owners' rows; returns the request."""
        self.sent += self._bytes(comm, bucket, reduce=True)
        return Reduce(self, comm, bucket, flat)

    def _bytes(self, comm, bucket, reduce):
        """What this rank sends of `bucket`'s variables in the reduce (its rows to each
        owner; a ring's 2 (n-1)/n of a variable stepped whole) or the gather (its own
        rows to every other rank), through messages or the node's window alike. The
        same every step: counted once per bucket and phase."""
        key = (id(comm), tuple(bucket), reduce)
        if key not in self._sent_per_step:
            self._sent_per_step[key] = self._count(comm, bucket, reduce)
        return self._sent_per_step[key]

    def _count(self, comm, bucket, reduce):
        out = 0
        for k in bucket:
            shape = tuple(self.stage.trainable[k].shape)
            size = 4 * max(1, int(np.prod(shape)))
            if k not in self.parts:
                out += int(size * 2 * (comm.size - 1) / comm.size) if reduce else 0
                continue
            width = size // shape[0] if shape and shape[0] else size
            for r, a, b in self.parts[k]:
                if reduce and r != comm.rank:
                    out += (b - a) * width
                elif not reduce and r == comm.rank:
                    out += (b - a) * width * (comm.size - 1)
        return out

    def ranges(self, comm, bucket, flat):
        """The bucket's sums through a shared window (`Shared.ireduce`): each part's
        rows on its owner only; variables stepped whole in even runs, which every
        rank gets. (The flags, last in `flat`, are summed apart.)"""
        out, whole = [], []
        for k in bucket:
            view = self.stage.grads.view(k)
            at = (view.ctypes.data - flat.ctypes.data) // flat.itemsize
            if k not in self.parts:
                whole.append((at, at + view.size))
                continue
            width = row_width(view)
            out += [(at + a * width, at + b * width, r, False) for r, a, b in self.parts[k]]
        return out + [(a, b, r, True) for a, b, r in even(whole, comm.size)]

    # -- the step ---------------------------------------------------------------

    def apply(self, reduced, sparse):
        """Step the optimizer for this rank's parts (and the unshared variables).
        `reduced`: {position: summed dense gradient} of the variables some rank had
        a gradient for; `sparse`: {position: (indices, values) or a dense sum}. Then
        `gather` gives every rank every part's new values."""
        import tensorflow as tf

        grads = []
        for k, a, b, part in self.mine:
            g = sparse.get(k)
            if isinstance(g, tuple):
                indices, values = g
                keep = (indices >= a) & (indices < b)
                g = tf.IndexedSlices(tf.cast(values[keep], part.dtype),  # pairs are float32
                                     tf.convert_to_tensor(indices[keep] - a),
                                     tf.constant(tuple(part.shape), tf.int64))
            elif g is not None:
                g = rows_of(g, a, b)
            elif k in reduced:
                g = rows_of(reduced[k], a, b)
            grads.append(g)
        for k in self.whole:
            g = sparse.get(k)
            if isinstance(g, tuple):
                g = self.stage.grads.slices_of(k, g)
            grads.append(g if g is not None else reduced.get(k))
        if not self._apply(grads) and (reduced or sparse):
            # Nothing of this rank's got a gradient, but the step happened.
            self.optimizer.iterations.assign_add(1)

    def _apply(self, grads):
        import tensorflow as tf

        present = tuple(j for j, g in enumerate(grads) if g is not None)
        if not present:
            return False
        variables = [self.variables[j] for j in present]
        gs = [grads[j] for j in present]
        sparse = tuple(j for j, g in enumerate(gs) if isinstance(g, tf.IndexedSlices))
        key = (present, sparse)
        if key not in self._functions:
            from ...engine.grads import compiled_step

            self._functions[key] = compiled_step(self.optimizer, variables, sparse, self.eager)
        self._functions[key]([g if isinstance(g, tf.IndexedSlices) else
                              tf.cast(_tensor(g), v.dtype) for g, v in zip(gs, variables)])
        return True

    def _target(self, k):
        """Where variable k's new value is put together this step: its place in one
        of two kept flat buffers, used in turn. The variable takes the buffer as its
        own memory (an assignment from it copies nothing), so the buffer it holds is
        written again only two steps later, when it holds the other one and no
        tensor read from the first is alive (reads live within a step). Assigning
        fresh memory each step instead cost more in page faults than the copy (100+
        ms a step on a 200,000 x 128 table); writing rows into the variable in place
        (a scatter) turns TensorFlow's copy-on-read on, which copies the whole table
        at every read. One buffer for all, so that one function call assigns every
        variable (a call with a tensor per variable took 5 ms for ResNet-110's 330)."""
        self._lay_out()
        var = self.stage.trainable[k]
        at = self._offsets[k]
        return self._flat[self._parity][at:at + int(np.prod(var.shape))].reshape(tuple(var.shape))

    def _lay_out(self):
        """`_target`'s places, once: each shared variable's offset in the flat
        buffers (on a 64-byte boundary), and each group's span there."""
        from ...engine.grads import aligned_empty

        if hasattr(self, "_offsets"):
            return
        self._offsets, self._spans, end = {}, [], 0
        for _, positions in self.groups:
            first = end
            for j in positions:
                self._offsets[j] = end
                end += -(-max(1, int(np.prod(self.stage.trainable[j].shape))) // 16) * 16
            self._spans.append((first, end))
        self._flat = [aligned_empty(end), aligned_empty(end)]

    def gather(self, wait):
        """Every part's new values to every rank of its group, then into the variables
        (`wait(requests)`: waits under the watchdog)."""
        owned = {(k, a, b): value for (k, a, b, _), value in zip(self.mine, self._read())}
        self._parity = 1 - getattr(self, "_parity", 1)
        reqs, messages = [], []
        self._lay_out()
        for g, (comm, positions) in enumerate(self.groups):
            self.sent += self._bytes(comm, positions, reduce=False)
            first, end = self._spans[g]
            span = self._flat[self._parity][first:end]
            # Through the node's shared window (`window`): the owners write the new
            # rows into their slots, the others copy them out.
            shared = window(comm, span)
            through = shared is not None
            ranges = []
            for k in positions:
                target, at = self._target(k), self._offsets[k] - first
                width = row_width(target)
                for r, a, b in self.parts[k]:
                    rows = rows_of(target, a, b)
                    if r == comm.rank:
                        rows[...] = owned[(k, a, b)]
                    if through:
                        ranges.append((at + a * width, at + b * width, r))
                    elif r == comm.rank:
                        reqs += [comm.isend(rows, p, tag(self.index[k], 1))
                                 for p in range(comm.size) if p != r]
                    else:
                        reqs.append(comm.irecv(rows, r, tag(self.index[k], 1)))
            if through:
                reqs.append(shared.igather(span, ranges))
            else:
                messages.append(comm)
        wait(reqs)
        wait(self._settle(messages))
        self._assign_all(_tensor(self._flat[self._parity]))

    def _compiled(self, name, body, signature=None):
        """`body` as one TensorFlow function (one call instead of hundreds of eager
        variable reads or assignments: ~40 us each)."""
        import tensorflow as tf

        if name not in self._functions:
            self._functions[name] = body if self.eager else tf.function(
                body, input_signature=signature, autograph=False)
        return self._functions[name]

    def _read(self):
        """This rank's parts' new values, as numpy arrays."""
        parts = [p for *_, p in self.mine]
        return [v.numpy() for v in self._compiled("read", lambda: [p.value for p in parts])()]

    def _assign_all(self, flat):
        """Every shared variable takes its place in `flat` (`_target`)."""
        import tensorflow as tf

        places = [(self.stage.trainable[k], self._offsets[k]) for k in self._offsets]

        def assign(flat):
            for v, at in places:
                value = tf.reshape(flat[at:at + int(np.prod(v.shape))], tuple(v.shape))
                v.assign(tf.cast(value, v.dtype) if v.dtype != "float32" else value)

        self._compiled("assign", assign, [tf.TensorSpec(flat.shape, tf.float32)])(flat)

    def _settle(self, comms):
        """A token to and from every other rank of each group, posted after this
        rank's messages completed. MPICH completes a send only when the receiver's
        MPI has acknowledged it, and a receiver that has all it waited for may leave
        those acknowledgements queued until its next MPI call, a whole forward and
        backward later (measured: ResNet-110 with 2 replicas, 0.2 -> 0.42 s a step).
        The token goes out behind them, so waiting for the others' tokens waits only
        until everyone's messages are through."""
        reqs = []
        for comm in comms:
            token = self.buffer(("token", id(comm)), (comm.size,))
            for p in range(comm.size):
                if p != comm.rank:
                    reqs += [comm.isend(token[comm.rank:comm.rank + 1], p, SETTLE_TAG),
                             comm.irecv(token[p:p + 1], p, SETTLE_TAG)]
        return reqs

    # -- checkpoints --------------------------------------------------------------

    def _part_slots(self, names):
        """[(optimizer variable, its checkpoint key, first row, end row, position)] of
        this rank's parts (`names`: checkpoint.slot_names of the optimizer's variables)."""
        by_path = {part.path.replace("/", "_") + "_": (a, b, part, k)
                   for k, a, b, part in self.mine}
        out = []
        for var, name in zip(self.optimizer.variables, names):
            if not name.startswith("slot/"):
                continue
            for prefix, (a, b, part, k) in by_path.items():
                if var.name.startswith(prefix) and tuple(var.shape) == tuple(part.shape):
                    out.append((var, name, a, b, k))
                    break
        return out

    def whole_slots(self, names):
        """{checkpoint key: whole value} of the optimizer state of every sharded
        variable, put together from every rank's parts (collective over each group)."""
        slots = self._part_slots(names)
        pieces = {}
        for comm, positions in self.groups:
            ks = set(positions)
            mine = [(name, a, var.numpy()) for var, name, a, _, k in slots if k in ks]
            for rank_pieces in comm.allgather_obj(mine):
                for name, a, value in rank_pieces:
                    pieces.setdefault(name, []).append((a, value))
        return {name: (parts[0][1] if np.ndim(parts[0][1]) == 0 else
                       np.concatenate([v for _, v in sorted(parts, key=lambda p: p[0])]))
                for name, parts in pieces.items()}

    def slicers(self, names):
        """{id(optimizer variable): whole value -> this rank's rows}, for restoring."""
        return {id(var): (lambda value, a=a, b=b: rows_of(value, a, b))
                for var, _, a, b, _ in self._part_slots(names)}


def _tensor(array):
    from ...engine.grads import as_tensor

    return as_tensor(array) if isinstance(array, np.ndarray) else array
