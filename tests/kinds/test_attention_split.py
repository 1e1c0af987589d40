"""Tensor parallelism for attention, split by heads (num_tensor=T), against plain Keras
on one process: a Transformer encoder classifier from keras.layers (and Keras Hub's
TransformerEncoder/Decoder when installed), even and uneven head shares, masks,
dropout, the parts and sums each rank makes, checkpoints re-shaped, and the layers
that cannot be split."""

import keras
import numpy as np
import pytest

import hyparflow as hf
from conftest import check_resumes, max_diff, reference, train_ranks
from hyparflow.kinds import tensor as hft
from hyparflow.graph import from_model

L = keras.layers
EPOCHS, BATCH = 2, 16
SEQ, VOCAB, DIM, HEADS, KEY_DIM = 8, 20, 16, 4, 8


def encoder_model(optimizer="sgd", *, causal=False, dropout=0.0, value_dim=None,
                  output_shape=None, mask_zero=False, use_bias=True, dense_input=False):
    """Token + position embeddings, one post-norm encoder block (attention, FFN pair),
    mean over positions, a softmax head. Padding (id 0) is masked: by an explicit
    attention_mask built in the graph, or by `mask_zero` on the token embedding.
    `dense_input`: the tokens come as features through a Dense instead (for Adam:
    Keras steps Adam on an Embedding's sparse gradient row by row, see docs/models.md)."""
    keras.utils.set_random_seed(11)
    ids = keras.Input((SEQ,), dtype="int32", name="ids")
    if dense_input:
        features = keras.Input((SEQ, 5), name="features")
        inputs = [ids, features]
        x = L.Dense(DIM, name="tokens")(features)
    else:
        pos = keras.Input((SEQ,), dtype="int32", name="pos")
        inputs = [ids, pos]
        tokens = L.Embedding(VOCAB, DIM, mask_zero=mask_zero, name="tokens")(ids)
        x = L.Add()([tokens, L.Embedding(SEQ, DIM, name="positions")(pos)])
    layer = L.MultiHeadAttention(HEADS, KEY_DIM, value_dim=value_dim, dropout=dropout,
                                 output_shape=output_shape, use_bias=use_bias, seed=5,
                                 name="attn")
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
    model = keras.Model(inputs, out)
    model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    return model


def sequence_data(n=64, dense_input=False):
    rng = np.random.default_rng(12)
    ids = rng.integers(1, VOCAB, (n, SEQ)).astype("int32")
    lengths = rng.integers(3, SEQ + 1, n)
    ids[np.arange(SEQ)[None, :] >= lengths[:, None]] = 0  # padding at the end
    y = (ids[:, 0] % 3).astype("int32")
    if dense_input:
        features = rng.normal(size=(n, SEQ, 5)).astype("float32") * (ids > 0)[..., None]
        return [ids, features], y
    pos = np.tile(np.arange(SEQ, dtype="int32"), (n, 1))
    return [ids, pos], y



def check(build, configs, layers=("attn",), tol=1e-5, shares=None, data=None):
    x, y = data or sequence_data()
    start, expected, expected_history = reference(build, x, y, epochs=EPOCHS, batch_size=BATCH)
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


def test_encoder_uneven_heads_adam():
    """Shares 3:1 give rank 0 three heads and rank 1 one; with Adam (its state split
    like the weights) and the FFN pair split too."""
    check(lambda: encoder_model(keras.optimizers.Adam(0.01), dense_input=True),
          [(1, 2, 1, 2), (2, 2, 1, 1)], layers=["attn", "ffn_up", "ffn_down"], tol=1e-4,
          shares=[3, 1], data=sequence_data(dense_input=True))


def test_causal_mask_and_other_shapes():
    """A causal mask on top of the padding mask, value_dim != key_dim, an output_shape."""
    check(lambda: encoder_model(causal=True, value_dim=6, output_shape=(10,)),
          [(1, 2, 1, 2)], shares=[1, 3])


def test_attention_dropout_is_the_one_process_mask():
    """Dropout on the attention probabilities: hyparflow draws a microbatch's masks from
    (seed, microbatch, generator), not from the rank (docs/models.md), so T=2 must give
    T=1's weights; each rank draws the whole layer's mask and keeps its heads (a mask
    drawn for the rank's heads alone would differ)."""
    x, y = sequence_data()
    build = lambda: encoder_model(dropout=0.3)  # noqa: E731
    start = build().get_weights()

    def run(t, shares=None, seed=7):
        results = train_ranks(build, x, y, num_stages=1, num_replicas=1, num_microbatches=2,
                              num_tensor=t, tensor_layers=["attn"] if t > 1 else None,
                              tensor_shares=shares, weights=start, batch_size=BATCH,
                              epochs=EPOCHS, shuffle=False, seed=seed)
        return results[0][0]

    one = run(1)
    assert max_diff(one, run(2, [1, 3])) <= 1e-5
    assert max_diff(one, run(1, seed=8)) > 1e-4  # the masks matter


def test_keras_masks_from_mask_zero():
    """The padding mask as a Keras mask (an unsplit Embedding with mask_zero=True)."""
    check(lambda: encoder_model(mask_zero=True), [(1, 2, 1, 1)])


def test_evaluate_and_predict_with_heads_split():
    """Inference (no dropout, training=False) through the split layer, 2 stages x 2
    tensor ranks, 1:3: Keras's loss and predictions."""
    from hyparflow.engine.local import run_ranks

    x, y = sequence_data()
    build = lambda: encoder_model(dropout=0.3, causal=True)  # noqa: E731
    model = build()
    start = model.get_weights()
    expected_loss = model.evaluate(x, y, batch_size=BATCH, verbose=0)[0]
    expected = model.predict(x, batch_size=BATCH, verbose=0)
    kwargs = dict(batch_size=BATCH, num_stages=2, num_tensor=2, tensor_layers=["attn"],
                  tensor_shares=[1, 3])

    def body(comm):
        model = build()
        model.set_weights(start)  # (thread-ranks build concurrently: not one seed each)
        loss = hf.evaluate(model, x, y, comm=comm, **kwargs)[0]
        return loss, hf.predict(model, x, comm=comm, **kwargs)

    for loss, predictions in run_ranks(4, body, timeout=300):
        assert abs(loss - expected_loss) <= 1e-5
        assert np.max(np.abs(predictions - expected)) <= 1e-5


def scores_model():
    """The attention scores (gathered over the ranks' heads) feed the loss too."""
    keras.utils.set_random_seed(13)
    ids = keras.Input((SEQ,), dtype="int32", name="ids")
    pos = keras.Input((SEQ,), dtype="int32", name="pos")
    x = L.Add()([L.Embedding(VOCAB, DIM)(ids), L.Embedding(SEQ, DIM)(pos)])
    a, scores = L.MultiHeadAttention(HEADS, KEY_DIM, use_bias=False, name="attn")(
        x, x, return_attention_scores=True, use_causal_mask=True)
    x = L.Concatenate()([L.Flatten()(a), L.Flatten()(scores)])
    out = L.Dense(3, activation="softmax", name="head")(x)
    model = keras.Model([ids, pos], out)
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    return model


def test_return_attention_scores():
    check(scores_model, [(1, 2, 1, 1)], shares=[1, 3])


def test_the_heads_are_split_and_summed_once_each_way(monkeypatch):
    """Each rank holds its heads' slices (2 of 4; 3 and 1 with shares 3:1), and an
    attention layer exchanges one activation forward (the sum) and one backward (the
    input gradient's sum) per microbatch, whatever the shares."""
    from hyparflow.engine.local import run_ranks

    x, y = sequence_data()
    seen = []
    exchange = hft.Collectives.exchange

    def counted(self, array, shapes, what, *tag):
        if what == "layer 'attn'" and np.shape(array) == (BATCH // 2, SEQ, DIM):
            seen.append(self.comm.rank)
        return exchange(self, array, shapes, what, *tag)

    monkeypatch.setattr(hft.Collectives, "exchange", counted)
    for shares, heads in ((None, [2, 2]), ([3, 1], [3, 1])):
        seen.clear()

        def body(comm):
            model = encoder_model()
            hf.fit(model, x, y, batch_size=BATCH, epochs=1, num_tensor=2, comm=comm,
                   tensor_layers=["attn"], tensor_shares=shares, num_microbatches=2,
                   shuffle=False, verbose=0)
            layer = model.get_layer("attn")
            (shard,) = layer._hyparflow_shards.values()
            return {v.path: tuple(p.shape) for v, p, _ in shard.cuts}

        parts = run_ranks(2, body, timeout=300)
        for rank, shapes in enumerate(parts):
            n = heads[rank]
            assert shapes == {
                "attn/query/kernel": (DIM, n, KEY_DIM), "attn/query/bias": (n, KEY_DIM),
                "attn/key/kernel": (DIM, n, KEY_DIM), "attn/key/bias": (n, KEY_DIM),
                "attn/value/kernel": (DIM, n, KEY_DIM), "attn/value/bias": (n, KEY_DIM),
                "attn/attention_output/kernel": (n, KEY_DIM, DIM),
                "attn/attention_output/bias": (DIM,)}, shapes
        steps, microbatches = len(y) // BATCH, 2
        assert seen.count(0) == seen.count(1) == 2 * steps * microbatches


def test_choose_splits_attention_by_size_or_name():
    model = encoder_model()
    graph = from_model(model)
    nodes = range(len(graph.nodes))
    kinds = {graph.nodes[i].op.name: sp.kind
             for i, sp in hft.choose(graph, nodes, 2, ["attn", "ffn_up", "ffn_down"]).items()}
    assert kinds == {"attn": "heads", "ffn_up": "column", "ffn_down": "row"}
    params = model.get_layer("attn").count_params()
    auto = hft.choose(graph, nodes, 2, None, min_params=params)
    assert {graph.nodes[i].op.name for i in auto} == {"attn"}
    assert hft.choose(graph, nodes, 2, None, min_params=params + 1) == {}


def test_adam_state_of_every_part_is_found():
    """The optimizer state of the seven cut variables (query/key/value kernels and
    biases, output kernel) is found by name, with the axis it is cut on; the output
    bias is whole (its state is the layer's own)."""
    model = encoder_model()
    layer = model.get_layer("attn")
    shard = hft.Shard(layer, hft.Split(0, "heads"), 1, [0.75, 0.25], hft.Collectives())
    parts = [p for _, p, axis in shard.cuts if axis is not None]
    assert len(parts) == 7 and all(p.shape[axis] == 1 for _, p, axis in shard.cuts
                                   if axis is not None)  # rank 1's one head of four
    optimizer = keras.optimizers.Adam()
    optimizer.build(parts + [layer.output_dense.bias])
    slots = shard.slots(optimizer)
    assert len(slots) == 14  # momentum and velocity of each part
    by_name = {slot.name: axis for slot, axis in slots}
    assert by_name["attn_query_kernel_momentum"] == -2
    assert by_name["attn_value_bias_velocity"] == -2
    assert by_name["attn_attention_output_kernel_momentum"] == 0
    assert not any("attention_output_bias" in name for name in by_name)


def test_checkpoint_reshapes_the_heads(tmp_path):
    """A checkpoint written with T=2 (heads 3:1) resumes with T=1 (2 stages), then with
    T=2 (even): Adam's state of the heads is saved whole and cut again, and the
    result is one-process Keras's."""
    layers = ["attn", "ffn_up", "ffn_down"]
    check_resumes(lambda: encoder_model(keras.optimizers.Adam(0.01), dense_input=True),
                  *sequence_data(dense_input=True), tmp_path,
                  [(1, dict(num_tensor=2, tensor_layers=layers, tensor_shares=[3, 1])),
                   (2, dict(num_stages=2, resume=True)),
                   (3, dict(num_tensor=2, tensor_layers=layers, resume=True))],
                  batch_size=BATCH, tol=1e-4)


class ScaledAttention(L.MultiHeadAttention):
    """A subclass whose attention hyparflow cannot follow head by head."""

    def _compute_attention(self, query, key, value, attention_mask=None, training=None,
                           return_attention_scores=False):
        out, scores = super()._compute_attention(query, key, value, attention_mask, training,
                                                 return_attention_scores)
        return out * 2.0, scores


class ReturnsTwice(L.MultiHeadAttention):
    """A subclass with a `call` of its own (unknown to hyparflow)."""

    def call(self, query, value, key=None, **kwargs):
        return super().call(query, value, key, **kwargs) * 2.0


def attention_variant(make):
    """A small model around the attention layer `make()` builds."""

    def build():
        keras.utils.set_random_seed(11)
        ids = keras.Input((SEQ,), dtype="int32")
        x = L.Embedding(VOCAB, DIM)(ids)
        a = make()(x, x)
        out = L.Dense(3, activation="softmax")(L.GlobalAveragePooling1D()(a))
        model = keras.Model(ids, out)
        model.compile("sgd", "sparse_categorical_crossentropy")
        return model

    return build


def test_attention_that_cannot_be_split_says_why():
    x, y = sequence_data()

    def err(make):
        build = attention_variant(make)
        errors = []

        def body(comm):
            try:
                hf.fit(build(), x[0], y, batch_size=BATCH, comm=comm, verbose=0, num_tensor=2,
                       tensor_layers=["attn"])
            except ValueError as exc:
                errors.append(str(exc))
                return
            raise AssertionError("no error")

        from hyparflow.engine.local import run_ranks
        run_ranks(2, body, timeout=120)
        assert len(errors) == 2 and "Layer 'attn' is in tensor_layers but cannot be split" in errors[0]
        return errors[0]

    assert "fewer heads (1) than tensor ranks (2)" in err(
        lambda: L.MultiHeadAttention(1, 8, name="attn"))
    assert "kernel regularizer (its sublayer 'query')" in err(
        lambda: L.MultiHeadAttention(2, 8, kernel_regularizer="l2", name="attn"))
    assert "overrides MultiHeadAttention._compute_attention" in err(
        lambda: ScaledAttention(2, 8, name="attn"))
    assert "ReturnsTwice overrides MultiHeadAttention.call" in err(
        lambda: ReturnsTwice(2, 8, name="attn"))

    def frozen():
        layer = L.MultiHeadAttention(2, 8, name="attn")
        layer.trainable = False
        return layer

    assert "frozen" in err(frozen)


def keras_hub_or_skip():
    return pytest.importorskip(
        "keras_hub", reason="Keras Hub is an optional extra (see docs/tensor.md: "
        "pip install -e '.[hub]' && pip install --no-deps keras-hub)")


def hub_model(kind, optimizer="sgd", dropout=0.0):
    """Keras Hub's TransformerEncoder / TransformerDecoder (decoder-only: causal
    self-attention) as one layer call in a Functional model, padding masked."""
    keras_hub = keras_hub_or_skip()
    keras.utils.set_random_seed(14)
    ids = keras.Input((SEQ,), dtype="int32", name="ids")
    pos = keras.Input((SEQ,), dtype="int32", name="pos")
    x = L.Add()([L.Embedding(VOCAB, DIM, name="tokens")(ids),
                 L.Embedding(SEQ, DIM, name="positions")(pos)])
    padding = keras.ops.not_equal(ids, 0)
    if kind == "encoder":
        block = keras_hub.layers.TransformerEncoder(32, HEADS, dropout=dropout, name="block")
        x = block(x, padding_mask=padding)
    else:
        block = keras_hub.layers.TransformerDecoder(32, HEADS, dropout=dropout, name="block")
        x = block(x, decoder_padding_mask=padding)
    x = L.GlobalAveragePooling1D()(x)
    out = L.Dense(3, activation="softmax", name="head")(x)
    model = keras.Model([ids, pos], out)
    model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    return model


@pytest.mark.parametrize("kind", ["encoder", "decoder"])
def test_keras_hub_blocks_split_their_attention(kind):
    """The attention layer inside one TransformerEncoder/Decoder call is split by heads
    (the block is chosen by size), even and 3:1, with a pipeline too."""
    keras_hub_or_skip()
    build = lambda: hub_model(kind)  # noqa: E731
    model = build()
    graph = from_model(model)
    (split,) = hft.choose(graph, range(len(graph.nodes)), 2, None,
                          min_params=model.get_layer("block").count_params()).values()
    assert split.kind == "inner"
    check(build, [(1, 2, 1, 1), (2, 2, 1, 2)], layers=["block"])
    check(build, [(1, 2, 1, 2)], layers=["block"], shares=[3, 1])


@pytest.mark.parametrize("kind", ["encoder", "decoder"])
def test_keras_hub_block_parts_and_sums(kind, monkeypatch):
    """Inside the block: the attention layer's heads (3 and 1 of 4) and the feed-forward
    Dense pair's hidden units (24 and 8 of 32) are split; per microbatch the attention
    and the pair each sum one activation forward and one backward."""
    from hyparflow.engine.local import run_ranks

    keras_hub_or_skip()
    x, y = sequence_data()
    build = lambda: hub_model(kind)  # noqa: E731
    seen = []
    exchange = hft.Collectives.exchange

    def counted(self, array, shapes, what, *tag):
        if np.shape(array) == (BATCH, SEQ, DIM):
            seen.append((self.comm.rank, what))
        return exchange(self, array, shapes, what, *tag)

    monkeypatch.setattr(hft.Collectives, "exchange", counted)

    def body(comm):
        model = build()
        hf.fit(model, x, y, batch_size=BATCH, epochs=1, num_tensor=2, comm=comm,
               tensor_layers=["block"], tensor_shares=[3, 1], shuffle=False, verbose=0)
        (nested,) = model.get_layer("block")._hyparflow_shards.values()
        return {v.path.split("/", 1)[1]: tuple(p.shape) for s in nested.subs
                for v, p, axis in s.cuts if axis is not None}

    parts = run_ranks(2, body, timeout=300)
    attention = "self_attention" if kind == "decoder" else "self_attention_layer"
    for rank, (heads, hidden) in enumerate([(3, 24), (1, 8)]):
        shapes = parts[rank]
        assert shapes[f"{attention}/query/kernel"] == (DIM, heads, DIM // HEADS), shapes
        assert shapes[f"{attention}/attention_output/kernel"] == (heads, DIM // HEADS, DIM)
        assert shapes["feedforward_intermediate_dense/kernel"] == (DIM, hidden)
        assert shapes["feedforward_output_dense/kernel"] == (hidden, DIM)
    steps = len(y) // BATCH
    for rank in (0, 1):
        whats = [w for r, w in seen if r == rank]
        assert whats.count(f"layer {attention!r}") == 2 * steps, sorted(set(whats))
        assert whats.count("layer 'feedforward_intermediate_dense'") == steps
        assert whats.count("layer 'feedforward_output_dense'") == steps


def image_attention_model():
    """Attention over both axes of a 4x4 grid (attention_axes=(1, 2)), gated, no biases."""
    keras.utils.set_random_seed(15)
    inp = keras.Input((4, 4, 6))
    x = L.Dense(DIM, name="embed")(inp)
    a = L.MultiHeadAttention(HEADS, 4, use_gate=True, use_bias=False, attention_axes=(1, 2),
                             name="attn")(x, x)
    x = L.LayerNormalization()(L.Add()([x, a]))
    out = L.Dense(3, activation="softmax", name="head")(L.GlobalAveragePooling2D()(x))
    model = keras.Model(inp, out)
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    return model


def test_gated_attention_over_two_axes():
    rng = np.random.default_rng(16)
    data = rng.normal(size=(48, 4, 4, 6)).astype("float32"), rng.integers(0, 3, 48)
    check(image_attention_model, [(1, 2, 1, 2)], shares=[1, 3], data=data)


def test_planner_costs_one_sum_each_way_for_attention():
    """The cost model charges an attention layer split by heads one sum of its output
    forward and one of its input's gradient backward (not a gather of a part)."""
    from hyparflow.planning import planner

    inp = keras.Input((SEQ, 128))
    out = L.MultiHeadAttention(8, 32, name="attn")(inp, inp)  # 132k weights: chosen by size
    graph = from_model(keras.Model(inp, out))
    network = planner.Network(1e-4, 1e-9)
    costs = planner.tensor_costs(graph, 2, 4, network)
    ((i, (divisor, forward, backward)),) = costs.items()
    assert graph.nodes[i].op.name == "attn" and divisor == 2
    assert forward == backward == network.exchange(4 * 4 * SEQ * 128, 2)


def test_keras_hub_block_checkpoint_reshapes(tmp_path):
    """A Keras Hub block's parts (attention heads, feed-forward pair) and their momentum
    are saved whole at T=2 (3:1) and resume at T=1 with 2 stages: Keras's weights."""
    keras_hub_or_skip()
    check_resumes(lambda: hub_model("encoder", keras.optimizers.SGD(0.05, momentum=0.9)),
                  *sequence_data(), tmp_path,
                  [(1, dict(num_tensor=2, tensor_layers=["block"], tensor_shares=[3, 1])),
                   (2, dict(num_stages=2, resume=True))],
                  batch_size=BATCH)
