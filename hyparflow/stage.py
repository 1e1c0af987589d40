"""One stage's computation in TensorFlow: forward under a tape, backward, gradient sums.

The forward runs the stage's layer calls (compiled with `tf.function`, batch
dimension `None`, so it traces once). Calling a compiled function under an
eager `GradientTape` makes TensorFlow keep the intermediates it needs and run
the backward as compiled code too, so there is neither recomputation nor
per-layer Python in the backward.
"""

import functools
import time

import keras
import numpy as np
import tensorflow as tf

from . import _compat
from .profile import slowdown

__all__ = ["Stage"]


def _aligned_empty(n):
    """A float32 numpy buffer of `n` values on 64-byte-aligned memory, so that
    TensorFlow can take parts of it without a copy (`_as_tensor`)."""
    raw = np.empty(n + 16, np.float32)
    start = (-raw.ctypes.data % 64) // 4
    return raw[start:start + n]


def _as_tensor(array):
    """The numpy buffer as a tensor, zero-copy when it is aligned (dlpack)."""
    if array.ctypes.data % 64 == 0 and array.flags.c_contiguous:
        try:
            return tf.experimental.dlpack.from_dlpack(array.__dlpack__())
        except Exception:  # noqa: BLE001 - an older TensorFlow or numpy: copy instead
            pass
    return tf.convert_to_tensor(array)


class _Packing:
    """One float32 buffer holding several variables' gradients, each starting on a
    64-byte boundary (so TensorFlow can take a part without copying), then one
    flag per variable."""

    def __init__(self, shapes):
        sizes = [int(np.prod(shape)) for shape in shapes]
        starts, n = [], 0
        for size in sizes:
            starts.append(n)
            n += size + (-size % 16)
        self.flat = _aligned_empty(n + len(shapes))
        self.flat[...] = 0  # the padding stays zero
        self.views = [self.flat[a:a + size].reshape(shape)
                      for a, size, shape in zip(starts, sizes, shapes)]
        self.flags = self.flat[n:]


def _spec(tensor, batch=None):
    return tf.TensorSpec((batch,) + tuple(tensor.shape[1:]), tf.as_dtype(tensor.dtype))


class _Hooked(keras.StatelessScope):
    """Reads every trainable variable of a stage through a gradient hook.

    Keras layers read a variable's value through the stateless scope when one is
    active, so mapping each variable to `identity(value)` with a custom gradient
    puts a hook where its gradient is complete, inside the compiled backward.
    Assignments made in the scope (BatchNorm statistics, seed generators,
    metrics) are only recorded by Keras; `write_back` applies them."""

    def __init__(self, mapping):
        super().__init__(mapping, collect_losses=True)
        self.updated = {}

    def add_update(self, update):
        super().add_update(update)
        self.updated[id(update[0])] = update[0]

    def write_back(self):
        for variable in self.updated.values():
            variable.assign(self.get_current_value(variable))


class Stage:
    """Runs stage `plan.index` of `graph` for the user's `model`, on its own variables.

    Inputs are the model inputs this stage reads from data followed by the
    boundary tensors it receives (`input_ids`); outputs are the boundary
    tensors it sends (`output_ids`). The last stage also computes the compiled
    loss and metrics. Every forward returns `contribution`: the microbatch's
    loss (last stage) plus its layers' own losses (regularisers), scaled by the
    microbatch's share of the global batch, so that summing contributions and
    their gradients over microbatches and replicas gives the full batch's.
    """

    def __init__(self, graph, plan, model, partition, *, is_last, run_eagerly=False,
                 y_specs=(), has_sample_weight=False, recompute=False, shards=None):
        self.graph, self.plan, self.model = graph, plan, model
        self.is_last = is_last
        self.recompute = recompute
        self.input_ids = list(plan.data_inputs) + [e.tensor for e in plan.recv]
        self.output_ids = sorted({e.tensor for e in plan.send})
        # Split layers (tensor parallelism): this rank trains its parts in place of
        # the layers' variables; `originals` are the model variables they stand for.
        self.shards = dict(shards or {})
        replaces = {k: v for shard in self.shards.values() for k, v in shard.replaces.items()}
        self.originals = graph.variables_of(plan.nodes, trainable=True)
        self.trainable = [replaces.get(id(v), v) for v in self.originals]
        # Layers whose own losses (regularisers, add_loss) this stage adds: a layer
        # shared with an earlier stage is counted there, once.
        self._loss_ops = []
        self._state = graph.variables_of(plan.nodes, trainable=False)
        seen = set()
        for i in plan.nodes:
            op = graph.nodes[i].op
            if id(op) in seen:
                continue
            seen.add(id(op))
            if not hasattr(op, "losses"):
                continue  # a plain operation: no weights, no losses
            weights = op.weights
            if not weights or all(partition.owner.get(id(v)) == plan.index for v in weights):
                self._loss_ops.append(op)
        # Gradients flow back only into received tensors; data inputs need none.
        # Random layers: a stable model-wide number for each seed generator, so a
        # microbatch's randomness depends on (seed, microbatch, generator), never on
        # which stage or rank runs it.
        numbers = {id(g): k for k, g in enumerate(_compat.seed_generators(model))}
        self._generators, seen_gen = [], set()
        for i in plan.nodes:
            for g in _compat.seed_generators(graph.nodes[i].op):
                if id(g) not in seen_gen:
                    seen_gen.add(id(g))
                    self._generators.append((numbers.get(id(g), len(numbers)), g))
        self._diff = [k for k, t in enumerate(self.input_ids)
                      if k >= len(plan.data_inputs) and graph.tensors[t].floating]
        self._saved = {}
        self.touched = np.zeros(len(self.trainable), dtype=bool)
        # Gradients that a hook (`_arrive`) already summed during the current backward,
        # and who is told of each: the executor, to start allreduces early.
        self.arrived = np.zeros(len(self.trainable), dtype=bool)
        self.on_arrival = None
        self.hooks = tuple(range(len(self.trainable)))  # whose gradients are reported
        self._in_specs = [_spec(graph.tensors[t]) for t in self.input_ids]
        self._y_specs = [tf.TensorSpec((None,) + tuple(s[1:]), tf.as_dtype(d)) for s, d in y_specs]
        self._eager = run_eagerly
        self._functions = {}
        self.set_buckets([])  # gradient buffers, until the executor lays them out
        self._forward = self._function("train", has_sample_weight)
        self._slowdown = slowdown()

    def _lag(self, start):
        """HYPARFLOW_SLOWDOWN: act as a rank that many times slower (for tests of
        heterogeneous balancing)."""
        if self._slowdown > 1:
            time.sleep((self._slowdown - 1) * (time.perf_counter() - start))

    def _signature(self, with_y, with_sample_weight):
        """(inputs, targets, sample weights, share), batch dimension None."""
        return [self._in_specs, self._y_specs if with_y else [],
                [tf.TensorSpec((None,), tf.float32)] if with_y and with_sample_weight else [],
                tf.TensorSpec((), tf.float32)]

    def _function(self, kind, has_sample_weight, hooked=()):
        """The stage's computation for `kind` ("train", "evaluate" or "predict"), compiled
        once per kind with a `None` batch dimension (or eager when asked). `hooked`:
        positions of the variables whose gradients the backward reports as it makes them."""
        key = (kind, bool(has_sample_weight) and kind != "predict", hooked)
        if key not in self._functions:
            signature = self._signature(self.is_last and kind != "predict", key[1])

            def body(inputs, y, sample_weight, share):
                return self._body(inputs, y, sample_weight, share, kind, hooked)

            self._functions[key] = body if self._eager else tf.function(
                body, input_signature=signature, reduce_retracing=True)
        return self._functions[key]

    # -- the computation ------------------------------------------------------
    def _run_nodes(self, inputs, training):
        g = self.graph
        if g.functional is None:  # a subclassed model: one opaque call
            x = inputs[0] if len(inputs) == 1 else list(inputs)
            out = self.model(x, training=training)
            return {"opaque": _compat.tree.flatten(out)}
        values = {id(g.tensors[t].keras_tensor): v for t, v in zip(self.input_ids, inputs)}
        for i in self.plan.nodes:
            node = g.nodes[i]
            args, kwargs = _compat.fill_in(node.keras_node, values)
            if i in self.shards:
                out = self.shards[i](args, kwargs, training)
            else:
                out = _compat.call_operation(node.op, args, kwargs, training)
            for kt, v in zip(node.keras_node.outputs, _compat.tree.flatten(out)):
                values[id(kt)] = v
        return values

    def _value(self, values, t):
        return values[id(self.graph.tensors[t].keras_tensor)]

    def _body(self, inputs, y, sample_weight, share, kind="train", hooked=()):
        if not hooked:
            return self._compute(inputs, y, sample_weight, share, kind)
        # Every trainable variable is mapped (Keras's regularisers read their values
        # from the scope); only the `hooked` ones through a hook.
        hooked = set(hooked)
        scope = _Hooked([(v, self._hook(k, v.value) if k in hooked else v.value)
                         for k, v in enumerate(self.trainable)])
        with scope:
            result = self._compute(inputs, y, sample_weight, share, kind)
        scope.write_back()
        return result

    def _hook(self, k, value):
        """`value` (variable k's) unchanged; in the backward, its gradient goes
        through `_arrive` as soon as it is complete. Stateless, so that TensorFlow
        runs each hook when its input is ready instead of chaining them."""
        arrive = functools.partial(self._arrive, k)

        @tf.custom_gradient
        def identity(x):
            def grad(g):
                if isinstance(g, tf.IndexedSlices):
                    g = tf.convert_to_tensor(g)
                out = tf.numpy_function(arrive, [g], g.dtype, stateful=False)
                out.set_shape(g.shape)
                return out
            return tf.identity(x), grad

        return identity(value)

    def _arrive(self, k, g):
        """Variable k's gradient for this microbatch, from inside the backward: summed
        into its buffer now (the returned gradient is then skipped by `_accumulate`)."""
        self._add(k, g if g.dtype == np.float32 else g.astype(np.float32))
        self.arrived[k] = True
        if self.on_arrival is not None:
            self.on_arrival(k)
        return g

    def _compute(self, inputs, y, sample_weight, share, kind):
        values = self._run_nodes(inputs, training=(kind == "train"))
        extra = [tf.cast(tf.reduce_sum(l), tf.float32) for op in self._loss_ops for l in op.losses]
        total = tf.add_n(extra) if extra else tf.zeros((), tf.float32)
        if self.graph.functional is None:
            outs = []
            flat_pred = values["opaque"]
        else:
            outs = [self._value(values, t) for t in self.output_ids]
            flat_pred = [self._value(values, t) for t in self.plan.outputs]
        if self.is_last and kind == "predict":
            return outs, share * total, list(flat_pred)
        if self.is_last:
            y_pred = _compat.pack_outputs(self.graph.functional, flat_pred)
            y_true = y[0] if len(y) == 1 else list(y)
            sw = sample_weight[0] if sample_weight else None
            loss = _compat.call_compile_loss(_compat.compile_loss(self.model), y_true, y_pred, sw,
                                             share)
            metrics = _compat.compile_metrics(self.model)
            if metrics is not None:
                metrics.update_state(y_true, y_pred, sample_weight=sw)
            total = total + tf.cast(loss, tf.float32)
        if kind == "train":
            return outs, share * total
        return outs, share * total, []

    def infer(self, kind, inputs, y=(), sample_weight=(), share=1.0):
        """Forward only, in inference mode ("evaluate": loss and metrics on the last
        stage; "predict": the model's outputs there). Returns (outputs, loss
        contribution, predictions)."""
        fn = self._function(kind, bool(sample_weight))
        if kind == "predict":
            y, sample_weight = (), ()
        return fn([tf.convert_to_tensor(a) for a in inputs], [tf.convert_to_tensor(a) for a in y],
                  [tf.convert_to_tensor(a, tf.float32) for a in sample_weight],
                  tf.constant(share, tf.float32))

    def reseed(self, seed, microbatch_id):
        """Set every random layer's generator from (seed, global microbatch id, its number)."""
        for number, g in self._generators:
            mixed = (seed * 0x9E3779B1 + number * 0x85EBCA77 + microbatch_id * 0xC2B2AE3D) % (2**31 - 1)
            g.state.assign(np.array([mixed, 0], dtype=g.state.dtype))

    # -- the schedule's actions ---------------------------------------------
    def forward(self, i, inputs, y=(), sample_weight=(), share=1.0, seed=None, hooked=False):
        """Forward microbatch `i`; returns its output tensors (by `output_ids`) and its
        loss contribution. Keeps what `backward(i, ...)` needs: the tape, or with
        `recompute` only the stage's inputs. `seed`: (seed, global microbatch id)
        for the random layers. `hooked`: its backward reports the gradients of the
        variables `hooks` to `on_arrival` as soon as it makes them."""
        start = time.perf_counter()
        hooked = self.hooks if hooked else ()
        if seed is not None:
            self.reseed(*seed)
        args = ([tf.convert_to_tensor(a) for a in inputs], [tf.convert_to_tensor(a) for a in y],
                [tf.convert_to_tensor(a, tf.float32) for a in sample_weight],
                tf.constant(share, tf.float32))
        if self.recompute:
            outs, contribution = self._forward(*args)
            self._saved[i] = (args, seed, hooked)
        else:
            tape, outs, contribution = self._taped(args, hooked)
            self._saved[i] = (tape, [args[0][k] for k in self._diff], outs, contribution, hooked)
        self._lag(start)
        return outs, contribution

    def _taped(self, args, hooked=()):
        forward = self._function("train", bool(args[2]), hooked) if hooked else self._forward
        tape = tf.GradientTape()
        with tape:
            for k in self._diff:
                tape.watch(args[0][k])
            outs, contribution = forward(*args)
        return tape, outs, contribution

    def _replay(self, i):
        """Recompute microbatch `i`'s forward under a tape, leaving the layers' state
        (BatchNorm statistics, seed generators) as the first forward left it."""
        args, seed, hooked = self._saved.pop(i)
        before = [v.numpy() for v in self._state]
        if seed is not None:
            self.reseed(*seed)
        tape, outs, contribution = self._taped(args, hooked)
        for v, value in zip(self._state, before):
            v.assign(value)
        return tape, [args[0][k] for k in self._diff], outs, contribution, hooked

    def backward(self, i, out_grads):
        """Backward microbatch `i` given the gradients of its outputs (dict tensor id ->
        array, or missing when no later stage used it); adds the variables' gradients
        to the gradient buffers and returns the gradients of the received inputs by tensor id."""
        start = time.perf_counter()
        if self.recompute:
            tape, diff_inputs, outs, contribution, _ = self._replay(i)
        else:
            tape, diff_inputs, outs, contribution, _ = self._saved.pop(i)
        self._ready()
        targets, seeds = [contribution], [tf.ones_like(contribution)]
        for t, o in zip(self.output_ids, outs):
            g = out_grads.get(t)
            if g is not None and self.graph.tensors[t].floating:
                targets.append(o)
                seeds.append(tf.convert_to_tensor(g, dtype=o.dtype))
        sources = list(self.trainable) + diff_inputs
        result = tape.gradient(targets, sources, output_gradients=seeds,
                               unconnected_gradients=tf.UnconnectedGradients.NONE)
        grads = self._accumulate(result, diff_inputs)
        self._lag(start)
        return grads

    def forward_backward(self, i, inputs, y=(), sample_weight=(), share=1.0, seed=None,
                         hooked=False):
        """Forward and backward of microbatch `i` in one compiled call, for a stage
        whose backward can follow its forward at once (the last stage, under 1F1B or
        with one stage): no tape crosses calls. Returns (gradients of the received
        inputs by tensor id, loss contribution)."""
        start = time.perf_counter()
        hooked = self.hooks if hooked else ()
        if seed is not None:
            self.reseed(*seed)
        key = ("fused", bool(sample_weight), hooked)
        if key not in self._functions:
            diff, variables = self._diff, self.trainable

            def fused(inputs, y, sample_weight, share):
                with tf.GradientTape() as tape:
                    for k in diff:
                        tape.watch(inputs[k])
                    _, contribution = self._body(inputs, y, sample_weight, share, "train", hooked)
                grads = tape.gradient(contribution, list(variables) + [inputs[k] for k in diff],
                                      unconnected_gradients=tf.UnconnectedGradients.NONE)
                return contribution, grads

            signature = self._signature(True, bool(sample_weight))
            self._functions[key] = fused if self._eager else tf.function(
                fused, input_signature=signature, reduce_retracing=True)
        inputs = [tf.convert_to_tensor(a) for a in inputs]
        self._ready()
        contribution, result = self._functions[key](
            inputs, [tf.convert_to_tensor(a) for a in y],
            [tf.convert_to_tensor(a, tf.float32) for a in sample_weight], tf.constant(share, tf.float32))
        grads = self._accumulate(result, [inputs[k] for k in self._diff])
        self._lag(start)
        return grads, contribution

    def _ready(self):
        """Before a backward: the buffers exist, and no gradient has arrived yet."""
        if self._views is None:
            self._make_buffers()
        self.arrived[:] = False

    def _add(self, k, g):
        """Add variable k's float32 gradient `g` to its buffer (copy when it is the
        step's first). Summed at once into the same memory every step: keeping a
        fresh tensor per microbatch doubled the backward's time here, faulting in
        new pages each step."""
        view = self._views[k]
        if self.touched[k]:
            np.add(view, g, out=view)
        else:
            np.copyto(view, g)
        self.touched[k] = True

    def _accumulate(self, result, diff_inputs):
        """Add the variables' part of `result` to the gradient buffers (those a hook
        has not already added); return the inputs' part."""
        n = len(self.trainable)
        for k, g in enumerate(result[:n]):
            if g is None or self.arrived[k]:
                continue
            if isinstance(g, tf.IndexedSlices):
                g = tf.convert_to_tensor(g)
            self._add(k, np.asarray(g if g.dtype == tf.float32 else tf.cast(g, tf.float32)))
        grads_in = {}
        for k, g in zip(self._diff, result[n:]):
            t = self.input_ids[k]
            if g is None:
                g = tf.zeros_like(diff_inputs[self._diff.index(k)])
            grads_in[t] = g
        return grads_in

    def set_buckets(self, buckets):
        """Lay the gradient buffers out as `buckets` (lists of positions in
        `trainable`, each one allreduce); positions in none get a bucket of their own.
        The buffers are made at the first backward (none for inference)."""
        covered = {k for b in buckets for k in b}
        rest = [k for k in range(len(self.trainable)) if k not in covered]
        self._layout = [list(b) for b in buckets] + ([rest] if rest else [])
        self._buffers, self._views = None, None

    def _make_buffers(self):
        self._buffers, self._views = {}, [None] * len(self.trainable)
        for bucket in self._layout:
            packing = _Packing([tuple(self.trainable[k].shape) for k in bucket])
            self._buffers[tuple(bucket)] = packing
            for k, view in zip(bucket, packing.views):
                self._views[k] = view

    def flat_grads(self, positions):
        """The summed gradients of variables `positions` (a bucket of `set_buckets`) in
        one writable float32 buffer (zeros where none), followed by one flag per
        variable: 1 if it got a gradient. Each variable's part starts on a 64-byte
        boundary, so that `apply` hands it back to TensorFlow without a copy."""
        packing = self._buffers[tuple(positions)]
        for view, k in zip(packing.views, positions):
            if not self.touched[k]:
                view[...] = 0
        packing.flags[...] = self.touched[positions]
        return packing.flat

    def apply_local(self, optimizer):
        """Step `optimizer` with the summed gradients when no other rank shares them
        (one replica): straight from the buffers."""
        grads = [_as_tensor(self._views[k]) if touched else None
                 for k, touched in enumerate(self.touched)]
        self.reset_grads()
        self._step(optimizer, grads)

    def reset_grads(self):
        self.touched[:] = False
        self.arrived[:] = False

    def apply(self, optimizer, buckets):
        """Step `optimizer` with the reduced buffers of `flat_grads` (`buckets`: their
        positions)."""
        grads = [None] * len(self.trainable)
        for positions in buckets:
            packing = self._buffers[tuple(positions)]
            for k, view, flag in zip(positions, packing.views, packing.flags):
                if flag > 0:
                    grads[k] = _as_tensor(view)
        self._step(optimizer, grads)

    def _step(self, optimizer, grads):
        """When every variable got a gradient (the usual case) the step is one compiled
        call, as in Keras's own train function; otherwise the variables without one
        are skipped, as Keras skips them."""
        if grads and all(g is not None for g in grads):
            if "direct" not in self._functions:
                variables = self.trainable
                step = lambda gs: optimizer.apply(gs, variables)  # noqa: E731
                signature = [[tf.TensorSpec(v.shape, v.dtype) for v in variables]]
                self._functions["direct"] = step if self._eager else tf.function(
                    step, input_signature=signature)
            self._functions["direct"]([tf.cast(g, v.dtype) for g, v in zip(grads, self.trainable)])
            return
        pairs = [(g, v) for g, v in zip(grads, self.trainable) if g is not None]
        if pairs:
            optimizer.apply_gradients(pairs)
