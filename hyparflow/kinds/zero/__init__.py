"""ZeRO stage 1: the replicas of a stage share out the optimizer step and its state.

Without it every replica sums the gradients (an allreduce), then steps the
optimizer for every variable, each holding the whole optimizer state. Here each
variable that a group of ranks sums is cut by rows (its first axis) into one
part per rank, so that every rank owns about 1/R of the group's elements
(balanced over the variables in the model's order, cut only at row boundaries:
most variables have one owner, at most R - 1 are cut between two). A step:

1. reduce to the owner: each rank sends the rows it does not own to their
   owner (point-to-point, from the gradient buffers without a copy); the owner
   adds the R contributions in rank order (started per bucket, as the
   allreduces were, so they can start inside the backward);
2. the owner steps the Keras optimizer for its parts only: the optimizer is
   built on part variables (named as the variables, so its slots carry the
   same names), so its state per rank divides by R;
3. the owner sends its parts' new values to the other ranks (into the gradient
   buffers, which are free by then), and every rank assigns every variable.

Bytes moved per rank are those of a ring allreduce ((R-1)/R of the gradients
each way); the optimizer's work divides by R.

With HYPARFLOW_SHARED_SUMS=1, where the group's ranks share a node's window
(`engine.shm`), steps 1 and 3 go through memory instead (`reduce.Reduce`, `Zero.gather`): each rank writes its bucket into
its own slot once, each owner adds its rows over every slot in rank order, and
writes its parts' new values into its slot, from which the others copy them. Parts
stepped whole are summed there in even runs that every rank gets; without them a
piece takes two phases, not three (no rank copies another's sum). A
group spanning nodes keeps the messages (its owners' rows are cut over the group,
not the node).

Modules: `step` (the parts, the step, the gather, checkpoints), `reduce` (how the
sums reach the owners).

The contract holds because the optimizers allowed are element-wise (`ALLOWED`):
an element's update depends only on its own gradient, state and value, and on
the iteration counter, which every rank advances once per step. A sparse
(Embedding) gradient's (row, value) pairs are filtered to the owner's rows,
keeping their order, so Adam & co. see the same pairs per row as in `model.fit`.
Features that need a whole variable or all of them (clipnorm, global_clipnorm,
constraints, gradient accumulation) fall back to the unsharded step (`why_not`).
`use_ema` is element-wise too: each owner keeps the averages of its rows, and the
end of `fit` (`Runtime.finalize_optimizer`) sends them out as a step's new values.
Parts of layers split by tensor parallelism are stepped whole (they are already 1/T
of the layer).
"""

import numpy as np

from ... import settings
from .step import VARIABLE_COST, Zero, ownership

__all__ = ["enabled", "pays", "why_not", "ownership", "Zero", "ALLOWED", "VARIABLE_COST"]

# Keras optimizers whose update is element-wise (their exact classes: a subclass
# may override update_step).
ALLOWED = ("SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "Adamax", "Lion")



def enabled():
    """HYPARFLOW_ZERO: True ("1") shard the optimizer step across replicas, False
    ("0") do not, None ("auto", the default) where it `pays`."""
    return settings.zero()


def pays(stage, optimizer, ranks_on_node=1):
    """Whether sharding is worth it for this stage by default. Its bytes moved are an
    allreduce's, its gain the optimizer's work and state divided by R; the gather
    costs a copy and an assignment of every variable. Measured (2 replicas on one
    node, docs/performance.md): slower for an MLP (45 vs 40 ms a step) and ResNet-110
    (200 vs 185 ms), faster where the optimizer steps far more than the gradients
    move: an Embedding table, whose Adam step updates every row for the few rows a
    batch looked up (75 vs 109 ms). Shared too when the whole optimizer state would
    take more than 1/8 of a rank's share of the machine's memory."""
    import keras

    for i in stage.cut.nodes:
        op = stage.graph.nodes[i].op
        if isinstance(op, keras.layers.Embedding) and op.trainable:
            return True
    slots = max(1, len(getattr(optimizer, "variables", ())) // max(1, len(stage.trainable)))
    state = sum(4 * int(np.prod(v.shape)) for v in stage.trainable) * (1 + max(slots, 2))
    memory = _memory()
    return bool(memory) and state > memory / max(1, ranks_on_node) / 8


def _memory():
    import os

    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def why_not(optimizer, variables):
    """Why the optimizer step cannot be sharded by rows (a sentence), or None."""
    import keras

    cls = type(optimizer)
    if not any(cls is getattr(keras.optimizers, name, None) for name in ALLOWED):
        return (f"{cls.__name__} is not one of the element-wise Keras optimizers "
                f"{', '.join(ALLOWED)}")
    for name in ("clipnorm", "global_clipnorm"):
        if getattr(optimizer, name, None):
            return f"{name} needs the norm of whole gradients"
    if getattr(optimizer, "gradient_accumulation_steps", None):
        return "gradient_accumulation_steps keeps whole gradients"
    for v in variables:
        if getattr(v, "constraint", None) is not None:
            return f"variable {v.path!r} has a constraint, applied to the whole variable"
    return None


def knows(optimizer, variables):
    """Whether a built optimizer steps exactly these variables (among others)."""
    known = {id(v) for v in getattr(optimizer, "_trainable_variables", ())}
    return all(id(v) in known for v in variables)


def check_knows(optimizer, variables):
    """A clear error when a built optimizer was built for other variables."""
    if knows(optimizer, variables):
        return
    raise ValueError(
        "The model's optimizer was built for other variables by an earlier fit (another "
        "num_tensor, tensor_shares, or number of replicas with the optimizer step sharded, "
        "HYPARFLOW_ZERO). Compile the model again (model.compile(...)) to start a new "
        "optimizer, or keep the earlier settings (a checkpoint carries the optimizer state "
        "to any layout).")
