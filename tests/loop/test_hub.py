"""Keras Hub backbones (random weights, small sizes: nothing is downloaded) trained
pipeline-parallel on batches of different lengths, against plain Keras.

They take `Input(shape=(None,))` (the sequence length changes per batch), a padding
mask as a second input read by every block, and GPT-2 ties its token embedding to its
output projection (a `ReversibleEmbedding` called twice, on the first and last stage)."""

import numpy as np
import pytest

keras_hub = pytest.importorskip(
    "keras_hub", reason="Keras Hub is an optional extra: pip install --no-deps keras-hub "
                        "(see README: Install)")

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

from conftest import max_diff, train_ranks  # noqa: E402

VOCAB = 97


def gpt2_lm():
    keras.utils.set_random_seed(31)
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=VOCAB, num_layers=4, num_heads=2, hidden_dim=32, intermediate_dim=64,
        max_sequence_length=64, dropout=0.0)
    logits = backbone.token_embedding(backbone.output, reverse=True)
    model = keras.Model(backbone.input, logits)
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def bert_classifier():
    keras.utils.set_random_seed(32)
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=VOCAB, num_layers=2, num_heads=2, hidden_dim=32, intermediate_dim=64,
        max_sequence_length=64, dropout=0.0)
    out = keras.layers.Dense(3, name="classes")(backbone.output["pooled_output"])
    model = keras.Model(backbone.input, out)
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def batches(kind, n=4, batch=8, seed=8):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        length = int(rng.integers(6, 17))
        ids = np.zeros((batch, length), np.int32)
        mask = np.zeros((batch, length), np.int32)
        for row in range(batch):
            k = int(rng.integers(3, length + 1))
            ids[row, :k] = rng.integers(1, VOCAB, k)
            mask[row, :k] = 1
        x = {"token_ids": ids, "padding_mask": mask}
        if kind == "bert":
            x["segment_ids"] = np.zeros_like(ids)
            y = rng.integers(0, 3, batch)
        else:
            y = np.roll(ids, -1, axis=1)
        out.append((x, y))
    return out


def dataset(data):
    x0 = data[0][0]
    spec = ({k: tf.TensorSpec((None, None), tf.int32) for k in x0},
            tf.TensorSpec((None,) * np.ndim(data[0][1]), tf.int64))
    return tf.data.Dataset.from_generator(
        lambda: ((x, y.astype("int64")) for x, y in data), output_signature=spec).apply(
        tf.data.experimental.assert_cardinality(len(data)))


@pytest.mark.parametrize("kind,configs", [
    ("gpt2", [(2, 1, 2), (3, 1, 1)]),
    ("bert", [(2, 1, 2), (2, 2, 1)]),
])
def test_hub_backbones_pipeline_parallel(kind, configs):
    build = gpt2_lm if kind == "gpt2" else bert_classifier
    data = batches(kind)
    model = build()
    start = model.get_weights()
    model.fit(dataset(data), epochs=2, verbose=0)
    expected = model.get_weights()
    for s, r, m in configs:
        results = train_ranks(build, dataset(data), None, num_stages=s, num_replicas=r,
                              num_microbatches=m, weights=start, epochs=2)
        diff = max(max_diff(w, expected) for w, _ in results)
        assert diff <= 1e-4, f"{kind} (S,R,M)={(s, r, m)}: max weight difference {diff:g}"
