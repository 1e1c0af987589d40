"""Keras masks on the 2D tensor mesh: padded sequences from a `mask_zero` Embedding on
the mesh, attention taking its padding from the Keras masks (with and without a causal
mask), masked pooling after the mesh, and a per-token loss over padded tokens, whose
normaliser is the whole batch's valid tokens; against plain `model.fit` on one process,
with Adam, at M=2 and with replicas."""

import keras
import numpy as np

from conftest import max_diff, reference, train_ranks
from test_mesh_models import mesh_region

L = keras.layers
SEQ, DIM, HEADS, VOCAB = 6, 8, 4, 13
BLOCK = ["tokens", "attn", "ffn_up", "ffn_down"]


def padded_ids(n, seed):
    """Ids 1..VOCAB-1 with a padded tail (0) of every length from none to SEQ - 2, some
    ids repeated within a batch."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, VOCAB, (n, SEQ)).astype("int32")
    lengths = 2 + np.arange(n) % (SEQ - 1)
    ids[np.arange(SEQ)[None, :] >= lengths[:, None]] = 0
    return ids


def encoder(causal=False, per_token=False):
    """A post-norm transformer block after a `mask_zero` Embedding, every layer of it on
    the mesh, no attention_mask given: attention reads the padding from the Keras masks.
    Then masked average pooling and a softmax head (a classifier), or per-token logits
    (a tagger: the loss masked by the padding). No biases in attention (Adam and a
    gradient that is zero but for round-off)."""
    keras.utils.set_random_seed(31)
    ids = keras.Input((SEQ,), dtype="int32", name="ids")
    x = L.Embedding(VOCAB, DIM, mask_zero=True, name="tokens")(ids)
    a = L.MultiHeadAttention(HEADS, 2, use_bias=False, name="attn")(
        x, x, use_causal_mask=causal)
    x = L.LayerNormalization(name="ln1")(L.Add(name="res1")([x, a]))
    h = L.Dense(16, activation="gelu", name="ffn_up")(x)
    x = L.LayerNormalization(name="ln2")(L.Add(name="res2")([x, L.Dense(DIM, name="ffn_down")(h)]))
    if per_token:
        out = L.Dense(5, name="tags")(x)
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    else:
        out = L.Dense(3, activation="softmax", name="head")(L.GlobalAveragePooling1D()(x))
        loss = "sparse_categorical_crossentropy"
    model = keras.Model(ids, out)
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss=loss)
    return model


def fit_both(build, x, y, **layout):
    """model.fit's weights after one epoch of two batches, and hf.fit's on the ranks
    (M=2 on a 2x2 mesh)."""
    start, want, _ = reference(build, x, y, epochs=1, batch_size=8)
    ranks = train_ranks(build, x, y, num_stages=1, num_replicas=layout.pop("num_replicas", 1),
                        num_microbatches=2, weights=start, num_tensor=4,
                        tensor_mesh=(2, 2), epochs=1, batch_size=8, shuffle=False, **layout)
    return want, ranks


def test_padded_classifier_on_the_mesh_pools_as_model_fit():
    """The Embedding, attention, norms and feed-forward pair on the mesh; the pooling
    after it reads the gathered value's whole mask."""
    ids = padded_ids(16, 32)
    y = (ids[:, 0] % 3).astype("int32")
    want, got = fit_both(encoder, ids, y, tensor_layers=BLOCK)
    for weights, _ in got:
        assert max_diff(weights, want) < 2e-5


def test_padded_tagger_with_a_causal_mask_divides_by_the_batchs_tokens():
    """Per-token logits over padded tokens: the masked loss of each microbatch and
    replica is divided by the valid tokens of the whole batch, as model.fit divides;
    attention takes the padding and the causal mask together. The microbatches' valid
    tokens differ (lengths 2..6). R=2: 8 thread-ranks. (At n=4 under mpiexec:
    tests/mpi/test_mesh_mpi.py.)"""
    ids = padded_ids(16, 33)
    tags = (ids % 5).astype("int32")
    build = lambda: encoder(causal=True, per_token=True)  # noqa: E731
    want, got = fit_both(build, ids, tags, num_replicas=2, tensor_layers=BLOCK + ["tags"])
    for weights, _ in got:
        assert max_diff(weights, want) < 2e-5


def test_the_masked_block_is_one_mesh_region():
    """With a Keras mask on every value, the block is still one region that gathers
    only before the pooling; the per-token head on a masked value keeps its logits
    whole (the vocabulary-split loss does not take masks)."""
    names = mesh_region(encoder(), BLOCK)
    assert names["tokens"] == ("mesh-embedding", False)
    assert names["attn"] == ("mesh-heads", False)
    assert [n for n, (_, gather) in names.items() if gather] == ["ln2"]
    assert mesh_region(encoder(per_token=True), BLOCK + ["tags"])["tags"][0] == "mesh-dense"
