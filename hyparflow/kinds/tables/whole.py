"""The Keras variable of a sharded table while `fit` runs. Keras builds every table
whole on every rank; a rank trains only its part (`part.TablePart`), so from the
first step to the end of training the whole table would only take memory: for a
table larger than one rank should hold, it would defeat the sharding. `empty`
replaces the variable's storage by a tensor of no rows (same variable, same
resource handle: functions that captured it stay valid), and `fill` puts the whole
table back (gathered from the owners) before the `on_train_end` callbacks, when
`fit` returns.

Meanwhile the variable holds no rows: `model.get_weights()` in a callback gives the
table with shape (0, output_dim), and assigning it fails (TensorFlow's shape error).
Keras's callbacks that read or restore the whole model mid-fit (`ModelCheckpoint`,
`BackupAndRestore`, `EarlyStopping(restore_best_weights=True)`, `SwapEMAWeights`)
are refused up front, naming `checkpoint_dir` (whose checkpoints hold the whole
tables, gathered from the owners) instead of writing tables with no rows."""

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


_REFUSED = (keras.callbacks.ModelCheckpoint, keras.callbacks.BackupAndRestore,
            getattr(keras.callbacks, "SwapEMAWeights", ()))


def check_callbacks(callbacks):
    """Refuse the Keras callbacks that read or set the whole model during fit."""
    for cb in callbacks or ():
        name = type(cb).__name__
        if isinstance(cb, _REFUSED) or (isinstance(cb, keras.callbacks.EarlyStopping)
                                        and cb.restore_best_weights):
            what = (f"{name}(restore_best_weights=True)"
                    if isinstance(cb, keras.callbacks.EarlyStopping) else name)
            raise ValueError(
                f"{what} reads or sets the model's weights during fit, but with "
                "embedding_sharding a sharded table's Keras variable holds no rows until fit "
                "returns (each rank keeps only the rows it owns: docs/recommenders.md). Use "
                "hf.fit(..., checkpoint_dir=...) instead (its checkpoints hold the whole "
                "tables, gathered from their owners), or save the model after fit.")
