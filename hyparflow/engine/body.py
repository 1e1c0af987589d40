"""What a stage computes: its layer calls run as `Functional.call` runs them, the
loss and metrics on the last stage, the layers' own losses, and the microbatch's
contribution (see `Stage`). A base class of `Stage`, which sets the attributes used
here (its `__init__`); the schedule's actions, tapes and gradient sums are stage.py's."""

import numpy as np
import tensorflow as tf

from .. import _compat
from . import sparse as _sparse
from . import customised as _customised
from . import kernels
from . import masks as _masks
from .compiled import Hooked, XLAOrPlain, spec

__all__ = ["StageBody"]

_PRODUCED = "produced masks"  # the key of `_run_nodes`' masks by tensor


def _kept_per_sample(args, part, seen):
    """Bytes per sample of the values a layer call takes as inputs, which its backward
    keeps (each value once, `seen`); a part of a split layer that holds less (the
    mesh's blocks) says its own (`kept_per_row`). Unknown lengths count as 1."""
    if part is not None and hasattr(part, "kept_per_row"):
        return part.kept_per_row(args, seen)
    total = 0.0
    for x in tf.nest.flatten(args):
        if (tf.is_tensor(x) and x.dtype.is_floating and x.shape.rank is not None
                and id(x) not in seen):
            seen.add(id(x))
            total += float(np.prod([d or 1 for d in x.shape.as_list()[1:]])) * x.dtype.size
    return total


class StageBody:
    """The computation of a stage (mixed into `Stage`)."""

    def _compile(self, fn, signature):
        """`fn` as the stage runs it: eager when asked, else a `tf.function` with a `None`
        batch dimension, XLA-compiled when the model asks for it (`_wants_xla`) and the
        stage allows it (no split layer's exchange, no length known only at run time)."""
        if self._eager:
            return fn
        plain = tf.function(fn, input_signature=signature, reduce_retracing=True,
                            autograph=False)
        if not self._jit or self.shards or any(
                t.dynamic for t in (self.graph.tensors[i] for i in self.input_ids)):
            return plain
        return XLAOrPlain(tf.function(fn, input_signature=signature, jit_compile=True,
                                        autograph=False), plain)

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
        kept_bytes, seen = 0.0, set()
        for i in self.cut.nodes:
            node = g.nodes[i]
            if run is not None:
                for t, present in run.present[i].items():
                    _compat.set_mask(values[id(g.tensors[t].keras_tensor)],
                                     produced.get(t) if present else None)
            args, kwargs = _compat.fill_in(node.keras_node, values)
            kept_bytes += _kept_per_sample(args, self.shards.get(i), seen)
            if i in self.shards:
                out = self.shards[i](args, kwargs, training)
            elif i in z_of and training:
                out, x = kernels.deferred_call(node.op, args, kwargs, z_of[i],
                                               self.transposed.get(i))
                kept.append(x)
            elif i in self.transposed and training:
                out = self.transposed[i](args, kwargs)
            elif i in self.fused and training:
                out = self.fused[i](args, kwargs)
            else:
                out = _compat.call_operation(node.op, args, kwargs, training)
            for t, kt, v in zip(node.outputs, node.keras_node.outputs, _compat.tree.flatten(out)):
                values[id(kt)] = v
                produced[t] = _compat.get_mask(v)
        values[_PRODUCED] = produced
        if training:  # counted as the function is traced (or run eagerly)
            self.kept_per_sample = kept_bytes
        if run is not None and self.is_last:
            for t in self.cut.outputs:  # as the loss finds them in model.fit
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
        scope = Hooked([(v, self._hook(k, v.value) if k in hooked else v.value)
                         for k, v in enumerate(self.trainable)])
        with scope:
            result = self._compute(inputs, y, sample_weight, share, kind, zs)
        scope.write_back()
        return result

    def _fused(self, has_sample_weight, hooked=(), seeded=False):
        """Forward and backward in one compiled call, for `timing`: differentiates the
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

            seeds = [spec(self.graph.tensors[t]) for t in self.output_ids
                     if self.graph.tensors[t].floating] if seeded else []
            signature = self._signature(True, has_sample_weight) + [seeds]
            self._functions[key] = self._compile(fused, signature)
        return self._functions[key]

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
            flat_pred = [self._value(values, t) for t in self.cut.outputs]
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
        if sample_weight and not self._sw_specs and kind != "predict":
            # Validation data with sample weights, training data without: Keras
            # weighs the validation loss by them, so the evaluation takes them.
            self._sw_specs = [tf.TensorSpec((None,) + tuple(np.shape(a)[1:]), tf.float32)
                              for a in sample_weight]
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
                             input_signature=signature, autograph=False)
        handles = {id(_compat.variable_handle(v)): k for k, v in enumerate(self.trainable)}
        found = _sparse.fixed_lookups(fn.get_concrete_function().graph, handles)
        self.grads.fixed = found
        into.grads.fixed = (into.grads.fixed or set()) | {where[k] for k in found}
