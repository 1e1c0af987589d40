"""Where a member's weight lives in the array: `Stacked` (fused: every member's copy of
one weight in one variable, member p's at index p) or `Owned` (a layer that runs once per
member keeps its own variables). The optimizer, the checks and unfusing see both alike."""

import numpy as np
import tensorflow as tf

__all__ = ["Stacked", "Owned"]


class Stacked:
    """One weight of n members as one `tf.Variable` of shape [n, *shape]; with `rows`
    (an Embedding table [V, D]), of shape [n * V, D], member p's rows at p*V..(p+1)*V,
    so that the table's gradient stays (row, value) pairs as in each member's own fit
    (Keras applies them pair by pair: Adam squares each occurrence)."""

    def __init__(self, originals, trainable, rows=False, values=None):
        self.originals = list(originals)          # the members' Keras variables, by position
        self.n = len(self.originals)
        self.shape = tuple(int(d) for d in self.originals[0].shape)
        self.rows = rows
        self.trainable = trainable
        if values is None:
            values = np.stack([np.asarray(v.numpy()) for v in self.originals])
        self.dtype = values.dtype
        name = self.originals[0].path.replace("/", "_") + "_fused"
        self.variable = tf.Variable(self.storage(values), trainable=trainable, name=name)
        self.positions = list(range(self.n))     # the array position of each original

    # layouts ---------------------------------------------------------------------------
    def storage(self, grouped):
        """[n, *shape] -> the variable's layout."""
        if not self.rows:
            return grouped
        return (np.reshape(grouped, (-1,) + self.shape[1:]) if isinstance(grouped, np.ndarray)
                else tf.reshape(grouped, (-1,) + self.shape[1:]))

    def grouped(self, t):
        """The variable's layout -> [n, *shape] (member p's value at [p])."""
        return tf.reshape(t, (self.n,) + self.shape) if self.rows else t

    def broadcast(self, vector):
        """A per-member vector [n] shaped to broadcast against the variable: [n, 1, ...]
        (or [n * V, 1] for rows, which Keras's sparse ops gather by row)."""
        vector = tf.convert_to_tensor(vector)
        if self.rows:
            return tf.reshape(tf.repeat(vector, self.shape[0]), [-1] + [1] * (len(self.shape) - 1))
        return tf.reshape(vector, [self.n] + [1] * len(self.shape))

    def member_sums(self, t):
        """[n]: the sum of `t` (the variable's layout) over each member's elements."""
        g = self.grouped(t)
        return tf.reduce_sum(g, axis=list(range(1, len(self.shape) + 1)))

    # moving values -----------------------------------------------------------------------
    def values(self):
        """Each member's value, numpy, by position."""
        grouped = self.variable.numpy()
        if self.rows:
            grouped = grouped.reshape((self.n,) + self.shape)
        return list(grouped)

    def write_back(self):
        """Each member's Keras variable takes its value in the array."""
        for original, value in zip(self.originals, self.values()):
            original.assign(value)

    def reload(self):
        """The array takes the members' values again (a callback may have set them)."""
        self.variable.assign(self.storage(np.stack([np.asarray(v.numpy()) for v in self.originals])))

    def take(self, keep):
        """The same weight for the members at positions `keep` (a member left)."""
        mine = self.values()
        values = np.stack([mine[p] for p in keep])
        return Stacked([self.originals[p] for p in keep], self.trainable, self.rows, values)

    def zeros_like(self):
        """A tf.Variable of the variable's layout, zeros (an optimizer slot)."""
        return tf.Variable(tf.zeros_like(self.variable), trainable=False)

    def __repr__(self):
        return f"Stacked({self.originals[0].path}, n={self.n}, rows={self.rows})"


class Owned:
    """A weight of a layer that runs once per member (not fused): the member's own
    variable, at array position `position` of `n`."""

    rows = False

    def __init__(self, original, position, n):
        self.originals = [original]
        self.position, self.n = position, n
        self.shape = tuple(int(d) for d in original.shape)
        self.trainable = original.trainable
        self.variable = original.value          # the tf.Variable behind the Keras one
        self.dtype = np.dtype(original.dtype)
        self.positions = [position]

    def storage(self, grouped):
        return grouped[0]

    def grouped(self, t):
        return t[None]

    def broadcast(self, vector):
        return tf.convert_to_tensor(vector)[self.position]

    def member_sums(self, t):
        total = tf.reduce_sum(t)
        return tf.scatter_nd([[self.position]], total[None], [self.n])

    def values(self):
        return [self.variable.numpy()]

    def write_back(self):
        pass

    def reload(self):
        pass

    def take(self, keep):
        return Owned(self.originals[0], keep.index(self.position), len(keep)) \
            if self.position in keep else None

    def zeros_like(self):
        return tf.Variable(tf.zeros_like(self.variable), trainable=False)

    def __repr__(self):
        return f"Owned({self.originals[0].path}, member at {self.position})"
