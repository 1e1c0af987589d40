"""Tensor parallelism for attention, split by heads (num_tensor=T), against plain Keras
on one process: a Transformer encoder classifier from keras.layers (and Keras Hub's
TransformerEncoder/Decoder when installed), even and uneven head shares, masks,
dropout, the parts and sums each rank makes, checkpoints re-shaped, and the layers
that cannot be split."""

import keras
import numpy as np
import pytest

import hyparflow as hf
from conftest import max_diff, train_ranks
from hyparflow import tensor as hft
from hyparflow.graph import from_model

L = keras.layers
EPOCHS, BATCH = 2, 16
SEQ, VOCAB, DIM, HEADS, KEY_DIM = 8, 20, 16, 4, 8


def encoder_model(optimizer="sgd", *, causal=False, dropout=0.0, value_dim=None,
                  output_shape=None, mask_zero=False, use_bias=True, attention=None):
    """Token + position embeddings, one post-norm encoder block (attention, FFN pair),
    mean over positions, a softmax head. Padding (id 0) is masked: by an explicit
    attention_mask built in the graph, or by `mask_zero` on the token embedding."""
    keras.utils.set_random_seed(11)
    ids = keras.Input((SEQ,), dtype="int32", name="ids")
    pos = keras.Input((SEQ,), dtype="int32", name="pos")
    tokens = L.Embedding(VOCAB, DIM, mask_zero=mask_zero, name="tokens")(ids)
    x = L.Add()([tokens, L.Embedding(SEQ, DIM, name="positions")(pos)])
    layer = attention or L.MultiHeadAttention(HEADS, KEY_DIM, value_dim=value_dim,
                                              dropout=dropout, output_shape=output_shape,
                                              use_bias=use_bias, seed=5, name="attn")
    kwargs = {"use_causal_mask": causal}
    if not mask_zero:
        kwargs["attention_mask"] = keras.ops.expand_dims(keras.ops.not_equal(ids, 0), 1)
    a = layer(x, x, **kwargs)
    if output_shape is not None:
        a = L.Dense(DIM, name="back")(a)
    x = L.LayerNormalization(name="ln1")(L.Add()([x, a]))
    h = L.Dense(32, activation="relu", name="ffn_up")(x)
    h = L.Dense(DIM, name="ffn_down")(h)
    x = L.LayerNormalization(name="ln2")(L.Add()([x, h]))
    x = L.GlobalAveragePooling1D()(x)
    out = L.Dense(3, activation="softmax", name="head")(x)
    model = keras.Model([ids, pos], out)
    model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    return model


def sequence_data(n=64):
    rng = np.random.default_rng(12)
    ids = rng.integers(1, VOCAB, (n, SEQ)).astype("int32")
    lengths = rng.integers(3, SEQ + 1, n)
    ids[np.arange(SEQ)[None, :] >= lengths[:, None]] = 0  # padding at the end
    pos = np.tile(np.arange(SEQ, dtype="int32"), (n, 1))
    y = (ids[:, 0] % 3).astype("int32")
    return [ids, pos], y


def reference(build, x, y):
    model = build()
    start = model.get_weights()
    history = model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    return start, model.get_weights(), history.history


def check(build, configs, layers=("attn",), tol=1e-5, shares=None, data=None):
    x, y = data or sequence_data()
    start, expected, expected_history = reference(build, x, y)
    for s, t, r, m in configs:
        results = train_ranks(build, x, y, num_stages=s, num_replicas=r, num_microbatches=m,
                              num_tensor=t, tensor_layers=list(layers), tensor_shares=shares,
                              weights=start, batch_size=BATCH, epochs=EPOCHS, shuffle=False)
        diff = max(max_diff(w, expected) for w, _ in results)
        print(f"(S,T,R,M)={(s, t, r, m)} shares={shares}: max weight difference {diff:.2e}")
        assert diff <= tol, f"(S,T,R,M)={(s, t, r, m)}: max weight difference {diff:g}"
        for w, h in results[1:]:
            assert max_diff(w, results[0][0]) == 0.0
        for key, values in expected_history.items():
            np.testing.assert_allclose(results[0][1][key], values, rtol=1e-4, atol=1e-5,
                                       err_msg=key)


def test_encoder_attention_split_sgd():
    check(encoder_model, [(1, 2, 1, 1), (2, 2, 1, 2)])
