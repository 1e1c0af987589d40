"""The contract on models no one here wrote, over real MPI messages: keras.applications
CNNs and Keras Hub LLMs at two stages with two microbatches (2 ranks) and at two
stages with two replicas (4 ranks), at the balance the planner picks, against
model.fit, each beside a round-off control measured in the same test (a plain
GradientTape step over the same microbatches against model.fit, on rank 0). Run
under mpiexec by tests/cluster/test_mpi.py:

    mpiexec -n 2 python -m pytest --with-mpi tests/mpi/test_gate_mpi.py
    HYPARFLOW_GATE_CNNS=1 mpiexec -n 2 ...   # the CNNs too (left out of the suite)

The CNNs run in float64. BatchNorm over 4 samples on the 1x1 maps of a 32x32 input
makes one step's update ~1e4 times as sensitive as its inputs (EfficientNetB0: inputs
moved by 1e-7 of themselves move the update by 2e-3 of it), so in float32 any change
of rounding a cut brings (say, a fused kernel it separates) moves the weights by 1e-3
of the update and would hide a wrong boundary; in float64 hyparflow's only rounding is
its float32 gradient sums (5e-8 of the update), so 1e-6 of the update is a sharp gate.
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
from conftest import float64, max_diff  # noqa: E402
from mpi4py import MPI  # noqa: E402

COMM = MPI.COMM_WORLD
SIZE = COMM.Get_size()
BATCH = 8


def trained(model):
    """The trainable weights: with replicas, BatchNorm's moving statistics are each
    replica's, averaged at the epoch's end (docs/models.md), not one sequence of updates."""
    return [v.numpy() for v in model.trainable_variables]


def layout():
    """(S, R, M): two stages and two microbatches on 2 ranks, two stages and two
    replicas on 4; every layout trains microbatches of 4 rows here."""
    return (2, 1, 2) if SIZE < 4 else (2, 2, 1)


def idle_until_all_arrive():
    """A barrier that sleeps: a blocking MPI wait spins, and would take the cores
    rank 0 needs for the reference while the others wait for it."""
    request = COMM.Ibarrier()
    while not request.Test():
        time.sleep(0.005)


def tape_step(model, start, x, y, rows):
    """The control: a compiled GradientTape over microbatches of `rows` rows, each
    loss weighted by its share, summed, one optimizer step."""
    model.set_weights(start)
    variables = model.trainable_variables

    @tf.function
    def gradients(xs, ys, share):
        with tf.GradientTape() as tape:
            loss = model.compute_loss(x=xs, y=ys, y_pred=model(xs, training=True))
            loss = loss * tf.cast(share, loss.dtype)   # Keras's loss is float32 here
        # Dense (an embedding's IndexedSlices cannot be summed across microbatches).
        return [tf.convert_to_tensor(g) for g in tape.gradient(loss, variables)]

    summed = None
    for k in range(0, len(y), rows):
        part = gradients(tf.nest.map_structure(lambda a: a[k:k + rows], x), y[k:k + rows],
                         tf.constant(rows / len(y), tf.float64))
        summed = part if summed is None else [a + b for a, b in zip(summed, part)]
    model.optimizer.apply(summed, variables)
    return model.get_weights()


def gate(name, build, x, y, *, accumulate, floor):
    """hf.fit at `layout()` from the same start as model.fit (with
    `gradient_accumulation_steps=accumulate` over batches of BATCH // accumulate
    when the model normalises per microbatch; else one batch of BATCH). Asserts its
    distance from model.fit's weights is within 10x the control's or `floor`
    times the largest update, on every rank."""
    model = build()
    reference = None
    if COMM.Get_rank() == 0:   # the references once, the other ranks asleep meanwhile
        try:
            start = model.get_weights()
            build.compile(model, accumulate)
            model.fit(x, y, batch_size=BATCH // accumulate, epochs=1, shuffle=False, verbose=0)
            expected = trained(model)
            build.compile(model)
            tape_step(model, start, x, y, BATCH // 2)
            control = max_diff(trained(model), expected)
            model.set_weights(start)
            reference = (start, expected, control, max_diff(expected, trained(model)))
        except Exception as error:   # every rank fails with it (none waits forever)
            reference = error
    idle_until_all_arrive()
    reference = COMM.bcast(reference, root=0)
    if isinstance(reference, Exception):
        raise reference
    start, expected, control, update = reference
    build.compile(model)
    model.set_weights(start)
    s, r, m = layout()
    began = time.perf_counter()
    hf.fit(model, x, y, batch_size=BATCH, epochs=1, num_stages=s, num_replicas=r,
           num_microbatches=m, shuffle=False, verbose=0)
    seconds = time.perf_counter() - began
    diff = COMM.allreduce(max_diff(trained(model), expected), op=MPI.MAX)
    if hf.is_main():
        print(f"\n{name} (S,R,M)={(s, r, m)}: max weight difference {diff:.3g} "
              f"({diff / update:.2g} of the largest update {update:.3g}), round-off control "
              f"{control:.3g}; hf.fit {seconds:.1f} s")
    # The control's margin is capped at 1% of the update, so a wrong boundary always fails.
    assert diff <= max(min(10 * control, 0.01 * update), floor * update), (diff, control, update)


def cnn(application, **kwargs):
    """`application` (keras.applications, no weights, 32x32, average pooling) with a
    Dense(10) head and its Dropout rates 0, in float64; SGD(0.01)."""

    def build():
        with float64():
            keras.utils.set_random_seed(1)
            base = application(include_top=False, weights=None, input_shape=(32, 32, 3),
                               pooling="avg", **kwargs)
            model = keras.Model(base.input, keras.layers.Dense(10)(base.output))
        for layer in model.layers:
            if isinstance(layer, keras.layers.Dropout):
                layer.rate = 0.0
        build.compile(model)
        return model

    def compile_(model, accumulate=None):
        model.compile(optimizer=keras.optimizers.SGD(0.01, gradient_accumulation_steps=accumulate),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))

    build.compile = compile_
    return build


def images():
    """Pixels float32 holds exactly (model.fit casts float inputs to floatx, float32)."""
    rng = np.random.default_rng(0)
    x = rng.uniform(0, 255, (BATCH, 32, 32, 3)).astype("float32").astype("float64")
    return x, rng.integers(0, 10, BATCH)


# BatchNorm normalises each microbatch (and replica) by its own statistics: the
# model.fit that does the same takes batches of 4 and accumulates two of them
# (`gradient_accumulation_steps=2`) into one step of the 8. MobileNetV3Small is not
# here: tests/engine/test_cut_sweep.py trains it in float64 at a spread of cuts, in
# process (31 s a run here, for what that test already shows).
CNNS = {
    "EfficientNetB0": cnn(keras.applications.EfficientNetB0),
    "DenseNet121": cnn(keras.applications.DenseNet121),
}


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("name", sorted(CNNS))
def test_keras_applications(name):
    # The suite's time: DenseNet121 (427 layers) took ~75 s at 2 ranks, EfficientNetB0
    # 45 s, for what in process already shows: tests/engine/test_cut_sweep.py trains
    # MobileNetV3Small (the same families of layers: depthwise convolutions,
    # squeeze-and-excitation, BatchNorm) in float64 at a spread of cuts, and the bytes a
    # boundary sends over MPI do not depend on the model (test_contract_mpi.py).
    if SIZE >= 4 or not os.environ.get("HYPARFLOW_GATE_CNNS"):
        pytest.skip(f"{name} runs at 2 ranks with HYPARFLOW_GATE_CNNS=1")
    gate(name, CNNS[name], *images(), accumulate=2, floor=1e-6)


def llm(kind):
    """A tiny random Keras Hub causal LM (`kind`: Llama, or Qwen with its tied
    reversed embeddings), Adam."""
    keras_hub = pytest.importorskip("keras_hub")
    backbones = {"Llama": keras_hub.models.LlamaBackbone, "Qwen": keras_hub.models.QwenBackbone}
    lms = {"Llama": keras_hub.models.LlamaCausalLM, "Qwen": keras_hub.models.QwenCausalLM}

    def build():
        keras.utils.set_random_seed(21)
        backbone = backbones[kind](vocabulary_size=VOCAB, num_layers=2, num_query_heads=4,
                                   num_key_value_heads=2, hidden_dim=32, intermediate_dim=64)
        model = lms[kind](backbone=backbone, preprocessor=None)
        build.compile(model)
        return model

    def compile_(model, accumulate=None):
        model.compile(optimizer=keras.optimizers.Adam(1e-3),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))

    build.compile = compile_
    return build


VOCAB, SEQ = 61, 12


@pytest.mark.mpi(min_size=2)
# Llama only: Qwen's tied reversed embedding trains in process (tests/kinds/
# test_decoder_split.py) and tied embeddings over MPI in test_interleaved_mpi.py.
@pytest.mark.parametrize("kind", ["Llama"])
def test_keras_hub_llm(kind):
    """Padding masks and per-token targets; no layer couples samples, so model.fit
    takes the whole batch at once."""
    rng = np.random.default_rng(7)
    ids = rng.integers(1, VOCAB, (BATCH, SEQ)).astype("int32")
    mask = (np.arange(SEQ)[None] < rng.integers(3, SEQ + 1, (BATCH, 1))).astype("int32")
    x, y = {"token_ids": ids * mask, "padding_mask": mask}, np.roll(ids * mask, -1, axis=1)
    gate(f"Keras Hub {kind}", llm(kind), x, y, accumulate=1, floor=2e-3)
