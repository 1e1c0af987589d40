"""The two speed-ups of a stage's Dense kernels (`kernels`): a kept `W^T` for the
input gradient, copied once a step where the rank would wait anyway, and the
kernel gradients deferred from the backward to W calls over several microbatches'
rows. `Stage` takes these methods."""

import time

import numpy as np
import tensorflow as tf

from . import kernels

__all__ = ["Deferred"]


class Deferred:
    """A stage's kept `W^T`s (`transposed`) and deferred kernel gradients (`deferred`,
    W): a mixin reading the stage's graph, shards, variables, buffers and functions."""

    def _transposed(self, graph, cut):
        """{node: kernels.Transposed} for the Dense calls whose input gradient is wanted."""
        if not kernels.enabled() or graph.functional is None:
            return {}
        out, made = {}, {}
        for i in cut.nodes:
            node = graph.nodes[i]
            if i in self.shards or len(node.inputs) != 1 or node.inputs[0] in cut.data_inputs:
                continue
            if kernels.eligible(node.op, graph.tensors[node.inputs[0]].dtype):
                if id(node.op) not in made:
                    made[id(node.op)] = kernels.Transposed(node.op)
                out[i] = made[id(node.op)]
        return out

    def _deferrable(self, graph, cut):
        """`kernels.deferred_nodes` of this stage, with each kernel's position."""
        positions = {id(v): k for k, v in enumerate(self.trainable)}
        return [(i, positions[id(graph.nodes[i].op.kernel)], shape)
                for i, shape in kernels.deferred_nodes(graph, cut.nodes, self.shards)
                if id(graph.nodes[i].op.kernel) in positions]

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
        """Before a training step's first microbatch: the kept `W^T`s are out of date
        (the optimizer stepped the kernels). Only backwards read them, so they are
        copied by `refresh_transposed` before the step's first backward, which the
        executor calls where the stage would wait anyway (a first stage waits for its
        first output gradient after its warm-up forwards)."""
        self._stale = bool(self.transposed)

    def refresh_transposed(self):
        """Copy the kernels into the kept `W^T`s if this step has not yet; returns how
        many were copied (0 when they are current)."""
        if not self._stale:
            return 0
        kept = {id(t): t for t in self.transposed.values()}.values()
        for t in kept:
            t.refresh()
        self._stale = False
        return len(kept)

    @property
    def waiting(self):
        """Microbatches whose deferred weight gradients W has yet to compute."""
        return self._kept.keys()

    def weight_seconds(self, microbatches):
        """The expected time of `weight_grads(microbatches)`: their rows at the seconds
        per row W took last (0 before the first W has run)."""
        rows = sum(int(self._kept[i][0][0].shape[0]) for i in microbatches
                   if i in self._kept and self._kept[i][0])
        return rows * self._w_per_row

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
        if self.grads.views is None:
            self.grads.make_buffers()
        for (_, k, _), g in zip(self.deferred, self._functions["weights"](xs, dys)):
            self.grads.add(k, np.asarray(g))
        if xs and xs[0].shape[0]:
            self._w_per_row = (time.perf_counter() - start) / int(xs[0].shape[0])
        self._lag(start)
