"""Sequence lengths known only at run time cross stages, masks with them, against plain Keras.

Keras Hub's backbones and most text models take `Input(shape=(None,))`: each batch
is padded to its own length. The tensors between stages then have a dimension
that changes from batch to batch, and a padding mask rides along."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from conftest import max_diff, train_ranks

VOCAB, DIM, HEADS = 40, 16, 4


def encoder(optimizer="sgd"):
    """A small Transformer encoder classifier; the Embedding's mask (id 0 is padding)
    reaches the attention and the pooling, on whichever stage they run."""
    keras.utils.set_random_seed(21)
    ids = keras.Input((None,), dtype="int32", name="ids")
    h = keras.layers.Embedding(VOCAB, DIM, mask_zero=True, name="embed")(ids)
    a = keras.layers.MultiHeadAttention(HEADS, DIM // HEADS, name="attention")(h, h)
    h = keras.layers.LayerNormalization(name="norm_1")(keras.layers.Add(name="add_1")([h, a]))
    f = keras.layers.Dense(32, activation="relu", name="ffn_in")(h)
    f = keras.layers.Dense(DIM, name="ffn_out")(f)
    h = keras.layers.LayerNormalization(name="norm_2")(keras.layers.Add(name="add_2")([h, f]))
    h = keras.layers.GlobalAveragePooling1D(name="pool")(h)
    out = keras.layers.Dense(3, name="logits")(h)
    model = keras.Model(ids, out)
    opt = {"sgd": lambda: keras.optimizers.SGD(0.05), "adam": lambda: keras.optimizers.Adam(0.01)}
    model.compile(optimizer=opt[optimizer](),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def batches(n_batches=6, batch=8, seed=4):
    """Padded batches of different lengths (4 to 12), each row with its own length."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n_batches):
        length = int(rng.integers(4, 13))
        x = np.zeros((batch, length), np.int32)
        for row in range(batch):
            n = int(rng.integers(2, length + 1))
            x[row, :n] = rng.integers(1, VOCAB, n)
        out.append((x, rng.integers(0, 3, batch)))
    return out


def dataset(data):
    """One element per batch, in order, the cardinality known: with an unknown one,
    Keras's `model.fit` (3.15) counts one more optimizer iteration per epoch when it
    reaches the end of the data, which moves Adam's bias correction (hyparflow counts
    the steps it takes)."""

    def gen():
        yield from data

    return tf.data.Dataset.from_generator(gen, output_signature=(
        tf.TensorSpec((None, None), tf.int32), tf.TensorSpec((None,), tf.int64))).apply(
        tf.data.experimental.assert_cardinality(len(data)))


@pytest.mark.parametrize("optimizer,tol", [("sgd", 1e-5), ("adam", 1e-4)])
def test_variable_length_batches_across_stages(optimizer, tol):
    data = batches()
    build = lambda: encoder(optimizer)  # noqa: E731
    model = build()
    start = model.get_weights()
    model.fit(dataset(data), epochs=2, verbose=0)
    expected = model.get_weights()
    for s, r, m in [(2, 1, 2), (4, 1, 2), (2, 2, 2)]:
        results = train_ranks(build, dataset(data), None, num_stages=s, num_replicas=r,
                              num_microbatches=m, weights=start, epochs=2)
        diff = max(max_diff(w, expected) for w, _ in results)
        assert diff <= tol, f"(S,R,M)={(s, r, m)}: max weight difference {diff:g} > {tol:g}"


def test_the_mask_crosses_with_its_tensor():
    """Cut right after the Embedding: without its mask the next stage would pool the
    padding too, and the loss would differ from model.fit's."""
    data = batches(3)
    model = encoder()
    start = model.get_weights()
    expected = model.evaluate(dataset(data), verbose=0)
    from hyparflow.engine.local import run_ranks

    def body(comm):
        import hyparflow as hf

        m = encoder()
        m.set_weights(start)
        return hf.evaluate(m, dataset(data), num_stages=2, balance=[1, 12], comm=comm)

    losses = run_ranks(2, body, timeout=300)
    np.testing.assert_allclose(losses, [expected] * 2, rtol=1e-5)


def test_one_compiled_function_for_every_length():
    """A new length does not trace the stage again (shape-polymorphic signature)."""
    from hyparflow.engine.local import run_ranks

    data = batches(6)
    start = encoder().get_weights()

    def body(comm):
        import hyparflow as hf

        m = encoder()
        m.set_weights(start)
        hf.fit(m, dataset(data), num_stages=2, num_microbatches=2, comm=comm, verbose=0)
        return tracing_count(m)

    counts = run_ranks(2, body, timeout=300)
    assert len({x.shape[1] for x, _ in data}) >= 4
    assert all(c <= 2 for c in counts), counts


def tracing_count(model):
    """How many times hyparflow traced this rank's stage functions (`Stage._functions`)."""
    import gc

    from hyparflow.engine.stage import Stage

    stages = [o for o in gc.get_objects() if isinstance(o, Stage) and o.model is model]
    return max(f.experimental_get_tracing_count() for s in stages for k, f in s._functions.items()
               if hasattr(f, "experimental_get_tracing_count") and k[0] in ("train", "fused"))


@pytest.mark.parametrize("stages", [1, 2])
def test_variable_lengths_with_attention_split_by_heads(stages):
    """T=2: the attention's heads and the feed-forward pair split over two ranks per
    stage, on batches of different lengths with their padding masks."""
    data = batches(4)
    build = lambda: encoder("adam")  # noqa: E731
    model = build()
    start = model.get_weights()
    model.fit(dataset(data), epochs=2, verbose=0)
    expected = model.get_weights()
    results = train_ranks(build, dataset(data), None, num_stages=stages, num_replicas=1,
                          num_microbatches=2, num_tensor=2, weights=start, epochs=2,
                          tensor_layers=["attention", "ffn_in", "ffn_out"])
    diff = max(max_diff(w, expected) for w, _ in results)
    assert diff <= 1e-4, f"S={stages} T=2: max weight difference {diff:g}"
