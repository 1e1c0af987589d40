"""One stage's computation in TensorFlow: forward under a tape, backward, gradient sums.

The forward runs the stage's layer calls (compiled with `tf.function`, batch
dimension `None`, so it traces once). Calling a compiled function under an
eager `GradientTape` makes TensorFlow keep the intermediates it needs and run
the backward as compiled code too, so there is neither recomputation nor
per-layer Python in the backward.
"""

import functools
import time
import warnings

import keras
import numpy as np
import tensorflow as tf

from .. import _compat
from . import customised as _customised
from . import kernels
from . import masks as _masks
from .. import settings
from ..kinds import sparse as _sparse
from ..clock import timed

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


def compiled_step(optimizer, variables, sparse, eager=False):
    """`optimizer.apply(grads, variables)` compiled once, as Keras's train function
    compiles its step; the gradients at positions `sparse` come as `tf.IndexedSlices`."""
    step = lambda gs: optimizer.apply(gs, variables)  # noqa: E731
    signature = [[tf.IndexedSlicesSpec(tuple(v.shape), v.dtype, tf.int64, tf.int64)
                  if k in sparse else tf.TensorSpec(v.shape, v.dtype)
                  for k, v in enumerate(variables)]]
    return step if eager else tf.function(step, input_signature=signature)


def _wants_xla(model):
    """HYPARFLOW_JIT when set, else what `model.compile(jit_compile=...)` resolved to
    (Keras's "auto" turns XLA off on machines without an accelerator)."""
    chosen = settings.jit()
    return bool(getattr(model, "jit_compile", False)) if chosen is None else chosen


class _XLAOrPlain:
    """An XLA-compiled function that falls back to the plain one, once and said, when
    XLA cannot compile it (an operation without an XLA kernel)."""

    runs = 0   # calls run under XLA in this process (what `HYPARFLOW_JIT` changed)

    def __init__(self, xla, plain):
        self.xla, self.plain, self.failed = xla, plain, False

    def __call__(self, *args):
        if not self.failed:
            try:
                out = self.xla(*args)
                _XLAOrPlain.runs += 1
                return out
            except (tf.errors.InvalidArgumentError, tf.errors.UnimplementedError) as exc:
                self.failed = True
                warnings.warn(f"hyparflow: XLA could not compile a stage function, which runs "
                              f"without it ({str(exc).splitlines()[0][:200]})", RuntimeWarning)
        return self.plain(*args)


_PRODUCED = "produced masks"  # the key of `_run_nodes`' masks by tensor


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
                 y_specs=(), sw_specs=(), per_output=False, recompute=False, shards=None,
                 accumulator=False):
        """`accumulator`: a stage that never computes, only holds a rank's gradient
        buffers and steps its variables (interleaved schedules: the rank's model
        chunks are each a `Stage` whose gradients go into it, see `sink_into`)."""
        self.graph, self.plan, self.model = graph, plan, model
        self.sink = None  # (stage, positions there) taking this stage's gradients
        self.is_last = is_last
        self.recompute = recompute
        self.input_ids = list(plan.data_inputs) + [e.tensor for e in plan.recv]
        self.output_ids = sorted({e.tensor for e in plan.send})
        # Keras masks (padding) cross with their tensors: inputs and outputs end with
        # the masks of these tensors, in this order. Recording the masks model.fit
        # sees (hyparflow.masks) comes first: it may find masks that only run-time
        # calls attach, which must cross too.
        if not accumulator:
            _masks.of(graph, True)
        self.mask_ids = [e.tensor for e in plan.recv if graph.tensors[e.tensor].mask is not None]
        self.output_mask_ids = [t for t in self.output_ids if graph.tensors[t].mask is not None]
        # Split layers (tensor parallelism): this rank trains its parts in place of
        # the layers' variables; `originals` are the model variables they stand for.
        self.shards = dict(shards or {})
        replaces = {k: v for shard in self.shards.values() for k, v in shard.replaces.items()}
        self.originals = graph.variables_of(plan.nodes, trainable=True)
        self.transposed = {} if accumulator else self._transposed(graph, plan)
        self.trainable = [replaces.get(id(v), v) for v in self.originals]
        # Split backward (schedules with W actions, set by the executor per step): the
        # Dense (and EinsumDense) calls whose kernel gradients B leaves to W, as (node,
        # position in `trainable`, shape of the product's output without the batch).
        self.split = False
        self.deferred = [] if accumulator else self._deferrable(graph, plan)
        self._kept = {}  # microbatch -> (inputs, output gradients) of `deferred`, for W
        self._zero_cache = {}
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
        self._slices = {}  # position -> [(microbatch, indices, values)] this step
        # Positions whose lookups have ids of a fixed shape (`sparse.fixed_lookups`):
        # their microbatches' pairs are merged. Found at the first sparse gradient.
        self.fixed = None
        self._keep_pairs = _sparse.enabled()
        # Gradients that a hook (`_arrive`) already summed during the current backward,
        # and who is told of each: the executor, to start allreduces early.
        self.arrived = np.zeros(len(self.trainable), dtype=bool)
        self.on_arrival = None
        self.hooks = tuple(range(len(self.trainable)))  # whose gradients are reported
        self._in_specs = [_spec(graph.tensors[t]) for t in self.input_ids]
        self._mask_specs = [tf.TensorSpec((None,) + tuple(graph.tensors[t].mask[1:]), tf.bool)
                            for t in self.mask_ids]
        # Which of `mask_ids` arrive with a mask: Keras attaches some only at run time
        # (and MultiHeadAttention removes its query's), so the sender says (a header).
        self.presence = (True,) * len(self.mask_ids)
        self._y_specs = [tf.TensorSpec((None,) + tuple(s[1:]), tf.as_dtype(d)) for s, d in y_specs]
        # Sample weights of any shape model.fit takes: one array for every output, or
        # (`per_output`) one per output.
        self._sw_specs = [tf.TensorSpec((None,) + tuple(s[1:]), tf.as_dtype(d))
                          for s, d in sw_specs]
        self._per_output = per_output
        # The compiled loss's kinds (`_compat.loss_kinds`), set by the runtime; GLOBAL
        # losses return [sum, normaliser part] per microbatch (`terms`), and their
        # backward is seeded with `scales` (weight / the global batch's normaliser).
        self.loss_kinds, self.scales = [], None
        self.terms = {}  # microbatch -> its GLOBAL losses' [sums..., normaliser parts...]
        # Customised training (`hyparflow.customised`): how the layers' own losses and
        # a `compute_loss` override add up; with an override, the last stage's `y`
        # list ends with the microbatch's model inputs (`takes_x`).
        self.custom = _customised.Plan()
        self._eager = run_eagerly
        self._jit = _wants_xla(model)
        self._functions = {}
        self.set_buckets([])  # gradient buffers, until the executor lays them out
        self._slowdown = settings.slowdown()

    def _compile(self, fn, signature):
        """`fn` as the stage runs it: eager when asked, else a `tf.function` with a `None`
        batch dimension, XLA-compiled when the model asks for it (`_wants_xla`) and the
        stage allows it (no split layer's exchange, no length known only at run time)."""
        if self._eager:
            return fn
        plain = tf.function(fn, input_signature=signature, reduce_retracing=True)
        if not self._jit or self.shards or any(
                t.dynamic for t in (self.graph.tensors[i] for i in self.input_ids)):
            return plain
        return _XLAOrPlain(tf.function(fn, input_signature=signature, jit_compile=True), plain)

    def _transposed(self, graph, plan):
        """{node: kernels.Transposed} for the Dense calls whose input gradient is wanted."""
        if not kernels.enabled() or graph.functional is None:
            return {}
        out, made = {}, {}
        for i in plan.nodes:
            node = graph.nodes[i]
            if i in self.shards or len(node.inputs) != 1 or node.inputs[0] in plan.data_inputs:
                continue
            if kernels.eligible(node.op, graph.tensors[node.inputs[0]].dtype):
                if id(node.op) not in made:
                    made[id(node.op)] = kernels.Transposed(node.op)
                out[i] = made[id(node.op)]
        return out

    def _deferrable(self, graph, plan):
        """`kernels.deferred_nodes` of this stage, with each kernel's position."""
        positions = {id(v): k for k, v in enumerate(self.trainable)}
        return [(i, positions[id(graph.nodes[i].op.kernel)], shape)
                for i, shape in kernels.deferred_nodes(graph, plan.nodes, self.shards)
                if id(graph.nodes[i].op.kernel) in positions]

    def sink_into(self, stage):
        """Add this stage's variable gradients into `stage`'s buffers (which hold the
        same variables among others) instead of its own: one rank's model chunks
        share one set of buffers, one allreduce and one optimizer step. No hooks
        (gradients reported during a backward) and no split backward then."""
        where = {id(v): k for k, v in enumerate(stage.trainable)}
        self.sink = (stage, [where[id(v)] for v in self.trainable])

    @property
    def splitting(self):
        """Whether this step's backwards leave kernel gradients to W calls."""
        return self.split and bool(self.deferred)

    def transposed_choices(self, rows, microbatches):
        """{node: whether keeping its `W^T` pays here} for a step of `microbatches`
        microbatches of `rows` rows (`kernels.pays`)."""
        return {i: kernels.pays(t.op.kernel, rows, microbatches)
                for i, t in self.transposed.items()}

    def keep_transposed(self, choices):
        """Keep the `W^T` of the nodes `choices` marks, drop the others' (before any
        training function is traced)."""
        kept = {i: t for i, t in self.transposed.items() if choices.get(i)}
        if len(kept) != len(self.transposed):
            self.transposed = kept
            self._functions.clear()  # traced with the dropped ones (say, by `time`)

    def begin_step(self):
        """Before a training step's first microbatch: the kept `W^T`s follow the weights."""
        for t in {id(t): t for t in self.transposed.values()}.values():
            t.refresh()

    def _lag(self, start):
        """HYPARFLOW_SLOWDOWN: act as a rank that many times slower (for tests of
        heterogeneous balancing)."""
        if self._slowdown > 1:
            time.sleep((self._slowdown - 1) * (time.perf_counter() - start))

    def _signature(self, with_y, with_sample_weight, split=False):
        """(inputs, targets, sample weights, share[, zeros of `deferred`]), batch
        dimension None."""
        masks = [spec for spec, present in zip(self._mask_specs, self.presence) if present]
        signature = [self._in_specs + masks, self._y_specs if with_y else [],
                     list(self._sw_specs) if with_y and with_sample_weight else [],
                     tf.TensorSpec((), tf.float32)]
        if split:
            signature.append([tf.TensorSpec((None,) + shape, tf.float32)
                              for _, _, shape in self.deferred])
        return signature

    def _zeros(self, inputs):
        """The zero inputs of the `deferred` calls for a microbatch of `inputs`: made
        once per row count (they are never written), as making them costs eager ops."""
        rows = int(inputs[0].shape[0])
        if rows not in self._zero_cache:
            self._zero_cache[rows] = [tf.zeros((rows,) + shape, tf.float32)
                                      for _, _, shape in self.deferred]
        return self._zero_cache[rows]

    def _function(self, kind, has_sample_weight, hooked=(), split=False):
        """The stage's computation for `kind` ("train", "evaluate" or "predict"), compiled
        once per kind with a `None` batch dimension (or eager when asked). `hooked`:
        positions of the variables whose gradients the backward reports as it makes them.
        `split`: the deferred calls take zero inputs and their inputs are returned too."""
        key = (kind, bool(has_sample_weight) and kind != "predict", hooked, self.presence, split)
        if key not in self._functions:
            signature = self._signature(self.is_last and kind != "predict", key[1], split)

            def body(inputs, y, sample_weight, share, zs=None):
                return self._body(inputs, y, sample_weight, share, kind, hooked, zs)

            self._functions[key] = self._compile(body, signature)
        return self._functions[key]

    # -- the computation ------------------------------------------------------
    def _run_nodes(self, inputs, training, zs=None, kept=None):
        """The stage's calls on `inputs`: {keras tensor id: value}. With `zs` (the
        zero inputs of the `deferred` calls), those run as `kernels.deferred_call`
        and their inputs are appended to `kept`."""
        g = self.graph
        if g.functional is None:  # a subclassed model: one opaque call
            x = inputs[0] if len(inputs) == 1 else list(inputs)
            out = self.model(x, training=training)
            return {"opaque": _compat.tree.flatten(out)}
        z_of = {i: z for (i, _, _), z in zip(self.deferred, zs)} if zs is not None else {}
        # Inputs whose gradient nobody wants (data, integer ids) are cut from the
        # backward: a compiled forward called under a tape gets a backward that makes
        # every input's gradient, wanted or not (the first Dense layer's `dy @ W^T`,
        # at the slow `transpose_b` speed, was a third of the MLP's first stage's B).
        diff = set(self._diff)
        values = {id(g.tensors[t].keras_tensor): v
                  if k in diff or not tf.as_dtype(v.dtype).is_floating else tf.stop_gradient(v)
                  for k, (t, v) in enumerate(zip(self.input_ids, inputs))}
        # Each tensor's mask as its producer attached it (None: without one); before
        # each call its inputs carry exactly the masks model.fit's call finds
        # (`hyparflow.masks`: a MultiHeadAttention that ran before it in Keras's
        # order removed them, wherever it ran here).
        produced = {}
        masks = iter(inputs[len(self.input_ids):])
        for t, present in zip(self.mask_ids, self.presence):
            if present:
                produced[t] = next(masks)
                _compat.set_mask(values[id(g.tensors[t].keras_tensor)], produced[t])
        run = _masks.of(g, training)
        for i in self.plan.nodes:
            node = g.nodes[i]
            if run is not None:
                for t, present in run.present[i].items():
                    _compat.set_mask(values[id(g.tensors[t].keras_tensor)],
                                     produced.get(t) if present else None)
            args, kwargs = _compat.fill_in(node.keras_node, values)
            if i in self.shards:
                out = self.shards[i](args, kwargs, training)
            elif i in z_of and training:
                out, x = kernels.deferred_call(node.op, args, kwargs, z_of[i],
                                               self.transposed.get(i))
                kept.append(x)
            elif i in self.transposed and training:
                out = self.transposed[i](args, kwargs)
            else:
                out = _compat.call_operation(node.op, args, kwargs, training)
            for t, kt, v in zip(node.outputs, node.keras_node.outputs, _compat.tree.flatten(out)):
                values[id(kt)] = v
                produced[t] = _compat.get_mask(v)
        values[_PRODUCED] = produced
        if run is not None and self.is_last:
            for t in self.plan.outputs:  # as the loss finds them in model.fit
                _compat.set_mask(self._value(values, t), produced.get(t) if run.final[t] else None)
        return values

    def _value(self, values, t):
        return values[id(self.graph.tensors[t].keras_tensor)]

    def _mask(self, values, t):
        """The Keras mask tensor `t`'s producer attached at run time (what crosses a
        stage, whatever a later call here did to it); an empty one when it has none."""
        mask = values[_PRODUCED].get(t)
        return tf.zeros((0,), tf.bool) if mask is None else tf.cast(mask, tf.bool)

    def _inputs(self, inputs):
        """Received values and masks (None: that tensor came without one) as tensors,
        noting which masks came (`presence`)."""
        n = len(self.input_ids)
        masks = list(inputs[n:])
        self.presence = tuple(m is not None for m in masks) + (True,) * (
            len(self.mask_ids) - len(masks))
        return [tf.convert_to_tensor(a) for a in inputs[:n]] + [
            tf.convert_to_tensor(m, tf.bool) for m in masks if m is not None]

    def _body(self, inputs, y, sample_weight, share, kind="train", hooked=(), zs=None):
        if not hooked:
            return self._compute(inputs, y, sample_weight, share, kind, zs)
        # Every trainable variable is mapped (Keras's regularisers read their values
        # from the scope); only the `hooked` ones through a hook.
        hooked = set(hooked)
        scope = _Hooked([(v, self._hook(k, v.value) if k in hooked else v.value)
                         for k, v in enumerate(self.trainable)])
        with scope:
            result = self._compute(inputs, y, sample_weight, share, kind, zs)
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
                    return g  # pairs are gathered after the backward (`sparse`)
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

    @property
    def _num_x(self):
        """How many model inputs end the last stage's `y` list (a `compute_loss`
        override takes `x`)."""
        return len(self.graph.inputs) if self.takes_x else 0

    @property
    def takes_x(self):
        return self.is_last and self.custom.loss is not None

    def _layer_losses(self, share):
        """The stage's layers' own losses (regularisers, `add_loss`), each scaled as it
        adds up over microbatches: a mean by `share`, a sum as it is."""
        if not self.custom.layer_losses:
            return tf.zeros((), tf.float32)
        parts = []
        for op in self._loss_ops:
            for j, value in enumerate(op.losses):
                value = tf.cast(tf.reduce_sum(value), tf.float32)
                parts.append(value * share if self.custom.kind_of(op, j) == _customised.SHARE
                             else value)
        return tf.add_n(parts) if parts else tf.zeros((), tf.float32)

    def _weights(self, sample_weight):
        """The microbatch's sample weights as the compiled loss takes them: one array
        for every output, or the outputs' structure."""
        if not sample_weight:
            return None
        if not self._per_output:
            return sample_weight[0]
        return _compat.pack_outputs(self.graph.functional, list(sample_weight))

    def _compute(self, inputs, y, sample_weight, share, kind, zs=None):
        """Returns (outputs, contribution, terms) for "train" (and with `zs` the
        deferred calls' inputs after them, `kernels.deferred_call`), (outputs,
        contribution, predictions, terms) otherwise. `contribution` is the part of
        the loss whose sum over microbatches and replicas is the batch's; `terms`,
        on the last stage, the GLOBAL losses' sums and normaliser parts."""
        kept = []
        values = self._run_nodes(inputs, training=(kind == "train"), zs=zs, kept=kept)
        total = self._layer_losses(share)
        terms = tf.zeros((0,), tf.float32)
        if self.graph.functional is None:
            outs = []
            flat_pred = values["opaque"]
        else:
            outs = [self._value(values, t) for t in self.output_ids]
            outs += [self._mask(values, t) for t in self.output_mask_ids]
            flat_pred = [self._value(values, t) for t in self.plan.outputs]
        if self.is_last and kind == "predict":
            return outs, total, list(flat_pred), terms
        if self.is_last and self.custom.loss is not None:
            y_pred = _compat.pack_outputs(self.graph.functional, flat_pred)
            y, xs = list(y[:len(y) - self._num_x]), list(y[len(y) - self._num_x:])
            y_true = y[0] if len(y) == 1 else list(y)
            sw = self._weights(sample_weight)
            x = (_compat.tree.pack_sequence_as(_compat.input_structure(self.graph.functional), xs)
                 if self.graph.functional is not None else (xs[0] if len(xs) == 1 else xs))
            # The layers' losses are added by the stages that hold the layers.
            with _compat.model_losses_replaced(self.model, [tf.zeros(())]):
                value = _compat.run_compute_loss(self.model, x, y_true, y_pred, sw,
                                                 kind == "train")
            metrics = _compat.compile_metrics(self.model)
            if metrics is not None:
                metrics.update_state(y_true, y_pred, sample_weight=sw)
            value = tf.cast(value, tf.float32)
            total = total + (value * share if self.custom.loss == _customised.SHARE else value)
        elif self.is_last:
            y_pred = _compat.pack_outputs(self.graph.functional, flat_pred)
            y_true = y[0] if len(y) == 1 else list(y)
            sw = self._weights(sample_weight)
            loss = _compat.compile_loss(self.model)
            if len(self.loss_kinds) != len(loss._flat_losses or ()):
                raise RuntimeError("hyparflow: the compiled loss's kinds were not planned "
                                   "(Runtime sets them before the first step)")
            static, sums = _compat.compile_loss_terms(loss, y_true, y_pred, sw, share,
                                                      self.loss_kinds)
            metrics = _compat.compile_metrics(self.model)
            if metrics is not None:
                metrics.update_state(y_true, y_pred, sample_weight=sw)
            total = total + static
            if sums:
                terms = tf.stack([t for t, _ in sums] + [c for _, c in sums])
        if kind == "train":
            return (outs, total, terms) if zs is None else (outs, total, terms, kept)
        return outs, total, [], terms

    def infer(self, kind, inputs, y=(), sample_weight=(), share=1.0):
        """Forward only, in inference mode ("evaluate": loss and metrics on the last
        stage; "predict": the model's outputs there). Returns (outputs, loss
        contribution, predictions, GLOBAL loss terms)."""
        inputs = self._inputs(inputs)
        _masks.of(self.graph, False)  # recorded here, not inside the function's trace
        fn = self._function(kind, bool(sample_weight))
        if kind == "predict":
            y, sample_weight = (), ()
        return fn(inputs, [tf.convert_to_tensor(a) for a in y],
                  [tf.convert_to_tensor(a, tf.float32) for a in sample_weight],
                  tf.constant(share, tf.float32))

    def track_global(self, normaliser):
        """The per-output loss trackers of the GLOBAL losses, once the step's
        normalisers are agreed (`_compat.track_global`)."""
        loss = _compat.compile_loss(self.model)
        if loss is not None:
            _compat.track_global(loss, self.loss_kinds, normaliser.sums, normaliser.totals,
                                 normaliser.share)

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
        args = (self._inputs(inputs), [tf.convert_to_tensor(a) for a in y],
                [tf.convert_to_tensor(a, tf.float32) for a in sample_weight],
                tf.constant(share, tf.float32))
        split = self.splitting
        if self.recompute:
            fn = self._function("train", bool(args[2]), (), split)
            result = fn(*args, self._zeros(args[0])) if split else fn(*args)
            outs, contribution, terms = result[0], result[1], result[2]
            self._saved[i] = (args, seed, hooked, self.presence, split)
        else:
            tape, outs, contribution, terms, zs, kept = self._taped(args, hooked, split)
            self._saved[i] = (tape, [args[0][k] for k in self._diff], outs, contribution, terms,
                              hooked, zs, kept)
        if terms.shape[0]:
            self.terms[i] = terms.numpy()
        self._lag(start)
        return outs, contribution

    def _taped(self, args, hooked=(), split=False):
        """The forward under a tape: (tape, outputs, contribution, GLOBAL loss terms,
        zero inputs of the deferred calls and their inputs, or None and None)."""
        forward = self._function("train", bool(args[2]), hooked, split)
        tape = tf.GradientTape()
        zs = kept = None
        with tape:
            for k in self._diff:
                tape.watch(args[0][k])
            if split:
                zs = self._zeros(args[0])
                for z in zs:
                    tape.watch(z)
                outs, contribution, terms, kept = forward(*args, zs)
            else:
                outs, contribution, terms = forward(*args)
        return tape, outs, contribution, terms, zs, kept

    def _replay(self, i):
        """Recompute microbatch `i`'s forward under a tape, leaving the layers' state
        (BatchNorm statistics, seed generators) as the first forward left it."""
        args, seed, hooked, self.presence, split = self._saved.pop(i)
        before = [v.numpy() for v in self._state]
        if seed is not None:
            self.reseed(*seed)
        tape, outs, contribution, terms, zs, kept = self._taped(args, hooked, split)
        for v, value in zip(self._state, before):
            v.assign(value)
        return (tape, [args[0][k] for k in self._diff], outs, contribution, terms, hooked, zs,
                kept)

    def backward(self, i, out_grads):
        """Backward microbatch `i` given the gradients of its outputs (dict tensor id ->
        array, or missing when no later stage used it); adds the variables' gradients
        to the gradient buffers and returns the gradients of the received inputs by
        tensor id. With GLOBAL losses, `scales` must be set (`Executor`)."""
        start = time.perf_counter()
        if self.recompute:
            tape, diff_inputs, outs, contribution, terms, _, zs, kept = self._replay(i)
        else:
            tape, diff_inputs, outs, contribution, terms, _, zs, kept = self._saved.pop(i)
        self._ready()
        targets, seeds = [contribution], [tf.ones_like(contribution)]
        if terms.shape[0]:
            # GLOBAL losses: each microbatch's sum times weight / the batch's normaliser,
            # known once every microbatch of every replica has run its forward.
            k = terms.shape[0] // 2
            targets.append(terms)
            seeds.append(tf.constant(np.concatenate([self.scales, np.zeros(k)]), tf.float32))
        for t, o in zip(self.output_ids, outs):
            g = out_grads.get(t)
            if g is not None and self.graph.tensors[t].floating:
                targets.append(o)
                seeds.append(tf.convert_to_tensor(g, dtype=o.dtype))
        variables = self._variables(zs is not None)
        sources = variables + diff_inputs + list(zs or ())
        result = tape.gradient(targets, sources, output_gradients=seeds,
                               unconnected_gradients=tf.UnconnectedGradients.NONE)
        result = self._keep(i, result, zs, kept)
        grads = self._accumulate(result, diff_inputs, i)
        self._lag(start)
        return grads

    def _variables(self, split):
        """The variables a backward differentiates: all, or with a split backward all
        but the deferred kernels (W's)."""
        if not split:
            return list(self.trainable)
        deferred = {k for _, k, _ in self.deferred}
        return [v for k, v in enumerate(self.trainable) if k not in deferred]

    def _keep(self, i, result, zs, kept):
        """A split backward's `result` (over `_variables(True)`, the inputs, the zero
        inputs): keeps microbatch i's deferred inputs and output gradients for W and
        returns the result laid out as an unsplit backward's, deferred kernels None."""
        if zs is None:
            return result
        result = list(result)
        dys = result[len(result) - len(zs):]
        result = result[:len(result) - len(zs)]
        self._kept[i] = (list(kept), [tf.zeros_like(z) if g is None else g
                                     for z, g in zip(zs, dys)])
        deferred = {k for _, k, _ in self.deferred}
        it = iter(result)
        full = [None if k in deferred else next(it) for k in range(len(self.trainable))]
        return full + list(it)

    @property
    def waiting(self):
        """Microbatches whose deferred weight gradients W has yet to compute."""
        return self._kept.keys()

    def weight_grads(self, microbatches):
        """W: the deferred kernels' gradients of `microbatches`, in one call over their
        concatenated rows (so each product runs at the size of all of them), added
        to the gradient buffers."""
        start = time.perf_counter()
        kept = [self._kept.pop(i) for i in microbatches]
        xs = [tf.concat([k[0][j] for k in kept], 0) if len(kept) > 1 else kept[0][0][j]
              for j in range(len(self.deferred))]
        dys = [tf.concat([k[1][j] for k in kept], 0) if len(kept) > 1 else kept[0][1][j]
               for j in range(len(self.deferred))]
        if "weights" not in self._functions:
            ops = [self.graph.nodes[i].op for i, _, _ in self.deferred]

            def weights(xs, dys):
                return [kernels.weight_grad(op, x, dy) for op, x, dy in zip(ops, xs, dys)]

            signature = [[tf.TensorSpec((None,) + tuple(x.shape[1:]), tf.float32) for x in xs],
                         [tf.TensorSpec((None,) + shape, tf.float32)
                          for _, _, shape in self.deferred]]
            self._functions["weights"] = self._compile(weights, signature)
        if self._views is None:
            self._make_buffers()
        for (_, k, _), g in zip(self.deferred, self._functions["weights"](xs, dys)):
            self._add(k, np.asarray(g))
        self._lag(start)

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
        inputs = self._inputs(inputs)
        split = self.splitting
        key = ("fused", bool(sample_weight), hooked, self.presence, split)
        if key not in self._functions:
            diff, variables = self._diff, self._variables(split)

            def fused(inputs, y, sample_weight, share, zs=None):
                with tf.GradientTape() as tape:
                    for k in diff:
                        tape.watch(inputs[k])
                    for z in zs or ():
                        tape.watch(z)
                    result = self._body(inputs, y, sample_weight, share, "train", hooked, zs)
                contribution = result[1]
                if result[2].shape[0]:
                    raise RuntimeError("hyparflow: a loss with a global normaliser cannot be "
                                       "fused with its backward")
                grads = tape.gradient(
                    contribution, variables + [inputs[k] for k in diff] + list(zs or ()),
                    unconnected_gradients=tf.UnconnectedGradients.NONE)
                return contribution, grads, (result[3] if zs is not None else [])

            signature = self._signature(True, bool(sample_weight), split)
            self._functions[key] = self._compile(fused, signature)
        self._ready()
        args = [inputs, [tf.convert_to_tensor(a) for a in y],
                [tf.convert_to_tensor(a, tf.float32) for a in sample_weight],
                tf.constant(share, tf.float32)]
        zs = self._zeros(inputs) if split else None
        contribution, result, kept = self._functions[key](*args, *([zs] if split else []))
        result = self._keep(i, result, zs, kept)
        grads = self._accumulate(result, [inputs[k] for k in self._diff], i)
        self._lag(start)
        return grads, contribution

    def _fused(self, has_sample_weight, hooked=(), seeded=False):
        """Forward and backward in one compiled call, for `time`: differentiates the
        loss contribution and, with `seeded`, the stage's floating outputs from the
        gradients given for them (a stage timed alone has no later stage)."""
        key = ("fused", has_sample_weight, hooked, self.presence, seeded)
        if key not in self._functions:
            diff, variables = self._diff, self.trainable

            def fused(inputs, y, sample_weight, share, seeds):
                with tf.GradientTape() as tape:
                    for k in diff:
                        tape.watch(inputs[k])
                    result = self._body(inputs, y, sample_weight, share, "train", hooked)
                outs, contribution = result[0], result[1]
                targets = [contribution] + [o for o in outs if o.dtype.is_floating][:len(seeds)]
                grads = tape.gradient(targets, list(variables) + [inputs[k] for k in diff],
                                      output_gradients=[tf.ones_like(contribution)] + list(seeds),
                                      unconnected_gradients=tf.UnconnectedGradients.NONE)
                return contribution, grads

            seeds = [_spec(self.graph.tensors[t]) for t in self.output_ids
                     if self.graph.tensors[t].floating] if seeded else []
            signature = self._signature(True, has_sample_weight) + [seeds]
            self._functions[key] = self._compile(fused, signature)
        return self._functions[key]

    # -- timing, for the planner ------------------------------------------------
    def example(self, batch):
        """Random inputs of `batch` samples for this stage, and ones as its floating
        outputs' gradients (a dimension left open is 8)."""
        def shaped(shape):
            return (batch,) + tuple(d or 8 for d in shape[1:])

        tensors = self.graph.tensors
        inputs = [tf.random.normal(shaped(tensors[t].shape), dtype=tf.as_dtype(tensors[t].dtype))
                  if tensors[t].floating else tf.zeros(shaped(tensors[t].shape),
                                                       tf.as_dtype(tensors[t].dtype))
                  for t in self.input_ids]
        inputs += [tf.ones(shaped(tensors[t].mask), tf.bool) for t in self.mask_ids]
        seeds = {t: np.ones(shaped(tensors[t].shape), np.float32)
                 for t in self.output_ids if tensors[t].floating}
        return inputs, seeds

    def time(self, batch, *, fused=False, repeats=9, idle=0.0):
        """(forward, backward) seconds of one microbatch of `batch` random samples, as
        the executor runs it: the forward kept on a tape and the backward from it,
        with ones as the outputs' gradients, the weights' gradients summed into the
        buffers; `fused`: (0, both in one call), as a last stage under 1F1B runs.
        Each the median of `repeats` calls, each after `idle` seconds asleep (a
        stage's call follows a wait). HYPARFLOW_SLOWDOWN counts, as in training."""
        inputs, seeds = self.example(batch)
        if fused:
            function = self._fused(False, (), seeded=True)
            flat = [tf.convert_to_tensor(seeds[t]) for t in self.output_ids if t in seeds]

            def step():
                start = time.perf_counter()
                self._ready()
                _, result = function(inputs, [], [], tf.constant(1.0), flat)
                self._accumulate(result, [inputs[k] for k in self._diff])
                self.reset_grads()
                self._lag(start)

            step()
            return 0.0, timed(step, repeats, idle)

        def forward():
            self.forward(0, inputs)
            self._saved.clear()

        def both():
            self.forward(0, inputs)
            self.backward(0, seeds)
            self.reset_grads()

        both()
        whole = timed(both, repeats, idle)
        ahead = min(timed(forward, repeats, idle), whole)
        return ahead, whole - ahead

    def _ready(self):
        """Before a backward: the buffers exist, and no gradient has arrived yet."""
        if self._views is None and self.sink is None:  # a sink's buffers hold its sums
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

    def _accumulate(self, result, diff_inputs, microbatch=0):
        """Add the variables' part of `result` to the gradient buffers (those a hook
        has not already added), or keep it as microbatch `microbatch`'s (row, value)
        pairs when it is sparse (see `hyparflow.sparse`); return the inputs' part."""
        n = len(self.trainable)
        into, where = self.sink if self.sink is not None else (self, range(n))
        if into is not self and into._views is None:
            into._make_buffers()
        for k, g in enumerate(result[:n]):
            if g is None or self.arrived[k]:
                continue
            if isinstance(g, tf.IndexedSlices) and not self._keep_pairs:
                g = tf.convert_to_tensor(g)
            if isinstance(g, tf.IndexedSlices):
                if self.fixed is None:
                    self._find_fixed(into, where)
                values = g.values if g.values.dtype == tf.float32 else tf.cast(g.values, tf.float32)
                into._slices.setdefault(where[k], []).append(
                    (microbatch, np.asarray(g.indices, np.int64), np.asarray(values)))
                continue
            into._add(where[k], np.asarray(g if g.dtype == tf.float32 else tf.cast(g, tf.float32)))
        grads_in = {}
        for k, g in zip(self._diff, result[n:]):
            t = self.input_ids[k]
            if g is None:
                g = tf.zeros_like(diff_inputs[self._diff.index(k)])
            grads_in[t] = g
        return grads_in

    def _find_fixed(self, into, where):
        """Which of this stage's variables are looked up only with ids of a fixed shape,
        read from its traced training forward (traced once more, for this only, when
        the stage runs eagerly); noted on `into` (itself, or the accumulator it sinks
        into) at `where`'s positions."""
        fn = next((f for key, f in self._functions.items()
                   if isinstance(key, tuple) and key[0] in ("train", "fused")
                   and hasattr(f, "get_concrete_function")
                   and f.experimental_get_tracing_count()), None)
        if fn is None:
            signature = self._signature(self.is_last, bool(self._sw_specs))
            fn = tf.function(lambda inputs, y, sw, share: self._body(inputs, y, sw, share),
                             input_signature=signature)
        handles = {id(_compat.variable_handle(v)): k for k, v in enumerate(self.trainable)}
        found = _sparse.fixed_lookups(fn.get_concrete_function().graph, handles)
        self.fixed = found
        into.fixed = (into.fixed or set()) | {where[k] for k in found}

    def set_buckets(self, buckets, sparse=()):
        """Lay the gradient buffers out as `buckets` (lists of positions in
        `trainable`, each one allreduce); positions in none get a bucket of their own,
        but `sparse` ones (whose pairs are kept instead) none at all. The buffers are
        made at the first backward (none for inference)."""
        covered = {k for b in buckets for k in b} | set(sparse)
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

    def kinds(self):
        """Per trainable position: what this rank holds for the step so far ("d" a
        dense sum, "s" sparse pairs, "-" nothing)."""
        return "".join("d" if t else ("s" if k in self._slices else "-")
                       for k, t in enumerate(self.touched))

    def take_slices(self):
        """{position: (indices, values)}: this step's pairs, microbatches in order,
        forgotten here."""
        out = {}
        for k, pieces in self._slices.items():
            pieces = sorted(pieces, key=lambda p: p[0])
            if k in (self.fixed or ()):
                out[k] = _sparse.merge_pairs([(p[1], p[2]) for p in pieces])
                continue
            out[k] = (np.concatenate([p[1] for p in pieces]),
                      np.concatenate([p[2] for p in pieces]))
        self._slices = {}
        return out

    def densify(self, k, indices, values):
        """Add pairs into variable k's dense buffer (its group reduces it densely)."""
        if self._views is None:
            self._make_buffers()
        view = self._views[k]
        if not self.touched[k]:
            view[...] = 0
        np.add.at(view, indices, values)
        self.touched[k] = True

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
        (one replica): straight from the buffers, and sparse pairs as they are."""
        grads = [_as_tensor(self._views[k]) if touched else None
                 for k, touched in enumerate(self.touched)]
        for k, pairs in self.take_slices().items():
            grads[k] = pairs
        self.reset_grads()
        self._step(optimizer, grads)

    def scale_grads(self, factor):
        """Multiply this step's summed gradients (dense buffers and kept pairs) by
        `factor`, in place (replicas that step on their own: `hyparflow.replicas`)."""
        if self._views is not None:
            for k, view in enumerate(self._views):
                if view is not None and self.touched[k]:
                    view *= np.float32(factor)
        for pieces in self._slices.values():
            for j, (microbatch, indices, values) in enumerate(pieces):
                pieces[j] = (microbatch, indices, values * np.float32(factor))

    def reset_grads(self):
        self.touched[:] = False
        self.arrived[:] = False
        self._slices = {}

    def apply(self, optimizer, buckets, sparse=None):
        """Step `optimizer` with the reduced buffers of `flat_grads` (`buckets`: their
        positions) and `sparse`: {position: (indices, values) or a dense sum}."""
        grads = [None] * len(self.trainable)
        for k, view in self.reduced(buckets).items():
            grads[k] = _as_tensor(view)
        for k, value in (sparse or {}).items():
            grads[k] = value
        self._step(optimizer, grads)

    def reduced(self, buckets):
        """{position: its gradient buffer} of the variables of `buckets` whose flag
        (summed with the other ranks') says some rank had a gradient."""
        out = {}
        for positions in buckets:
            packing = self._buffers[tuple(positions)]
            for k, view, flag in zip(positions, packing.views, packing.flags):
                if flag > 0:
                    out[k] = view
        return out

    def grad_view(self, k):
        """Variable k's gradient buffer (None for a variable whose pairs are kept)."""
        if self._views is None:
            self._make_buffers()
        return self._views[k]

    def slices_of(self, k, pairs):
        return self._slices_of(k, pairs)

    def _slices_of(self, k, pairs):
        """(indices, values) -> the `tf.IndexedSlices` Keras would hand the optimizer."""
        indices, values = pairs
        v = self.trainable[k]
        return tf.IndexedSlices(tf.cast(values, v.dtype), tf.convert_to_tensor(indices),
                                tf.constant(tuple(v.shape), tf.int64))

    def _step(self, optimizer, grads):
        """When every variable got a gradient (the usual case) the step is one compiled
        call, as in Keras's own train function; otherwise the variables without one
        are skipped, as Keras skips them. Sparse gradients ((indices, values) pairs)
        go in as `tf.IndexedSlices`, as Keras's own train step passes them."""
        grads = [self._slices_of(k, g) if isinstance(g, tuple) else g
                 for k, g in enumerate(grads)]
        if grads and all(g is not None for g in grads):
            sparse = tuple(k for k, g in enumerate(grads) if isinstance(g, tf.IndexedSlices))
            key = ("direct", sparse)
            if key not in self._functions:
                self._functions[key] = compiled_step(optimizer, self.trainable, sparse,
                                                     self._eager)
            self._functions[key]([g if isinstance(g, tf.IndexedSlices) else tf.cast(g, v.dtype)
                                  for g, v in zip(grads, self.trainable)])
            return
        pairs = [(g, v) for g, v in zip(grads, self.trainable) if g is not None]
        if pairs:
            optimizer.apply_gradients(pairs)
