"""Inputs read by the rows a batch needs, in the dtype the model takes.

An array-like (`np.memmap`, an h5py or zarr dataset) is never loaded or cast whole:
each batch reads its rows and casts just them, as Keras's adapters convert a batch.
Data keeps its dtype where the model's `Input` takes it (strings, integers, booleans):
only a float of another width, or a number fed to an `Input` of another dtype, is cast.
"""

import numpy as np

__all__ = ["as_array", "column", "Column", "rows", "chunks"]

CHUNK = 1 << 20   # elements per read when a whole array-like is scanned


def as_array(value):
    """`value` as something indexed by rows: a numpy array, or an array-like kept as it
    is (read by the rows a batch needs); a tensor, list or pandas object becomes numpy."""
    if hasattr(value, "numpy"):
        return value.numpy()
    if isinstance(value, np.ndarray):
        return value
    if (hasattr(value, "shape") and hasattr(value, "dtype") and hasattr(value, "__getitem__")
            and not hasattr(value, "to_numpy")):   # pandas indexes by label: made numpy
        return value
    return np.asarray(value)


def rows(array, index):
    """Rows `index` (a slice or an index array) of `array`. An array-like that is not
    numpy gets one read of a contiguous range, or of its sorted unique rows (h5py
    takes only increasing indices), put back in the order asked."""
    if isinstance(index, slice) or isinstance(array, np.ndarray):
        return np.asarray(array[index])
    index = np.asarray(index, dtype=np.int64)
    if not len(index):
        return np.empty((0,) + tuple(array.shape[1:]), np.dtype(array.dtype))
    if (np.diff(index) == 1).all():
        return np.asarray(array[int(index[0]):int(index[-1]) + 1])
    unique, inverse = np.unique(index, return_inverse=True)
    return np.asarray(array[unique])[inverse]


class Column:
    """One input of `len(array)` samples, read by rows and cast to `dtype` per read."""

    def __init__(self, array, dtype):
        self.array, self.dtype = array, np.dtype(dtype)
        self.shape = tuple(array.shape)
        self.ndim = len(self.shape)

    def __len__(self):
        return self.shape[0]

    def __getitem__(self, index):
        return rows(self.array, index).astype(self.dtype, copy=False)

    def __array__(self, dtype=None, copy=None):
        whole = self[:]
        return whole if dtype is None else whole.astype(dtype, copy=False)


def column(array, target, name):
    """`array` fed to an input of Keras dtype `target`: as it is where nothing is to
    cast and numpy reads its rows, else a `Column`. Text fed to a numeric input, or
    numbers to a string input, is refused naming the input."""
    kind = np.dtype(array.dtype).kind
    if (target == "string") != (kind in "OSU"):
        given = "text" if kind in "OSU" else f"{np.dtype(array.dtype).name} numbers"
        wanted = ("strings (numpy str/bytes/object arrays, tf.string tensors)"
                  if target == "string" else "numbers")
        raise ValueError(
            f"Input {name!r} takes {target} but the data holds {given}. Feed {wanted} "
            f"for it, or change the model's keras.Input(dtype=...) for {name!r}.")
    if target in ("string", "bfloat16") or np.dtype(array.dtype) == np.dtype(target):
        return array if isinstance(array, np.ndarray) else Column(array, array.dtype)
    return Column(array, target)


def chunks(array):
    """`array` whole, in pieces of about CHUNK elements (a scan that never holds it all)."""
    per_row = max(1, int(np.prod(array.shape[1:], dtype=np.int64)))
    step = max(1, CHUNK // per_row)
    for lo in range(0, len(array), step):
        yield array[lo:lo + step]
