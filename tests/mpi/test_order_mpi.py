"""Split layers in independent branches, under real mpiexec with one inter-op thread per
rank (production's setting): each rank is pushed into a different execution order (its
own delays in the branches, forward and backward), and the collectives still meet, for
20 steps, with model.fit's weights. Run by tests/cluster/test_mpi.py with the rest of tests/mpi:

    mpiexec -n 2 python -m pytest --with-mpi tests/mpi/test_order_mpi.py
"""

import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import hyparflow as hf  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402
from mpi4py import MPI  # noqa: E402

from conftest import max_diff  # noqa: E402

RANK, SIZE = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
L = keras.layers
SEQ, VOCAB, D = 8, 24, 16
STEPS = 20


class Delay(L.Layer):
    """The identity, which sleeps first (`forward` s) and in its backward (`backward` s):
    a rank's branches made slower or faster than its peers', so that without one order
    of the collectives the ranks would reach them in different orders."""

    def __init__(self, forward=0.0, backward=0.0, **kwargs):
        super().__init__(**kwargs)
        self.forward, self.backward = forward, backward
        self.supports_masking = True

    def call(self, x):
        forward, backward = self.forward, self.backward

        def sleep(seconds):
            def run(v):
                time.sleep(seconds)
                return v
            return run

        @tf.custom_gradient
        def op(x):
            y = tf.numpy_function(sleep(forward), [x], x.dtype, stateful=False) if forward else x
            y = tf.reshape(y, tf.shape(x))

            def grad(dy):
                if not backward:
                    return dy
                return tf.reshape(tf.numpy_function(sleep(backward), [dy], dy.dtype,
                                                    stateful=False), tf.shape(dy))

            return y, grad

        return op(x)


DELAYED = [True]  # whether the models are built with the delays (cases run both ways)


def delays(branch):
    """Rank-dependent delays: even ranks slow `branch` 0 forward and 1 backward, odd
    ranks the other way round (none when not `DELAYED`: then TensorFlow's own
    scheduling chooses, which is how the encoder-decoder hung)."""
    if not DELAYED[0]:
        return {}
    slow = (RANK + branch) % 2 == 0
    return dict(forward=0.03 if slow else 0.0, backward=0.0 if slow else 0.03)


def encoder_decoder():
    """An Embedding with mask_zero per side, encoder self-attention, decoder causal
    self-attention and cross-attention, feed-forward pairs, an LM head: the model that
    hung (attention without biases: a key bias's gradient is zero but for round-off,
    which Adam turns into whole steps)."""
    keras.utils.set_random_seed(5)
    src = keras.Input((SEQ,), dtype="int32")
    tgt = keras.Input((SEQ,), dtype="int32")
    e = Delay(**delays(0))(L.Embedding(VOCAB, D, mask_zero=True)(src))
    a = L.MultiHeadAttention(2, 8, use_bias=False, name="enc_self")(e, e)
    x = L.LayerNormalization()(L.Add()([e, a]))
    h = L.Dense(D, name="enc_down")(L.Dense(32, activation="relu", name="enc_up")(x))
    enc = L.LayerNormalization()(L.Add()([x, h]))
    d = Delay(**delays(1))(L.Embedding(VOCAB, D, mask_zero=True)(tgt))
    s = L.MultiHeadAttention(2, 8, use_bias=False, name="dec_self")(d, d, use_causal_mask=True)
    y = L.LayerNormalization()(L.Add()([d, s]))
    c = L.MultiHeadAttention(2, 8, use_bias=False, name="dec_cross")(y, enc)
    y = L.LayerNormalization()(L.Add()([y, c]))
    h = L.Dense(D, name="dec_down")(L.Dense(32, activation="relu", name="dec_up")(y))
    y = L.LayerNormalization()(L.Add()([y, h]))
    out = L.Dense(VOCAB, name="head")(y)
    model = keras.Model([src, tgt], out)
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


ATTENTION = ["enc_self", "dec_self", "dec_cross"]
ENCODER_DECODER = ["enc_self", "enc_up", "enc_down", "dec_self", "dec_cross", "dec_up",
                   "dec_down", "head"]


def sequences(n=STEPS * 16):
    rng = np.random.default_rng(1)
    src, tgt = rng.integers(1, VOCAB, (n, SEQ)), rng.integers(1, VOCAB, (n, SEQ))
    for ids in (src, tgt):
        ids[np.arange(SEQ)[None] >= rng.integers(3, SEQ + 1, n)[:, None]] = 0
    return [src.astype("int32"), tgt.astype("int32")], np.roll(tgt, -1, axis=1).astype("int32")


def towers():
    """Two towers of feed-forward pairs on two inputs, joined at the end."""
    keras.utils.set_random_seed(6)
    a_in, b_in = keras.Input((12,)), keras.Input((10,))
    a = Delay(**delays(0))(a_in)
    b = Delay(**delays(1))(b_in)
    for k in range(2):
        a = L.Dense(16, name=f"a_down{k}")(L.Dense(32, activation="relu", name=f"a_up{k}")(a))
        b = L.Dense(16, name=f"b_down{k}")(L.Dense(32, activation="relu", name=f"b_up{k}")(b))
    out = L.Dense(4, activation="softmax")(L.Concatenate()([a, b]))
    model = keras.Model([a_in, b_in], out)
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="sparse_categorical_crossentropy")
    return model


TOWERS = [f"{t}_{kind}{k}" for t in "ab" for k in range(2) for kind in ("up", "down")]


def tower_data(n=STEPS * 16):
    rng = np.random.default_rng(2)
    return ([rng.normal(size=(n, 12)).astype("float32"),
             rng.normal(size=(n, 10)).astype("float32")], rng.integers(0, 4, n).astype("int32"))


def check(build, data, names, **layout):
    assert tf.config.threading.get_inter_op_parallelism_threads() == 1, \
        "these runs must take production's one inter-op thread per rank"
    x, y = data()
    reference = build()
    start = reference.get_weights()
    reference.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    model = build()
    model.set_weights(start)
    began = time.monotonic()
    hf.fit(model, x, y, batch_size=16, epochs=1, shuffle=False, verbose=0, tensor_layers=names,
           **layout)
    diff = max_diff(model.get_weights(), reference.get_weights())
    if hf.is_main():
        print(f"\n{build.__name__} {names[:2]}... {layout} delays {DELAYED[0]}: {STEPS} steps in {time.monotonic() - began:.1f} s, "
              f"max weight difference {diff:.3g}")
    assert diff <= 2e-5, (layout, diff)


@pytest.mark.mpi(min_size=2)
def test_encoder_decoder_in_any_order():
    layouts = {2: dict(num_tensor=2), 4: dict(num_stages=2, num_tensor=2, num_microbatches=2)}
    # Undelayed: TensorFlow's own order (how it hung); delayed: every layer split, the
    # attention among them.
    for delayed, names in ((False, ATTENTION), (True, ENCODER_DECODER)):
        DELAYED[0] = delayed
        check(encoder_decoder, sequences, names, **layouts[SIZE])


@pytest.mark.mpi(min_size=2)
def test_two_towers_in_any_order():
    layouts = {2: [dict(num_tensor=2)],
               4: [dict(num_tensor=4), dict(num_tensor=4, tensor_mesh=(2, 2))]}
    DELAYED[0] = True
    for layout in layouts[SIZE]:
        check(towers, tower_data, TOWERS, **layout)


def hub_encoder_decoder():
    """BART's blocks: Keras Hub's TransformerEncoder on the source and TransformerDecoder
    (causal self-attention and cross-attention to the encoder) on the target, padding
    masked, an LM head (SGD: the blocks' attention has key biases, whose gradient is
    zero but for round-off, which Adam would turn into whole steps)."""
    import keras_hub

    keras.utils.set_random_seed(7)
    src = keras.Input((SEQ,), dtype="int32")
    tgt = keras.Input((SEQ,), dtype="int32")
    e = Delay(**delays(0))(L.Embedding(VOCAB, D)(src))
    d = Delay(**delays(1))(L.Embedding(VOCAB, D)(tgt))
    enc = keras_hub.layers.TransformerEncoder(32, 2, name="enc_block")(
        e, padding_mask=keras.ops.not_equal(src, 0))
    y = keras_hub.layers.TransformerDecoder(32, 2, name="dec_block")(
        d, enc, decoder_padding_mask=keras.ops.not_equal(tgt, 0),
        encoder_padding_mask=keras.ops.not_equal(src, 0))
    model = keras.Model([src, tgt], L.Dense(VOCAB, name="head")(y))
    model.compile(optimizer=keras.optimizers.SGD(0.1),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


@pytest.mark.mpi(min_size=2)
def test_keras_hub_encoder_decoder_blocks_in_any_order():
    pytest.importorskip("keras_hub")
    DELAYED[0] = True
    layouts = {2: dict(num_tensor=2), 4: dict(num_stages=2, num_tensor=2, num_microbatches=2)}
    check(hub_encoder_decoder, sequences, ["enc_block", "dec_block"], **layouts[SIZE])
