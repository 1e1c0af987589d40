"""Transformers on the 2D tensor mesh (`tensor_mesh`, kinds/mesh): attention with its
projections by SUMMA and its heads over the mesh columns, against plain `model.fit` on
one process (SGD and Adam, a padding mask, 2 microbatches); EinsumDense projections;
Embedding with the vocabulary over the mesh rows; a GPT with tied embeddings."""

import keras
import numpy as np
import pytest

from conftest import max_diff, reference, train_ranks

L = keras.layers
SEQ, DIM, HEADS = 6, 8, 4
ENCODER = ["tokens", "attn", "ffn_up", "ffn_down"]


def encoder_classifier(optimizer="adam"):
    """A post-norm transformer encoder block (attention with a padding mask, residuals,
    LayerNorm, a GELU feed-forward pair, its second an EinsumDense) on the mesh;
    pooling and a softmax head after it, whole. The tokens come as features through a
    Dense (on the mesh too)."""
    keras.utils.set_random_seed(21)
    ids = keras.Input((SEQ,), dtype="int32", name="ids")
    features = keras.Input((SEQ, 5), name="features")
    x = L.Dense(DIM, name="tokens")(features)
    mask = keras.ops.expand_dims(keras.ops.not_equal(ids, 0), 1)
    # The key projection's bias has a gradient that is mathematically zero (softmax ignores
    # a constant added to a query's scores): Adam would turn its round-off into whole
    # steps, so only SGD runs the projections with biases.
    a = L.MultiHeadAttention(HEADS, 2, use_bias=optimizer == "sgd", name="attn")(
        x, x, attention_mask=mask)
    x = L.LayerNormalization(name="ln1")(L.Add(name="res1")([x, a]))
    h = L.Dense(16, activation="gelu", name="ffn_up")(x)
    h = L.EinsumDense("abc,cd->abd", (SEQ, DIM), bias_axes="d", name="ffn_down")(h)
    x = L.LayerNormalization(name="ln2")(L.Add(name="res2")([x, h]))
    x = L.GlobalAveragePooling1D()(x)
    out = L.Dense(3, activation="softmax", name="head")(x)
    model = keras.Model([ids, features], out)
    opt = keras.optimizers.SGD(0.1) if optimizer == "sgd" else keras.optimizers.Adam(1e-2)
    model.compile(optimizer=opt, loss="sparse_categorical_crossentropy")
    return model


def encoder_data(n=16):
    rng = np.random.default_rng(22)
    ids = rng.integers(1, 9, (n, SEQ)).astype("int32")
    lengths = rng.integers(2, SEQ + 1, n)
    ids[np.arange(SEQ)[None, :] >= lengths[:, None]] = 0  # padding at the end
    features = rng.normal(size=(n, SEQ, 5)).astype("float32") * (ids > 0)[..., None]
    return [ids, features], (ids[:, 0] % 3).astype("int32")


# Adam only, the stricter check (its state shows each part's gradient); SGD on the mesh is
# tests/kinds/test_mesh.py's. Each of these costs ~50 s of thread-ranks.
@pytest.mark.parametrize("optimizer", ["adam"])
def test_encoder_classifier_with_attention_on_a_2x2_mesh(optimizer):
    x, y = encoder_data()
    build = lambda: encoder_classifier(optimizer)  # noqa: E731
    start, want, _ = reference(build, x, y, epochs=1, batch_size=8)
    got = train_ranks(build, x, y, num_stages=1, num_replicas=1, num_microbatches=2,
                      weights=start, num_tensor=4, tensor_mesh=(2, 2), tensor_layers=ENCODER,
                      epochs=1, batch_size=8, shuffle=False)
    for weights, _ in got:
        assert max_diff(weights, want) < 2e-5


def mesh_region(model, layers):
    """{layer name: (its mesh kind, whether it gathers)} of the layers the 2x2 mesh
    chooses in `model` with `tensor_layers=layers`."""
    from hyparflow.graph import from_model
    from hyparflow.kinds import mesh

    graph = from_model(model)
    splits = mesh.choose(graph, range(len(graph.nodes)), 4, layers)
    return {graph.nodes[i].op.name: (s.kind, s.gather) for i, s in splits.items()}


def test_the_encoder_block_is_one_mesh_region_and_attention_refusals_say_why():
    """Every layer of the block is on the mesh and only the last (before pooling)
    gathers: no activation is made whole between attention and the feed-forward pair.
    Attention the mesh cannot run, named in tensor_layers, is refused with the reason."""
    from hyparflow.graph import from_model
    from hyparflow.kinds import mesh

    names = mesh_region(encoder_classifier(), ENCODER)
    assert names["attn"] == ("mesh-heads", False)
    assert names["ffn_down"] == ("mesh-einsum", False)
    assert [n for n, (_, gather) in names.items() if gather] == ["ln2"]
    assert set(names) == set(ENCODER) | {"res1", "ln1", "res2", "ln2"}
    for layer, words in [(L.MultiHeadAttention(3, 2, name="attn"), "3 heads do not divide"),
                         (L.MultiHeadAttention(4, 2, dropout=0.1, name="attn"), "dropout"),
                         (L.EinsumDense("abc,cde->abde", (SEQ, 2, 4), name="attn"),
                          "not a projection of the last axis")]:
        inp = keras.Input((SEQ, DIM))
        out = layer(inp) if isinstance(layer, L.EinsumDense) else layer(inp, inp)
        graph = from_model(keras.Model(inp, out))
        with pytest.raises(ValueError, match=words):
            mesh.choose(graph, range(len(graph.nodes)), 4, ["attn"])


VOCAB = 11
LM = ["tokens", "positions", "attn", "ffn_up", "ffn_down", "lm_head"]


def small_lm(optimizer="adam"):
    """A pre-norm decoder block with its token and position embeddings on the mesh
    (untied), causal attention, and a Dense language-model head on the mesh too, its
    logits in vocabulary blocks for the cross-entropy (kinds/mesh/logits.py)."""
    keras.utils.set_random_seed(23)
    ids = keras.Input((SEQ,), dtype="int32", name="ids")
    pos = keras.Input((SEQ,), dtype="int32", name="pos")
    x = L.Add(name="embed")([L.Embedding(VOCAB, DIM, name="tokens")(ids),
                             L.Embedding(SEQ, DIM, name="positions")(pos)])
    h = L.LayerNormalization(name="ln1")(x)
    # No biases: the key bias's gradient is zero but for round-off (softmax ignores a
    # constant added to a query's scores), which Adam scales up to steps of ~lr.
    h = L.MultiHeadAttention(HEADS, 2, use_bias=False, name="attn")(h, h,
                                                                    use_causal_mask=True)
    x = L.Add(name="res1")([x, h])
    h = L.LayerNormalization(name="ln2")(x)
    h = L.Dense(16, activation="gelu", name="ffn_up")(h)
    x = L.Add(name="res2")([x, L.Dense(DIM, name="ffn_down")(h)])
    x = L.LayerNormalization(name="final_norm")(x)
    logits = L.Dense(VOCAB, name="lm_head")(x)
    model = keras.Model([ids, pos], logits)
    opt = keras.optimizers.SGD(0.1) if optimizer == "sgd" else keras.optimizers.Adam(1e-2)
    model.compile(optimizer=opt,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def lm_data(n=16):
    """Token windows of a small vocabulary (every id repeats within a batch) and their
    next tokens."""
    rng = np.random.default_rng(24)
    stream = rng.integers(0, VOCAB, n * SEQ + 1).astype("int32")
    x = np.stack([stream[k * SEQ:(k + 1) * SEQ] for k in range(n)])
    y = np.stack([stream[k * SEQ + 1:(k + 1) * SEQ + 1] for k in range(n)])
    return [x, np.tile(np.arange(SEQ, dtype="int32"), (n, 1))], y


@pytest.mark.parametrize("optimizer", ["adam"])   # Adam: sparse rows stepped per occurrence
def test_language_model_with_embeddings_on_a_2x2_mesh(optimizer, monkeypatch):
    """Repeated ids: Adam steps a row once per occurrence, as model.fit's sparse
    gradient does, so the pairs each rank's block gets must be model.fit's. The
    cross-entropy is taken on the head's vocabulary blocks (no rank holds the logits
    whole in training)."""
    from hyparflow.kinds.mesh import logits

    seen, own = [], logits.per_token
    monkeypatch.setattr(logits, "per_token", lambda part, z, *rest: seen.append(
        z.shape[-1]) or own(part, z, *rest))
    x, y = lm_data()
    # Per-token weights (a padded tail weighs 0): the loss's normaliser is the batch's.
    weights = (np.arange(SEQ)[None, :] < np.arange(16)[:, None] % SEQ + 2).astype("float32")
    build = lambda: small_lm(optimizer)  # noqa: E731
    start, want, _ = reference(build, x, y, epochs=1, batch_size=8, sample_weight=weights)
    got = train_ranks(build, x, y, num_stages=1, num_replicas=1, num_microbatches=2,
                      weights=start, num_tensor=4, tensor_mesh=(2, 2), tensor_layers=LM,
                      epochs=1, batch_size=8, shuffle=False, sample_weight=weights)
    for weights, _ in got:
        assert max_diff(weights, want) < 2e-5
    assert sorted(set(seen)) == [5, 6]  # the vocabulary's blocks, on every rank


def test_gpt_with_tied_embeddings_on_a_2x2_mesh():
    """examples/gpt_text.py: pre-norm causal decoder blocks, sequences of any length,
    the token embedding's matrix reused for the logits (`TiedOutput`). The blocks run on
    the mesh; the tied embedding stays whole (replicated), since the output layer needs
    all of it, and naming it for the mesh is refused with that reason. SGD: the example's
    attention has biases, and the key bias's gradient is round-off only (Adam would step
    it by ~lr; the LM test above runs Adam without them)."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
        __file__)))), "examples"))
    import gpt_text
    from hyparflow.graph import from_model
    from hyparflow.kinds import mesh

    def build():
        model = gpt_text.build_model(context=8, dim=8, heads=2, blocks=1)
        model.compile(optimizer=keras.optimizers.SGD(0.1),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    ids = gpt_text.encode(gpt_text.read_source(400))
    x, y = gpt_text.windows(ids, 8, 8)
    x, y = x[:16], y[:16]
    blocks = ["block0_attention", "block0_ff1", "block0_ff2"]
    start, want, _ = reference(build, x, y, epochs=1, batch_size=8)
    got = train_ranks(build, x, y, num_stages=1, num_replicas=1, num_microbatches=2,
                      weights=start, num_tensor=4, tensor_mesh=(2, 2), tensor_layers=blocks,
                      epochs=1, batch_size=8, shuffle=False)
    for weights, _ in got:
        assert max_diff(weights, want) < 2e-5
    graph = from_model(build())
    with pytest.raises(ValueError, match="tied weights"):
        mesh.choose(graph, range(len(graph.nodes)), 4, blocks + ["token_embedding"])


def test_the_language_model_head_keeps_its_logits_in_vocabulary_blocks():
    """The LM's head is chosen as vocabulary-split logits (its cross-entropy taken on
    the blocks) when the compiled loss allows it; a loss or metric that reads whole
    logits keeps it a mesh Dense whose logits are gathered."""
    def head_kind(model):
        return mesh_region(model, LM)["lm_head"][0]

    model = small_lm()
    assert head_kind(model) == "mesh-logits"
    model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(
        from_logits=True), metrics=["accuracy"])
    assert head_kind(model) == "mesh-dense"
    model.compile(optimizer="adam", loss="mse")
    assert head_kind(model) == "mesh-dense"


def test_a_checkpoint_of_the_lm_at_2x2_resumes_as_replicas(tmp_path):
    """Written at 2x2 (the embeddings', attention's and head's blocks of the weights and
    of Adam's state put together), resumed at T=1 with 4 replicas: model.fit's weights."""
    from conftest import check_resumes

    x, y = lm_data()
    check_resumes(small_lm, x, y, tmp_path, [
        (1, dict(num_tensor=4, tensor_mesh=(2, 2), tensor_layers=LM, num_microbatches=2)),
        (2, dict(resume=True, num_replicas=4))], batch_size=8, ranks=4, tol=2e-5)
