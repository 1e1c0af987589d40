"""The members' optimizers as one: SGD (momentum, Nesterov), Adam, AdamW and RMSprop
(momentum, centered) over the array's stacked variables, with each member's own
hyper-parameters (learning rate or schedule, momentum, betas, epsilon, rho, weight
decay, clipping) as per-member vectors.

Each update mirrors the Keras optimizer's own `update_step`, op for op with
`keras.ops`, the Python floats Keras multiplies by taken as it takes them (float32;
`1 - beta` computed in double first), so every member ends where its own `model.fit`
ends. A per-member vector is shaped to broadcast against a variable
(`variables.Stacked.broadcast`); Keras's sparse ops gather it by row for an Embedding's
(row, value) gradient, as they apply the member's scalar to each pair.
"""

import keras
import numpy as np
import tensorflow as tf
from keras import ops

from .. import _compat

__all__ = ["FUSED", "fuse", "Fused"]


def _assign(variable, value):
    """TFOptimizer.assign: a sparse value is scattered."""
    value = tf.cast(value, variable.dtype)
    if isinstance(value, tf.IndexedSlices):
        variable.scatter_update(value)
    else:
        variable.assign(value)


def _assign_add(variable, value):
    value = tf.cast(value, variable.dtype)
    if isinstance(value, tf.IndexedSlices):
        variable.scatter_add(value)
    else:
        variable.assign_add(value)


def _assign_sub(variable, value):
    value = tf.cast(value, variable.dtype)
    if isinstance(value, tf.IndexedSlices):
        variable.scatter_sub(value)
    else:
        variable.assign_sub(value)


def _f32(values):
    return np.asarray(values, np.float64).astype(np.float32)


class Fused:
    """The optimizers of the array's members (by position) stepping the array's trainable
    variables (`entries`: variables.Stacked / Owned) at once."""

    keras_classes: tuple = ()
    slots: tuple = ()     # (state name, attribute of the Keras optimizer holding it)

    def __init__(self, optimizers, entries, describe):
        self.optimizers = list(optimizers)
        self.n = len(self.optimizers)
        self.entries = list(entries)
        self.describe = describe
        self.iterations = tf.Variable(
            np.array([int(o.iterations.numpy()) for o in self.optimizers], np.int64),
            trainable=False, name="sweep_iterations")
        self._read_clipping()
        self.read()
        self.decay = [self._decay(entry) for entry in self.entries]
        self.state = {name: [self._slot_variable(entry, attribute) for entry in self.entries]
                      for name, attribute in self.slots if self.keeps(name)}

    # set-up -----------------------------------------------------------------------------
    def read(self):
        """Read the members' hyper-parameters (per class)."""

    def keeps(self, name):
        """Whether the array keeps the state `name` (some member's optimizer uses it)."""
        return True

    def floats(self, name):
        """The members' hyper-parameter `name` as float64 numbers (an error names the
        member whose value is not a number)."""
        out = []
        for p, o in enumerate(self.optimizers):
            value = getattr(o, name)
            try:
                out.append(float(value))
            except (TypeError, ValueError):
                raise ValueError(f"{self.describe(p)}'s optimizer has {name}={value!r}: a sweep "
                                 "takes numbers for it (the learning rate may be a schedule).") \
                    from None
        return np.array(out, np.float64)

    def flags(self, name):
        return np.array([bool(getattr(o, name)) for o in self.optimizers])

    def _read_clipping(self):
        kinds = []
        for o in self.optimizers:
            kinds.append(next((k for k in ("clipnorm", "global_clipnorm", "clipvalue")
                               if getattr(o, k, None)), None))
        if len(set(kinds)) > 1:
            p = next(p for p, k in enumerate(kinds) if k != kinds[0])
            raise ValueError(f"{self.describe(p)}'s optimizer clips with {kinds[p]} where "
                             f"member 0's clips with {kinds[0]}: the members of a sweep must "
                             "clip alike (the values may differ).")
        self.clip_kind = kinds[0]
        self.clip_values = _f32(self.floats(self.clip_kind)) if self.clip_kind else None

    def _decay(self, entry):
        """Per-member weight decay of `entry` (0 where a member has none or excludes it)."""
        values = np.zeros(self.n)
        for original, p in zip(entry.originals, entry.positions):
            o = self.optimizers[p]
            if o.weight_decay is not None and o._use_weight_decay(original):
                values[p] = o.weight_decay
        return _f32(values) if values.any() else None

    def _slot_variable(self, entry, attribute):
        values = []
        for original, p in zip(entry.originals, entry.positions):
            slot = _compat.optimizer_slot(self.optimizers[p], attribute, original)
            values.append(np.asarray(slot.numpy()) if slot is not None
                          else np.zeros(entry.shape, entry.dtype))
        return tf.Variable(entry.storage(np.stack(values)), trainable=False)

    # the step ---------------------------------------------------------------------------
    def learning_rates(self):
        """[n] float32: each member's learning rate at its step (schedules included)."""
        return tf.stack([tf.cast(_compat.learning_rate(o, self.iterations[p]), tf.float32)
                         for p, o in enumerate(self.optimizers)])

    def vector(self, values, entry):
        """A per-member vector (numpy [n]) shaped for `entry`."""
        return entry.broadcast(tf.constant(values))

    def apply(self, grads):
        """One step of every member: Keras's order (clip, weight decay, update, then the
        caller's constraints), the learning rate read before the step's count."""
        pairs = [(g, k) for k, g in enumerate(grads) if g is not None]
        if not pairs:
            return
        lr = self.learning_rates()
        clipped = self._clip([g for g, _ in pairs], [self.entries[k] for _, k in pairs])
        for _, k in pairs:
            if self.decay[k] is not None:
                entry = self.entries[k]
                variable = entry.variable
                variable.assign_sub(variable * self.vector(self.decay[k], entry)
                                    * entry.broadcast(lr))
        for g, (_, k) in zip(clipped, pairs):
            entry = self.entries[k]
            self.update(ops.cast(g, entry.variable.dtype), entry, k, entry.broadcast(lr))
        self.iterations.assign_add(tf.ones_like(self.iterations))

    def update(self, gradient, entry, k, lr):
        raise NotImplementedError

    def _clip(self, grads, entries):
        if self.clip_kind is None:
            return grads
        if any(isinstance(g, tf.IndexedSlices) for g in grads):
            raise NotImplementedError(
                f"{self.clip_kind} with an Embedding's sparse gradient: a sweep does not clip "
                "(row, value) pairs as Keras does. Use clipvalue=None/clipnorm=None, or train "
                "these models one by one.")
        if self.clip_kind == "clipvalue":
            return [ops.clip(g, -self.vector(self.clip_values, e), self.vector(self.clip_values, e))
                    for g, e in zip(grads, entries)]
        if self.clip_kind == "clipnorm":
            out = []
            for g, e in zip(grads, entries):
                # tf.clip_by_norm over each member's part of the variable.
                clip = self.vector(self.clip_values, e)
                l2sum = e.broadcast(e.member_sums(g * g))
                pred = l2sum > 0
                l2sum_safe = tf.where(pred, l2sum, tf.ones_like(l2sum))
                l2norm = tf.where(pred, tf.sqrt(l2sum_safe), l2sum)
                out.append(tf.identity(g * clip / tf.maximum(l2norm, clip)))
            return out
        # global_clipnorm: keras.optimizers' clip_by_global_norm over each member's grads.
        squared = tf.reduce_sum(tf.stack([e.member_sums(ops.square(g))
                                          for g, e in zip(grads, entries)]), axis=0)
        norm = ops.sqrt(squared)
        clip = tf.constant(self.clip_values)
        scale = clip * ops.minimum(1.0 / norm, 1.0 / clip) + (norm - norm)
        return [g * e.broadcast(scale) for g, e in zip(grads, entries)]

    # back to the members ---------------------------------------------------------------
    def write_back(self):
        """Each member's Keras optimizer takes its state in the array (its step count,
        momenta, velocities), so the returned model can go on training alone."""
        iterations = self.iterations.numpy()
        for o, i in zip(self.optimizers, iterations):
            o.iterations.assign(i)
        for name, attribute in self.slots:
            for entry, variable in zip(self.entries, self.state.get(name, ())):
                grouped = entry.grouped(variable).numpy()
                for index, (original, p) in enumerate(zip(entry.originals, entry.positions)):
                    slot = _compat.optimizer_slot(self.optimizers[p], attribute, original)
                    if slot is not None:
                        slot.assign(grouped[index])


class SGD(Fused):
    keras_classes = (keras.optimizers.SGD,)
    slots = (("momentum", "momentums"),)

    def read(self):
        self.momentum = _f32(self.floats("momentum"))
        self.nesterov = self.flags("nesterov")

    def keeps(self, name):
        return bool(self.momentum.any())

    def update(self, gradient, entry, k, lr):
        variable = entry.variable
        if "momentum" not in self.state:
            _assign_sub(variable, ops.multiply(gradient, lr))
            return
        m = self.state["momentum"][k]
        momentum = self.vector(self.momentum, entry)
        _assign(m, ops.subtract(ops.multiply(m, momentum), ops.multiply(gradient, lr)))
        if self.nesterov.all():
            _assign_add(variable, ops.subtract(ops.multiply(m, momentum),
                                               ops.multiply(gradient, lr)))
        elif not self.nesterov.any():
            _assign_add(variable, m)
        else:
            nesterov = tf.cast(self.vector(self.nesterov.astype(np.float32), entry), tf.bool)
            step = ops.subtract(ops.multiply(m, momentum), ops.multiply(gradient, lr))
            _assign_add(variable, tf.where(nesterov, step, tf.convert_to_tensor(m)))


class Adam(Fused):
    """Adam and AdamW (AdamW is Adam with the base optimizer's weight decay)."""

    keras_classes = (keras.optimizers.Adam, keras.optimizers.AdamW)
    slots = (("momentum", "_momentums"), ("velocity", "_velocities"),
             ("velocity_hat", "_velocity_hats"))

    def read(self):
        self.amsgrad = self.flags("amsgrad")
        b1, b2 = self.floats("beta_1"), self.floats("beta_2")
        self.beta_1, self.beta_2 = _f32(b1), _f32(b2)
        self.one_minus_beta_1, self.one_minus_beta_2 = _f32(1 - b1), _f32(1 - b2)
        self.epsilon = _f32(self.floats("epsilon"))

    def keeps(self, name):
        return name != "velocity_hat" or bool(self.amsgrad.any())

    def update(self, gradient, entry, k, lr):
        variable = entry.variable
        local_step = entry.broadcast(ops.cast(self.iterations + 1, variable.dtype))
        beta_1_power = ops.power(self.vector(self.beta_1, entry), local_step)
        beta_2_power = ops.power(self.vector(self.beta_2, entry), local_step)
        m, v = self.state["momentum"][k], self.state["velocity"][k]
        alpha = lr * ops.sqrt(1 - beta_2_power) / (1 - beta_1_power)
        _assign_add(m, ops.multiply(ops.subtract(gradient, m),
                                    self.vector(self.one_minus_beta_1, entry)))
        _assign_add(v, ops.multiply(ops.subtract(ops.square(gradient), v),
                                    self.vector(self.one_minus_beta_2, entry)))
        v_used = tf.convert_to_tensor(v)
        if self.amsgrad.any():
            v_hat = self.state["velocity_hat"][k]
            _assign(v_hat, ops.maximum(v_hat, v))
            amsgrad = tf.cast(self.vector(self.amsgrad.astype(np.float32), entry), tf.bool)
            v_used = tf.where(amsgrad, tf.convert_to_tensor(v_hat), v_used)
        _assign_sub(variable, ops.divide(ops.multiply(m, alpha),
                                         ops.add(ops.sqrt(v_used),
                                                 self.vector(self.epsilon, entry))))


class RMSprop(Fused):
    keras_classes = (keras.optimizers.RMSprop,)
    slots = (("velocity", "_velocities"), ("momentum", "_momentums"),
             ("average_gradient", "_average_gradients"))

    def read(self):
        self.centered = self.flags("centered")
        self.momentum = _f32(self.floats("momentum"))
        rho = self.floats("rho")
        self.rho, self.one_minus_rho = _f32(rho), _f32(1 - rho)
        self.epsilon = _f32(self.floats("epsilon"))

    def keeps(self, name):
        if name == "momentum":
            return bool((self.momentum > 0).any())
        if name == "average_gradient":
            return bool(self.centered.any())
        return True

    def update(self, gradient, entry, k, lr):
        variable = entry.variable
        velocity = self.state["velocity"][k]
        rho, one_minus_rho = self.vector(self.rho, entry), self.vector(self.one_minus_rho, entry)
        epsilon = self.vector(self.epsilon, entry)
        _assign(velocity, ops.add(ops.multiply(rho, velocity),
                                  ops.multiply(one_minus_rho, ops.square(gradient))))
        plain = ops.add(velocity, epsilon)
        if "average_gradient" in self.state:
            average = self.state["average_gradient"][k]
            _assign(average, ops.add(ops.multiply(rho, average),
                                     ops.multiply(one_minus_rho, gradient)))
            centered = tf.convert_to_tensor(velocity) - ops.square(average) + epsilon
            flag = tf.cast(self.vector(self.centered.astype(np.float32), entry), tf.bool)
            denominator = tf.where(flag, centered, plain)
        else:
            denominator = plain
        increment = ops.divide(ops.multiply(lr, gradient), ops.sqrt(denominator))
        if "momentum" in self.state:
            momentum = self.state["momentum"][k]
            _assign(momentum, ops.add(ops.multiply(self.vector(self.momentum, entry), momentum),
                                      increment))
            _assign_sub(variable, momentum)
        else:
            _assign_sub(variable, increment)


FUSED = (SGD, Adam, RMSprop)


def fuse(optimizers, entries, describe):
    """The Fused optimizer for the members' `optimizers` (one class for all), or an error
    naming the member and what a sweep cannot fuse."""
    first = type(optimizers[0])
    for p, o in enumerate(optimizers):
        if isinstance(o, keras.optimizers.LossScaleOptimizer):
            raise NotImplementedError(
                f"{describe(p)}'s optimizer is a LossScaleOptimizer (mixed_float16): a sweep "
                "trains in float32. Drop the mixed precision policy for the sweep.")
        if type(o) is not first:
            raise ValueError(f"{describe(p)}'s optimizer is {type(o).__name__} where member 0's "
                             f"is {first.__name__}: the members of a sweep share the optimizer "
                             "class (its arguments may differ).")
        for option in ("use_ema", "gradient_accumulation_steps", "loss_scale_factor"):
            if getattr(o, option, None):
                raise NotImplementedError(
                    f"{describe(p)}'s optimizer has {option}={getattr(o, option)!r}, which a "
                    "sweep does not fuse. Leave it out, or train these models one by one.")
    for fused in FUSED:
        if first in fused.keras_classes:
            return fused(optimizers, entries, describe)
    raise NotImplementedError(
        f"The members' optimizer {first.__name__} has no fused version: a sweep fuses "
        f"{', '.join(c.__name__ for f in FUSED for c in f.keras_classes)}.")
