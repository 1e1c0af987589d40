"""Keras Hub's LLM decoder blocks split over tensor ranks (num_tensor=2), against plain
`model.fit` on one process: a tiny LlamaCausalLM (grouped-query attention, 4 query
heads sharing 2 key/value heads: one group per rank) and a tiny GemmaCausalLM (one
key/value head, kept whole on each rank), Adam, padding masks and per-token sample
weights, at T=2 and at S=2 T=2 M=2; and the blocks that are refused, with why."""

import keras
import numpy as np
import pytest

import models
from conftest import max_diff, reference, train_ranks
from hyparflow.graph import from_model
from hyparflow.kinds import tensor as hft

pytest.importorskip(
    "keras_hub", reason="Keras Hub is an optional extra (see docs/tensor.md)")

VOCAB, SEQ, BATCH = 41, 8, 8


def llm(kind, kv_heads, dropout=0.0):
    family = {"llama": "Llama", "mistral": "Mistral", "qwen": "Qwen", "gemma": "Gemma"}[kind]
    sizes = dict(intermediate_dim=64, head_dim=4) if kind == "gemma" else {}
    return lambda: models.causal_lm(family, vocab=VOCAB, num_query_heads=4,
                                    num_key_value_heads=kv_heads, dropout=dropout,
                                    learning_rate=1e-2, **sizes)


def data():
    """Token ids padded at the end (lengths 2..7), next-token targets, the padding as
    per-token sample weights (so microbatches hold different numbers of tokens)."""
    rng = np.random.default_rng(7)
    ids = rng.integers(1, VOCAB, (16, SEQ)).astype("int32")
    mask = np.ones_like(ids)
    for row in range(len(ids)):
        mask[row, int(rng.integers(2, SEQ)):] = 0
    ids *= mask
    return {"token_ids": ids, "padding_mask": mask}, np.roll(ids, -1, axis=1), mask


def blocks(model):
    graph = from_model(model)
    return graph, [i for i, node in enumerate(graph.nodes)
                   if isinstance(hft.kind_of(node.op), hft.BY_NAME["decoder"].__class__)]


def check(build, configs, tol=2e-6):
    x, y, mask = data()
    weights = mask.astype("float32")
    graph, nodes = blocks(build())
    names = [graph.nodes[i].op.name for i in nodes]
    assert len(names) == 1, names  # the backbone: a CausalLM's graph holds it as one call
    start, expected, _ = reference(build, x, y, epochs=1, batch_size=BATCH,
                                   sample_weight=weights)
    assert max_diff(start, expected) > 1e-3  # the test can fail
    for s, t, m in configs:
        results = train_ranks(build, x, y, num_stages=s, num_replicas=1, num_microbatches=m,
                              num_tensor=t, tensor_layers=names, weights=start,
                              batch_size=BATCH, epochs=1, shuffle=False, sample_weight=weights)
        for got, _ in results:
            assert max_diff(got, expected) < tol, ((s, t, m), max_diff(got, expected))


def test_llama_grouped_query_attention_split_by_groups():
    """4 query heads, 2 key/value heads: each rank one key/value head and its 2 query
    heads; the gate/up projections by columns, the down projection by rows."""
    check(llm("llama", 2), [(1, 2, 1), (2, 2, 2)])


@pytest.mark.parametrize("kind", ["mistral", "qwen"])
def test_mistral_and_qwen_split_by_groups(kind):
    """The same blocks as Llama's (Qwen's query/key/value projections with biases)."""
    check(llm(kind, 2), [(1, 2, 1)])


def test_gemma_single_key_value_head_kept_whole():
    """Gemma with one key/value head (multi-query): the query heads split 2 and 2, the
    key/value projections kept whole on both ranks with their gradients summed."""
    # Adam at lr 1e-2: 2.7e-6 measured; Gemma's round-off control (R=2, no split) is
    # 9.8e-7, Llama's kept key/value head 3.5e-7; a missing key/value gradient sum
    # moves weights by ~1e-2.
    check(llm("gemma", 1), [(1, 2, 1)], tol=1e-5)


def test_decoder_parts():
    """Rank 0's parts of a Llama block: one key/value head, its 2 query heads, half of
    the feed-forward's hidden units."""
    build = llm("llama", 2)
    model = build()
    graph, nodes = blocks(model)
    op = graph.nodes[nodes[0]].op
    part = hft.shard(op, hft.Split(nodes[0], "decoder"), 0, [0.5, 0.5], hft.Collectives())
    assert len(part.subs) == 8  # two blocks: attention, gate, up, down
    shapes = {v.path.split("/", 1)[1]: tuple(p.shape) for s in part.subs[:4]
              for v, p, axis in s.cuts if axis is not None}
    assert shapes == {
        "self_attention/query/kernel": (16, 2, 4),
        "self_attention/key/kernel": (16, 1, 4),
        "self_attention/value/kernel": (16, 1, 4),
        "self_attention/attention_output/kernel": (2, 4, 16),
        "feedforward_gate_dense/kernel": (16, 16),
        "feedforward_intermediate_dense/kernel": (16, 16),
        "feedforward_output_dense/kernel": (16, 16)}, shapes


@pytest.mark.parametrize("kind, kv, tensor, dropout, words", [
    ("llama", 2, 4, 0.0, "num_key_value_heads must be divisible by num_tensor"),
    ("llama", 4, 8, 0.0, "fewer query heads (4) than tensor ranks (8)"),
    ("llama", 2, 2, 0.1, "attention dropout (rate 0.1)"),
])
def test_refused_with_a_reason(kind, kv, tensor, dropout, words):
    build = llm(kind, kv, dropout)
    model = build()
    graph, nodes = blocks(model)
    reason = hft.why_not(graph, nodes[0], tensor)
    assert reason is not None and words in reason, reason


def test_planner_costs_of_a_decoder_block():
    """The cost model charges each block of a backbone two sums forward (attention,
    down projection) and three backward (the input's gradient at the attention and at
    each column)."""
    from hyparflow.planning import planner

    graph, nodes = blocks(llm("llama", 2)())
    network = planner.Network(1e-4, 1e-9)
    split = hft.Split(nodes[0], "decoder")
    forward, backward = hft.exchange(split, 100.0, 100.0, 2, network,
                                     op=graph.nodes[nodes[0]].op)
    assert forward == 2 * 2 * network.exchange(100.0, 2)  # two blocks
    assert backward == 2 * 3 * network.exchange(100.0, 2)
