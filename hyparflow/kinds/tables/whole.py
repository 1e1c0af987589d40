"""The Keras variable of a sharded table while `fit` runs. Keras builds every table
whole on every rank; a rank trains only its part (`part.TablePart`), so from the
first step to the end of training the whole table would only take memory: for a
table larger than one rank should hold, it would defeat the sharding. `empty`
replaces the variable's storage by a tensor of no rows (same variable, same
resource handle: functions that captured it stay valid), and `fill` puts the whole
table back (gathered from the owners) before the `on_train_end` callbacks, when
`fit` returns.

Meanwhile the variable holds no rows, except at an epoch's end: when `fit` has
callbacks of the user's, the tables are gathered back whole before `on_epoch_end`
(so `ModelCheckpoint`, `EarlyStopping(restore_best_weights=True)`, `BackupAndRestore`
and a user's own callback see the whole model, as with `model.fit`) and dropped again
after it. Within an epoch `model.get_weights()` gives a sharded table with shape
(0, output_dim): the callbacks that save or restore the model every N batches
(`save_freq=N`) and `SwapEMAWeights` (the owners' optimizer keeps no average of the
whole table) are refused up front, naming what to use instead."""

import ctypes

import keras
import numpy as np
import tensorflow as tf

from ... import _compat

__all__ = ["store", "empty", "fill", "trim", "check_callbacks"]


def store(variable, value):
    """Put `value` (any number of rows) in the storage of Keras `variable`: Keras's
    `assign` checks the shape; the resource's own assignment does not have to."""
    tf.raw_ops.AssignVariableOp(resource=_compat.variable_handle(variable),
                                value=tf.convert_to_tensor(value, dtype=variable.dtype),
                                validate_shape=False)


def empty(part):
    """Drop the whole table behind `part` (a `TablePart`) on this rank: its variable
    keeps its shape but holds no rows."""
    if not part.emptied:
        table = part.op.embeddings
        store(table, np.zeros((0,) + tuple(table.shape[1:]), np.dtype(table.dtype)))
        part.emptied = True


def fill(part):
    """The whole table back into its variable, from every rank's rows (collective)."""
    store(part.op.embeddings, part.gathered(part.variable.numpy(), 0))
    part.emptied = False


def trim():
    """Give freed memory back to the system now: glibc keeps freed blocks below its
    mmap threshold (which grows up to 32 MB) in the heap, so a dropped table of a
    few MB would stay resident. Nothing where there is no glibc."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def reads_weights(callbacks):
    """Whether `fit`'s callbacks include any of the user's (which may read or save
    the model at an epoch's end): then the tables are whole for `on_epoch_end`."""
    return any(not isinstance(cb, (keras.callbacks.History, keras.callbacks.ProgbarLogger))
               for cb in callbacks or ())


def check_callbacks(callbacks):
    """Refuse the Keras callbacks that read or set the whole model within an epoch."""
    for cb in callbacks or ():
        name = type(cb).__name__
        swap = getattr(keras.callbacks, "SwapEMAWeights", None)
        batches = (isinstance(cb, (keras.callbacks.ModelCheckpoint,
                                   keras.callbacks.BackupAndRestore))
                   and getattr(cb, "save_freq", "epoch") != "epoch")
        if batches or (swap is not None and isinstance(cb, swap)):
            what = f"{name}(save_freq={cb.save_freq!r})" if batches else name
            raise ValueError(
                f"{what} reads or sets the model's weights within an epoch, but with "
                "embedding_sharding a sharded table's Keras variable holds no rows between "
                "epoch ends (each rank keeps only the rows it owns: docs/recommenders.md). "
                + ("Use save_freq='epoch', or hf.fit(..., checkpoint_dir=..., "
                   "checkpoint_every=N) (its checkpoints hold the whole tables, gathered "
                   "from their owners)." if batches else
                   "Leave it out with embedding_sharding, or set embedding_sharding=None."))
