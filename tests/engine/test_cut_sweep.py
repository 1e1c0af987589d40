"""A regression gate on stage boundaries: two stages and two microbatches at every
legal cut (or a spread of them), against plain Keras on one process.

The suite's other tests cut where the balance puts the cut; a boundary class that
only some cuts hit (a mask removed on the sending stage, a skip read on both sides,
a BatchNorm's statistics, a tensor consumed twice) slips through them. Models: the
zoo's graph shapes, a mask read by attention and after it, a Keras Hub LLM and a
keras.applications CNN; one step or two each, on threads (`hyparflow.local`)."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import hyparflow as hf
import models
import zoo
from conftest import float64, max_diff
from hyparflow import graph as G
from hyparflow.engine.local import run_ranks
from test_masks import VALID, attention_beside_dense, attention_then_add, tokens

BATCH = 8


def fit_at_cuts(builds, x, y, start, cuts, **kwargs):
    """hf.fit at S=2 M=2 once per cut `k` (stage 0 holds the first k layer calls), each
    on a fresh model from `builds[rank]()`: [weights per cut] of rank 0 and 1."""
    n = len(G.from_model(builds[0]()).nodes)

    def body(comm):
        out = []
        for k in cuts:
            model = builds[comm.rank]()
            model.set_weights(start)
            hf.fit(model, x, y, batch_size=BATCH, epochs=1, num_stages=2, num_microbatches=2,
                   balance=[k, n - k], comm=comm, shuffle=False, verbose=0, **kwargs)
            out.append(model.get_weights())
        return out

    return run_ranks(2, body, timeout=600)


def every_cut(build):
    return list(range(1, len(G.from_model(build()).nodes)))


def check(build, x, y, cuts=None, tol=1e-6, **kwargs):
    model = build()
    start = model.get_weights()
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, **kwargs)
    expected = model.get_weights()
    cuts = cuts or every_cut(build)
    results = fit_at_cuts([build, build], x, y, start, cuts, **kwargs)
    report = {k: max(max_diff(rank[j], expected) for rank in results)
              for j, k in enumerate(cuts)}
    print(build.__name__, {k: f"{d:.2g}" for k, d in report.items()})
    assert max(report.values()) <= tol, report


@pytest.mark.parametrize("name", ["inception", "unet", "multi_io", "ops_graph"])
def test_zoo_shapes_at_every_cut(name):
    model, (x, y) = zoo.ZOO[name]()
    first = (lambda a: a[:2 * BATCH])
    x = {k: first(v) for k, v in x.items()} if isinstance(x, dict) else first(x)
    y = {k: first(v) for k, v in y.items()} if isinstance(y, dict) else first(y)

    def build():
        return zoo.ZOO[name]()[0]

    build.__name__ = name
    check(build, x, y, tol=2e-6)


@pytest.mark.parametrize("build", [attention_then_add, attention_beside_dense])
def test_a_mask_removed_by_attention_at_every_cut(build):
    """Embedding(mask_zero) -> attention and layers reading the embedding after it:
    the mask crosses, is removed, or is read after its removal, depending on the
    cut and on the order of the calls."""
    x = tokens(6, 20, VALID * 2, 0)
    y = np.random.default_rng(1).integers(0, 3, (2 * BATCH, 6))
    check(build, x, y)


def test_keras_hub_llama_at_every_cut():
    pytest.importorskip("keras_hub")
    vocab, seq = 41, 8

    def llama():
        return models.causal_lm(vocab=vocab, hidden_dim=8, intermediate_dim=16)

    rng = np.random.default_rng(7)
    ids = rng.integers(1, vocab, (2 * BATCH, seq)).astype("int32")
    mask = (np.arange(seq)[None] < rng.integers(2, seq + 1, (2 * BATCH, 1))).astype("int32")
    ids *= mask
    check(llama, {"token_ids": ids, "padding_mask": mask}, np.roll(ids, -1, axis=1), tol=2e-6)


def mobilenet_v3():
    """keras.applications MobileNetV3Small (Rescaling, squeeze-and-excitation blocks
    whose input is read twice, BatchNorm, hard-swish), 32x32, in float64."""
    keras.utils.set_random_seed(2)
    base = keras.applications.MobileNetV3Small(
        input_shape=(32, 32, 3), weights=None, include_top=False, pooling="avg", alpha=0.75)
    model = keras.Model(base.input, keras.layers.Dense(4)(base.output))
    model.compile(optimizer=keras.optimizers.SGD(0.05),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def test_keras_applications_cnn_at_a_spread_of_cuts():
    """BatchNorm normalises each microbatch by its own statistics, so the reference
    is plain Keras accumulating the two microbatches' gradients (what M=2 means for
    BatchNorm). In float64: at float32, four samples' statistics over 1x1 maps make
    every change of rounding (a fused operation a cut separates) 1e-3 in the
    weights, which would hide a wrong boundary; float64 shows it plainly."""
    # A Keras Hub model built earlier in the process left global state that moved these
    # float64 weights 1e-5 on this machine (the same on the previous main); start clean.
    keras.backend.clear_session()
    with float64():
        models = [mobilenet_v3() for _ in range(3)]

    def again(model):
        """The same model with a new optimizer (each cut builds it on its stage's
        variables): building 175 layers per cut and rank would cost more than the fits."""
        model.compile(optimizer=keras.optimizers.SGD(0.05),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    rng = np.random.default_rng(3)
    x, y = rng.uniform(0, 255, (BATCH, 32, 32, 3)), rng.integers(0, 4, BATCH)
    reference = models[2]
    start = reference.get_weights()
    variables = reference.trainable_variables

    @tf.function
    def gradients(xs, ys):
        with tf.GradientTape() as tape:
            loss = reference.loss(ys, reference(xs, training=True)) * 0.5
        return tape.gradient(loss, variables)

    half = BATCH // 2
    summed = [a + b for a, b in zip(gradients(x[:half], y[:half]), gradients(x[half:], y[half:]))]
    reference.optimizer.apply(summed, variables)
    expected = reference.get_weights()
    names = [node.name for node in G.from_model(reference).nodes]
    # Inside a squeeze-and-excitation block (its input, read by the pooling here and by
    # the multiply there, crosses); between a convolution and its BatchNorm, with a
    # residual's source read on both stages.
    cuts = [names.index("expanded_conv_squeeze_excite_conv"),
            names.index("expanded_conv_2_expand_bn")]
    results = fit_at_cuts([lambda: again(models[0]), lambda: again(models[1])], x, y, start, cuts)
    report = {names[k]: max(max_diff(rank[j], expected) for rank in results)
              for j, k in enumerate(cuts)}
    update = max_diff(expected, start)
    print(report, "largest update", update)
    # Gradients are summed in float32 buffers: a weight's error is about 1e-7 of its
    # update, where a wrong boundary gets the update itself wrong.
    assert max(report.values()) <= 1e-5 * update, report
