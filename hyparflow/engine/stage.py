"""One stage's computation in TensorFlow: forward under a tape, backward, gradient sums.

The forward runs the stage's layer calls (compiled with `tf.function`, batch
dimension `None`, so it traces once). Calling a compiled function under an
eager `GradientTape` makes TensorFlow keep the intermediates it needs and run
the backward as compiled code too, so there is neither recomputation nor
per-layer Python in the backward.

Here: the stage's set-up, the schedule's actions (forward, backward, W, fused), its
hooks and the gradients' way into the sums. What it computes is `body.StageBody`'s,
the sums and the optimizer step `grads.Gradients`', its timing `timing`'s.
"""

import functools
import time

import numpy as np
import tensorflow as tf

from .. import _compat
from . import customised as _customised
from . import masks as _masks
from . import norms
from .. import settings
from . import sparse as _sparse
from .body import StageBody
from .deferred import Deferred
from .compiled import spec, wants_xla
from .grads import Gradients

__all__ = ["Stage"]




class Stage(Deferred, StageBody):
    """Runs stage `cut.index` of `graph` for the user's `model`, on its own variables.

    Inputs are the model inputs this stage reads from data followed by the
    boundary tensors it receives (`input_ids`); outputs are the boundary
    tensors it sends (`output_ids`). The last stage also computes the compiled
    loss and metrics. Every forward returns `contribution`: the microbatch's
    loss (last stage) plus its layers' own losses (regularisers), scaled by the
    microbatch's share of the global batch, so that summing contributions and
    their gradients over microbatches and replicas gives the full batch's.
    """

    def __init__(self, graph, cut, model, partition, *, is_last, run_eagerly=False,
                 y_specs=(), sw_specs=(), per_output=False, recompute=False, shards=None,
                 accumulator=False):
        """`accumulator`: a stage that never computes, only holds a rank's gradient
        buffers and steps its variables (interleaved schedules: the rank's model
        chunks are each a `Stage` whose gradients go into it, see `sink_into`)."""
        self.graph, self.cut, self.model = graph, cut, model
        self.sink = None  # (stage, positions there) taking this stage's gradients
        self.is_last = is_last
        self.recompute = recompute
        self.input_ids = list(cut.data_inputs) + [e.tensor for e in cut.recv]
        self.output_ids = sorted({e.tensor for e in cut.send})
        # Keras masks (padding) cross with their tensors: inputs and outputs end with
        # the masks of these tensors, in this order. Recording the masks model.fit
        # sees (hyparflow.masks) comes first: it may find masks that only run-time
        # calls attach, which must cross too.
        if not accumulator:
            _masks.of(graph, True)
        self.mask_ids = [e.tensor for e in cut.recv if graph.tensors[e.tensor].mask is not None]
        self.output_mask_ids = [t for t in self.output_ids if graph.tensors[t].mask is not None]
        # Split layers (tensor parallelism): this rank trains its parts in place of
        # the layers' variables; `originals` are the model variables they stand for.
        self.shards = dict(shards or {})
        replaces = {k: v for shard in self.shards.values() for k, v in shard.replaces.items()}
        self.originals = graph.variables_of(cut.nodes, trainable=True)
        self.transposed = {} if accumulator else self._transposed(graph, cut)
        self.fused = {} if accumulator else norms.fused_nodes(graph, cut.nodes, self.shards)
        self._stale = False  # the kept W^Ts are older than the kernels (`begin_step`)
        self.trainable = [replaces.get(id(v), v) for v in self.originals]
        # Split backward (schedules with W actions, set by the executor per step): the
        # Dense (and EinsumDense) calls whose kernel gradients B leaves to W, as (node,
        # position in `trainable`, shape of the product's output without the batch).
        self.split = False
        self.deferred = [] if accumulator else self._deferrable(graph, cut)
        self._kept = {}  # microbatch -> (inputs, output gradients) of `deferred`, for W
        self._w_per_row = 0.0  # seconds per row of the last W (`weight_seconds`)
        self._zero_cache = {}
        # Layers whose own losses (regularisers, add_loss) this stage adds: a layer
        # shared with an earlier stage is counted there, once.
        self._loss_ops = []
        self._state = graph.variables_of(cut.nodes, trainable=False)
        seen = set()
        for i in cut.nodes:
            op = graph.nodes[i].op
            if id(op) in seen:
                continue
            seen.add(id(op))
            if not hasattr(op, "losses"):
                continue  # a plain operation: no weights, no losses
            weights = op.weights
            if not weights or all(partition.owner.get(id(v)) == cut.index for v in weights):
                self._loss_ops.append(op)
        # Gradients flow back only into received tensors; data inputs need none.
        # Random layers: a stable model-wide number for each seed generator, so a
        # microbatch's randomness depends on (seed, microbatch, generator), never on
        # which stage or rank runs it.
        numbers = {id(g): k for k, g in enumerate(_compat.seed_generators(model))}
        self._generators, seen_gen = [], set()
        for i in cut.nodes:
            for g in _compat.seed_generators(graph.nodes[i].op):
                if id(g) not in seen_gen:
                    seen_gen.add(id(g))
                    self._generators.append((numbers.get(id(g), len(numbers)), g))
        self._diff = [k for k, t in enumerate(self.input_ids)
                      if k >= len(cut.data_inputs) and graph.tensors[t].floating]
        self._saved = {}
        # This step's gradient sums, dense and sparse, and the optimizer step (grads.py).
        self.grads = Gradients(self.trainable, run_eagerly)
        self._keep_pairs = _sparse.enabled()
        # Who is told of each gradient a hook (`_arrive`) sums during the backward
        # (`grads.arrived`): the executor, to start allreduces early.
        self.on_arrival = None
        self.hooks = tuple(range(len(self.trainable)))  # whose gradients are reported
        self._in_specs = [spec(graph.tensors[t]) for t in self.input_ids]
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
        self.custom = _customised.Custom()
        self._eager = run_eagerly
        self._jit = wants_xla(model)
        self._functions = {}
        self._slowdown = settings.slowdown()

    def sink_into(self, stage):
        """Add this stage's variable gradients into `stage`'s buffers (which hold the
        same variables among others) instead of its own: one rank's model chunks
        share one set of buffers, one allreduce and one optimizer step. No hooks
        (gradients reported during a backward) and no split backward then."""
        where = {id(v): k for k, v in enumerate(stage.trainable)}
        self.sink = (stage, [where[id(v)] for v in self.trainable])

    def _lag(self, start):
        """HYPARFLOW_SLOWDOWN: act as a rank that many times slower (for tests of
        heterogeneous balancing)."""
        if self._slowdown > 1:
            time.sleep((self._slowdown - 1) * (time.perf_counter() - start))

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
        self.grads.add(k, g if g.dtype == np.float32 else g.astype(np.float32))
        self.grads.arrived[k] = True
        if self.on_arrival is not None:
            self.on_arrival(k)
        return g

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
        self.refresh_transposed()  # the executor has done it, unless it had no wait
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

    def forward_backward(self, i, inputs, y=(), sample_weight=(), share=1.0, seed=None,
                         hooked=False):
        """Forward and backward of microbatch `i` in one compiled call, for a stage
        whose backward can follow its forward at once (the last stage, under 1F1B or
        with one stage): no tape crosses calls. Returns (gradients of the received
        inputs by tensor id, loss contribution)."""
        start = time.perf_counter()
        self.refresh_transposed()
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

    # -- timing, for the planner ------------------------------------------------
    def seeded_step(self, inputs, seeds):
        """Forward and backward in one call, `seeds` the floating outputs' gradients,
        summed into the buffers and then cleared: a stage timed alone as a last stage
        runs under 1F1B (`timing`)."""
        function = self._fused(False, (), seeded=True)
        start = time.perf_counter()
        self._ready()
        _, result = function(inputs, [], [], tf.constant(1.0), seeds)
        self._accumulate(result, [inputs[k] for k in self._diff])
        self.grads.reset()
        self._lag(start)

    def drop(self, i):
        """Forget microbatch `i`'s forward: its backward will not come."""
        self._saved.pop(i, None)

    def _ready(self):
        """Before a backward: the buffers exist, and no gradient has arrived yet."""
        if self.grads.views is None and self.sink is None:  # a sink's buffers hold its sums
            self.grads.make_buffers()
        self.grads.arrived[:] = False

    def _accumulate(self, result, diff_inputs, microbatch=0):
        """Add the variables' part of `result` to the gradient buffers (those a hook
        has not already added), or keep it as microbatch `microbatch`'s (row, value)
        pairs when it is sparse (see `hyparflow.sparse`); return the inputs' part."""
        n = len(self.trainable)
        into, where = self.sink if self.sink is not None else (self, range(n))
        sums = into.grads
        if sums.views is None:
            sums.make_buffers()
        for k, g in enumerate(result[:n]):
            if g is None or self.grads.arrived[k]:
                continue
            if isinstance(g, tf.IndexedSlices) and not self._keep_pairs:
                g = tf.convert_to_tensor(g)
            if isinstance(g, tf.IndexedSlices):
                if self.grads.fixed is None:
                    self._find_fixed(into, where)
                values = g.values if g.values.dtype == tf.float32 else tf.cast(g.values, tf.float32)
                sums.keep(where[k], microbatch, np.asarray(g.indices, np.int64), np.asarray(values))
                continue
            sums.hold(where[k], g if g.dtype == tf.float32 else tf.cast(g, tf.float32))
        grads_in = {}
        for k, g in zip(self._diff, result[n:]):
            t = self.input_ids[k]
            if g is None:
                g = tf.zeros_like(diff_inputs[self._diff.index(k)])
            grads_in[t] = g
        return grads_in
