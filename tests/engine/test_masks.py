"""Keras masks as model.fit sees them, wherever the stages cut and whatever is split.

Keras 3's MultiHeadAttention removes the mask from the tensors it was given, so in
`model.fit` a layer reading the same tensor after it sees no mask (and an
`Add([x, attention(x, x)])` gives an output without one: the loss is then not
masked). Every layout must reproduce that, and split layers must give their
outputs the masks the whole layers give. Microbatches and replicas hold different
numbers of valid tokens (a masked loss is divided by the whole batch's count)."""

import time

import keras
import numpy as np
import tensorflow as tf

import hyparflow as hf
from conftest import max_diff, reference, train_ranks
from hyparflow import graph as G
from hyparflow.engine import masks
from hyparflow.engine.local import run_ranks

L = keras.layers
BATCH = 8


def tokens(length, vocab, valid, seed):
    """Ids with `valid[r]` leading non-zero tokens in row r (zeros pad)."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, vocab, (len(valid), length)).astype("int32")
    for row, n in enumerate(valid):
        ids[row, n:] = 0
    return ids


VALID = [3, 5, 2, 6, 4, 1, 1, 6]  # valid tokens per row (of 6)


def attention_then_add():
    """The mask is read by the attention (which removes it) and by the Add after it."""
    keras.utils.set_random_seed(5)
    ids = keras.Input((6,), dtype="int32")
    x = L.Embedding(20, 8, mask_zero=True)(ids)
    a = L.MultiHeadAttention(2, 4)(x, x)
    h = L.LayerNormalization()(L.Add()([x, a]))
    out = L.Dense(3)(h)
    model = keras.Model(ids, out)
    model.compile(optimizer=keras.optimizers.SGD(0.1),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def attention_beside_dense():
    """A Dense reads the embedding beside the attention: Keras's call order (deepest
    first: the attention, which a Dense follows) gives it no mask; a stage's order
    (by branch, the Add's first input first) runs it before the attention."""
    keras.utils.set_random_seed(6)
    ids = keras.Input((6,), dtype="int32")
    x = L.Embedding(20, 8, mask_zero=True)(ids)
    a = L.Dense(8)(L.MultiHeadAttention(2, 4)(x, x))
    b = L.Dense(8)(x)
    h = L.LayerNormalization()(L.Add()([b, a]))
    model = keras.Model(ids, L.Dense(3)(h))
    model.compile(optimizer=keras.optimizers.SGD(0.1),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def test_the_record_is_keras_own_run():
    """What the record says, read off Keras's rules: the attention finds the mask,
    the Add after it finds its first input without one, and the loss no mask."""
    model = attention_then_add()
    g = G.from_model(model)
    run = masks.of(g, True)
    emb, attention, add = (n.index for n in g.nodes[:3])
    x = g.nodes[emb].outputs[0]
    assert run.present[attention] == {x: True}
    assert run.present[add] == {x: False, g.nodes[attention].outputs[0]: True}
    assert run.final == {g.outputs[0]: False}
    assert masks.of(G.from_model(keras.Sequential([keras.Input((3,)), L.Dense(2)])), True) is None


def test_a_mask_read_by_attention_on_one_stage_and_later_layers_on_another():
    """The attention alone on a middle stage: the Add on the next stage gets the
    embedding's output without its mask, as in model.fit (0.2 apart before)."""
    x = tokens(6, 20, VALID, 0)
    y = np.random.default_rng(1).integers(0, 3, (BATCH, 6))
    start, expected, _ = reference(attention_then_add, x, y, epochs=1, batch_size=BATCH)
    for s, r, m, balance in [(3, 1, 1, [1, 1, 3]), (3, 1, 2, [1, 1, 3]), (2, 2, 2, [1, 4])]:
        results = train_ranks(attention_then_add, x, y, num_stages=s, num_replicas=r,
                              num_microbatches=m, weights=start, balance=balance,
                              batch_size=BATCH, epochs=1, shuffle=False)
        assert max_diff(results[0][0], expected) <= 1e-6, (s, r, m, balance)


def per_token_dense():
    """The mask reaches the loss through Dense layers, split over tensor ranks."""
    keras.utils.set_random_seed(3)
    ids = keras.Input((6,), dtype="int32")
    x = L.Embedding(20, 8, mask_zero=True)(ids)
    x = L.Dense(16, activation="relu", name="up")(x)
    x = L.Dense(8, name="down")(x)
    out = L.Dense(5, name="head")(x)
    model = keras.Model(ids, out)
    model.compile(optimizer=keras.optimizers.SGD(0.1),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def test_split_layers_keep_the_mask_keras_gives():
    """A split Dense (alone: gathered columns; paired: columns then rows) gives its
    output the mask the whole layer gives, so the loss stays masked (4.5e-3 apart
    before: the loss lost its mask)."""
    x = tokens(6, 20, VALID, 0)
    y = np.random.default_rng(1).integers(0, 5, (BATCH, 6))
    start, expected, _ = reference(per_token_dense, x, y, epochs=1, batch_size=BATCH)
    for s, r, m, layers in [(1, 1, 1, ["head"]), (1, 1, 1, ["up", "down"]),
                            (2, 1, 2, ["up", "down", "head"])]:
        results = train_ranks(per_token_dense, x, y, num_stages=s, num_replicas=r,
                              num_microbatches=m, weights=start, num_tensor=2,
                              tensor_layers=layers, batch_size=BATCH, epochs=1, shuffle=False)
        assert max_diff(results[0][0], expected) <= 1e-6, (s, r, m, layers)


def _block(x, name, context=None, causal=False):
    a = L.MultiHeadAttention(2, 4, name=f"{name}_self")(x, x, use_causal_mask=causal)
    x = L.LayerNormalization()(L.Add()([x, a]))
    if context is not None:
        c = L.MultiHeadAttention(2, 4, name=f"{name}_cross")(x, context)
        x = L.LayerNormalization()(L.Add()([x, c]))
    h = L.Dense(8, name=f"{name}_down")(L.Dense(16, activation="relu", name=f"{name}_up")(x))
    return L.LayerNormalization()(L.Add()([x, h]))


# Run under mpiexec (tests/mpi/test_masks_mpi.py): T=2, and S=2 T=2 M=2.
SPLIT = ["enc_self", "enc_up", "enc_down", "dec_self", "dec_cross", "dec_up", "dec_down"]


def encoder_decoder():
    """Padding masks on both sides, causal self-attention, cross-attention, FFN pairs."""
    keras.utils.set_random_seed(4)
    source = keras.Input((10,), dtype="int32")
    target = keras.Input((7,), dtype="int32")
    e = _block(L.Embedding(30, 8, mask_zero=True)(source), "enc")
    d = _block(L.Embedding(30, 8, mask_zero=True)(target), "dec", context=e, causal=True)
    model = keras.Model([source, target], L.Dense(30)(d))
    model.compile(optimizer=keras.optimizers.Adam(1e-2),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


class Delay(L.Layer):
    """The identity, but it waits `seconds` first, in the forward and the backward:
    it sets which of two independent branches reaches its collectives first."""

    def __init__(self, seconds=0.0, **kwargs):
        super().__init__(**kwargs)
        self.seconds = seconds

    def call(self, x):
        seconds = self.seconds

        def wait(value):
            time.sleep(seconds)
            return value

        def delayed(value):
            out = tf.py_function(wait, [value], value.dtype)
            out.set_shape(value.shape)
            return out

        @tf.custom_gradient
        def identity(value):
            return delayed(value), delayed

        return identity(x)


def two_branches(left=0.0, right=0.0):
    """Two independent branches of equal shapes, each with a split Dense; `left` and
    `right` delay one branch (before and after its split layer)."""
    keras.utils.set_random_seed(9)
    a, b = keras.Input((6,)), keras.Input((6,))
    branches = []
    for name, x, seconds in (("left", a, left), ("right", b, right)):
        x = Delay(seconds)(L.Dense(6, activation="tanh", name=f"{name}_in")(x))
        branches.append(Delay(seconds)(L.Dense(8, name=name)(x)))
    model = keras.Model([a, b], L.Dense(3)(L.Concatenate()(branches)))
    model.compile(optimizer=keras.optimizers.SGD(0.1),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def test_independent_split_branches_pair_their_own_collectives(monkeypatch):
    """Both branches on stage 0 of two, whose backward is a compiled gradient
    function of its own (TensorFlow orders nothing in it by itself): tensor rank 0
    reaches the left branch's sums later than the right's, rank 1 the reverse (a
    delay). The ranks still run the branches' collectives in one order (the token of
    hyparflow.engine.order; before it they ran them in other orders, and only the
    tags kept each exchange with the same branch's), with model.fit's weights."""
    from hyparflow.kinds import tensor as hft

    rng = np.random.default_rng(5)
    x = [rng.normal(size=(16, 6)).astype("float32") for _ in range(2)]
    y = rng.integers(0, 3, 16)
    start, expected, _ = reference(two_branches, x, y, epochs=1, batch_size=BATCH)
    order, exchange = {}, hft.Collectives.exchange

    def logged(self, array, shapes, what, *tag):
        order.setdefault((id(self.comm.group), self.comm.rank), []).append(what)
        return exchange(self, array, shapes, what, *tag)

    monkeypatch.setattr(hft.Collectives, "exchange", logged)

    def body(comm):
        delay = 0.05
        model = two_branches(left=delay if comm.rank % 2 == 0 else 0.0,
                             right=delay if comm.rank % 2 == 1 else 0.0)
        model.set_weights(start)
        hf.fit(model, x, y, batch_size=BATCH, epochs=1, num_stages=2, num_tensor=2,
               num_microbatches=2, balance=[8, 2], comm=comm, verbose=0,
               tensor_layers=["left", "right"], shuffle=False)
        return model.get_weights()

    for weights in run_ranks(4, body, timeout=120):
        assert max_diff(weights, expected) <= 1e-6
    (first, second), = [[order[key] for key in sorted(order) if key[0] == group]
                        for group in {key[0] for key in order}]
    assert first == second  # one order on both ranks, whatever their delays
