"""The planner knows the 2D mesh (`tensor_mesh`): its candidates, its cost (compute and
state over q^2, the SUMMA traffic, the region's activations kept in blocks), a
memory budget that only the mesh meets, and a plan file that carries the mesh into
`fit(plan=FILE)`. No timing is asserted: the cost model's own numbers are."""

import keras
import pytest

import hyparflow
from conftest import max_diff, reference
from hyparflow import graph as G
from hyparflow import plan as P
from hyparflow.engine.local import run_ranks
from hyparflow.planning import costmodel, planner
from test_mesh import REGION, data, mlp

WIDTH, SEQ, BATCH = 512, 32, 64


def tokens_mlp(depth=4):
    """Dense layers over tokens [batch, 32, 512] (as a transformer's feed-forward
    stack): activations of 32 positions per sample outweigh each 512 x 512 kernel."""
    inp = keras.Input((SEQ, WIDTH))
    x = inp
    for k in range(depth):
        x = keras.layers.Dense(WIDTH, activation="relu", name=f"d{k}")(x)
    return keras.Model(inp, keras.layers.Dense(10, name="head")(x))


def costs(graph):
    """Rows as the profiles give them: time by the weights applied per sample, 4 bytes
    per weight, Adam's 8, and each call's output per sample."""
    return [(1e-4, 6 * n.params * SEQ / 1e10, 4 * n.params, 8 * n.params,
             4 * G.numel(graph.tensors[n.outputs[0]].shape)) for n in graph.nodes]


def test_the_planner_costs_the_mesh_and_picks_it_where_memory_binds():
    graph = G.from_model(tokens_mlp())
    rows = costs(graph)
    names = [n.name for n in graph.nodes]
    net = planner.Network(5e-6, 1e-10)
    plans = planner.search(graph, rows, 0.0, net, BATCH, 4)
    mesh = [p for p in plans if p["tensor_mesh"]]
    assert mesh and {tuple(p["tensor_mesh"]) for p in mesh} == {(2, 2)}
    assert all(p["tensor"] == 4 and p["tensor_layers"] == ["d0", "d1", "d2", "d3"]
               for p in mesh)
    # Memory per rank, by the model's own rows: the Dense kernels (and Adam's state) in
    # quarters; d0..d2's outputs kept in blocks of 1/4; d3's gathered whole for the head
    # (outside the region) and the head's own, whole. 1D at T=4 keeps every output whole.
    m = BATCH / 16
    state = sum((r[2] + r[3]) / (4 if n.startswith("d") else 1) for n, r in zip(names, rows))
    acts = sum(r[4] / (4 if n in ("d0", "d1", "d2") else 1) for n, r in zip(names, rows))
    [at16] = [p for p in mesh if p["microbatches"] == 16]
    assert max(at16["memory_bytes"]) == pytest.approx(state + acts * m)
    [oned] = [p for p in plans if p["tensor"] == 4 and not p["tensor_mesh"]
              and p["microbatches"] == 16]
    assert max(oned["memory_bytes"]) == pytest.approx(state + sum(r[4] for r in rows) * m)
    # Traffic: each Dense's SUMMA, the head's input gathered among the 4, the model's
    # input cut (its gradient gathered) on the way in.
    x = 4 * m * SEQ * WIDTH
    summa = sum(sum(costmodel.summa_seconds(2, x, 4 * n.params, net)) for n in graph.nodes
                if n.name.startswith("d"))
    edges = 2 * net.exchange(x / 4, 4)
    assert at16["comm_s"] == pytest.approx((summa + edges) * 16)
    assert costmodel.summa_bytes(2, x, x) == pytest.approx(6 * (2 - 1) / 2 * x / 2)
    # Without a budget the mesh's 4q rounds a layer cost more than they save here:
    # the fastest plan is another one, by the model's own step times.
    assert not plans[0]["tensor_mesh"]
    assert plans[0]["step_s"] < min(p["step_s"] for p in mesh)
    # A budget per rank that only the mesh meets: the planner picks it.
    least = min(max(p["memory_bytes"]) for p in mesh)
    assert all(max(p["memory_bytes"]) > least for p in plans if not p["tensor_mesh"])
    tight = planner.search(graph, rows, 0.0, net, BATCH, 4, memory_limit=least)
    assert tight[0]["fits"] and tight[0]["tensor_mesh"] == [2, 2]
    assert planner.as_layout(tight[0]).tensor_mesh == (2, 2)
    # Nine ranks: 3x3 meshes are candidates too; without `meshes`, none.
    nine = planner.search(graph, rows, 0.0, net, BATCH, 9, microbatches=(1,))
    assert {tuple(p["tensor_mesh"]) for p in nine if p["tensor_mesh"]} == {(3, 3)}
    assert not any(p["tensor_mesh"] for p in planner.search(
        graph, rows, 0.0, net, BATCH, 4, microbatches=(1,), meshes=False))


def test_a_plan_file_with_a_mesh_trains_as_model_fit(tmp_path):
    """The plan file records tensor_mesh; fit(plan=FILE) runs the 2x2 mesh (its
    activations kept in quarters, as `tensor_mesh=(2, 2)` does) to model.fit's weights."""
    x, y = data()
    build = lambda: mlp("adam")  # noqa: E731
    graph = G.from_model(build())
    path = str(tmp_path / "plan.json")
    layout = planner.as_layout({"stages": 1, "replicas": 1, "microbatches": 2, "tensor": 4,
                                "schedule": "1f1b", "counts": [len(graph.nodes)],
                                "tensor_layers": REGION, "tensor_mesh": [2, 2]})
    assert P.write(path, graph, layout)["tensor_mesh"] == [2, 2]
    start, want, _ = reference(build, x, y, epochs=2, batch_size=16)

    def body(comm):
        model = build()
        model.set_weights(start)
        history = hyparflow.fit(model, x, y, epochs=2, batch_size=16, shuffle=False,
                                verbose=0, comm=comm, plan=path)
        return model.get_weights(), history.kept_per_sample

    head = 16 * 4
    whole = (12 + 16 + 18 + 18 + 16 + 16 + 16) * 4
    for weights, kept in run_ranks(4, body, timeout=300):
        assert max_diff(weights, want) < 2e-5
        assert kept == (whole - head) / 4 + head
    with pytest.raises(ValueError, match="contradicts"):
        hyparflow.layout.resolve(4, plan=path, tensor_mesh=(3, 3))


def test_attention_and_embeddings_are_costed_as_mesh_kinds():
    """Each mesh kind says what it exchanges: attention its four SUMMA projections over a
    quarter of its weights each, the Embedding its column's sums, a LayerNorm its row
    statistics; their weights are held in blocks (1/q^2), a norm's by columns (1/q)."""
    L = keras.layers
    ids = keras.Input((SEQ,), dtype="int32")
    x = L.Embedding(1024, 256)(ids)
    h = L.MultiHeadAttention(4, 64)(x, x, use_causal_mask=True)
    x = L.LayerNormalization()(L.Add()([x, h]))
    x = L.Dense(1024, activation="gelu")(x)
    graph = G.from_model(keras.Model(ids, L.Dense(256)(x)))
    net, m, q = planner.Network(5e-6, 1e-10), 4, 2
    split, weights, _ = planner.mesh_costs(graph, q, m, net)
    by_kind = {type(n.op).__name__: n.index for n in graph.nodes if n.index in split}
    attn = graph.nodes[by_kind["MultiHeadAttention"]]
    x = 4 * m * G.numel(graph.tensors[attn.inputs[0]].shape)
    forward = 4 * costmodel.summa_seconds(q, x, attn.params, net)[0]
    assert split[attn.index][1] == pytest.approx(forward)
    assert weights[attn.index] == q * q
    assert weights[by_kind["Embedding"]] == q * q and split[by_kind["Embedding"]][1] > 0
    assert weights[by_kind["LayerNormalization"]] == q
