"""A stage timed as the executor runs it, for the planner (`measure`, `probes`): random
inputs of a batch, a taped forward and the backward from it (or both in one call)."""

import numpy as np
import tensorflow as tf

from ..clock import timed
from ..graph import sized

__all__ = ["example", "time"]


def example(stage, batch):
    """Random inputs of `batch` samples for this stage, and ones as its floating
    outputs' gradients (a dimension left open as `graph.sized` fills it)."""
    tensors = stage.graph.tensors
    inputs = [tf.random.normal(sized(tensors[t].shape, batch),
                               dtype=tf.as_dtype(tensors[t].dtype))
              if tensors[t].floating else tf.zeros(sized(tensors[t].shape, batch),
                                                   tf.as_dtype(tensors[t].dtype))
              for t in stage.input_ids]
    inputs += [tf.ones(sized(tensors[t].mask, batch), tf.bool) for t in stage.mask_ids]
    seeds = {t: np.ones(sized(tensors[t].shape, batch), np.float32)
             for t in stage.output_ids if tensors[t].floating}
    return inputs, seeds


def time(stage, batch, *, fused=False, repeats=9, idle=0.0, ready=None):
    """(forward, backward) seconds of one microbatch of `batch` random samples, as
    the executor runs it: the forward kept on a tape and the backward from it,
    with ones as the outputs' gradients, the weights' gradients summed into the
    buffers; `fused`: (0, both in one call), as a last stage under 1F1B runs.
    Each the median of `repeats` calls, each after `idle` seconds asleep (a
    stage's call follows a wait). HYPARFLOW_SLOWDOWN counts, as in training.
    `ready()`: called after the untimed first call (tensor ranks meet there, so
    that no timed call waits for a peer still tracing its first)."""
    inputs, seeds = example(stage, batch)
    if fused:
        flat = [tf.convert_to_tensor(seeds[t]) for t in stage.output_ids if t in seeds]

        def step():
            stage.seeded_step(inputs, flat)

        step()
        if ready is not None:
            ready()
        return 0.0, timed(step, repeats, idle)

    def forward():
        stage.forward(0, inputs)
        stage.drop(0)

    def both():
        stage.forward(0, inputs)
        stage.backward(0, seeds)
        stage.grads.reset()

    both()
    if ready is not None:
        ready()
    whole = timed(both, repeats, idle)
    ahead = min(timed(forward, repeats, idle), whole)
    return ahead, whole - ahead
