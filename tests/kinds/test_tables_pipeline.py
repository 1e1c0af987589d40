"""Sharded embedding tables in pipelines and with tensor splits (issue 34): each
stage's tables sharded over the ranks that run that stage (its replicas, and its
tensor ranks), against plain `model.fit` on one process; the placement per stage;
what stays refused."""

import keras
import pytest

from conftest import max_diff, reference
from test_tables import ROWS, _errors, tables_data, tables_model

import hyparflow as hf
from hyparflow.engine.local import run_ranks

KINDS = {"user": "row", "item": "table", "cat": "column"}
# tables_model's layer calls: user 0, flatten 1, item 2, its mask 3, its masked mean 4,
# cat 5, sum 6, concatenate 7, Dense 8, Dense 9. `balance` counts calls per stage.
STAGE_0 = (7, 3)   # every table in stage 0
SPLIT = (3, 7)     # user and item in stage 0, cat in stage 1; item's mask crosses
FIRST = (1, 9)     # user in stage 0, item (masked multi-hot) and cat in stage 1


def named_model(optimizer):
    """tables_model with named Dense layers (a thread-rank's automatic names are its
    own): `hidden` is what the tensor ranks split."""
    keras.utils.set_random_seed(1)
    u = keras.Input((1,), dtype="int32", name="user_ids")
    i = keras.Input((3,), dtype="int32", name="item_ids")
    c = keras.Input((3,), dtype="int32", name="cat_ids")
    d = keras.Input((4,), name="feats")
    eu = keras.layers.Flatten()(keras.layers.Embedding(ROWS["user"], 4, name="user")(u))
    ei = keras.layers.GlobalAveragePooling1D()(
        keras.layers.Embedding(ROWS["item"], 4, mask_zero=True, name="item")(i))
    ec = keras.ops.sum(keras.layers.Embedding(ROWS["cat"], 4, name="cat")(c), axis=1)
    h = keras.layers.Concatenate()([eu, ei, ec, d])
    h = keras.layers.Dense(8, activation="relu", name="hidden")(h)
    model = keras.Model([u, i, c, d], keras.layers.Dense(1, name="top")(h))
    opt = {"adam": keras.optimizers.Adam(0.05), "sgd": keras.optimizers.SGD(0.1)}[optimizer]
    model.compile(optimizer=opt, loss="mse")
    return model


def _fit(build, start, ranks, **kwargs):
    """hf.fit on thread-ranks; per rank: (weights, {table: shape of the part it trains})."""
    x, y = tables_data()

    def body(comm):
        model = build()
        model.set_weights(start)
        hf.fit(model, x, y, batch_size=16, epochs=2, shuffle=False, verbose=0, comm=comm,
               embedding_sharding=KINDS, **kwargs)
        parts = {n: model.get_layer(n).__dict__.get("_hyparflow_table_part") for n in KINDS}
        return model.get_weights(), {n: None if p is None else tuple(p.variable.shape)
                                     for n, p in parts.items()}

    return run_ranks(ranks, body, timeout=300)


def _stage_of(cut):
    calls = {"user": 0, "item": 2, "cat": 5}
    return {n: int(i >= cut[0]) for n, i in calls.items()}


@pytest.mark.parametrize("cut,optimizer,micro,schedule", [
    (STAGE_0, "adam", 2, "1f1b"),
    (SPLIT, "sgd", 4, "zb-h1"),
    (FIRST, "adam", 4, "zb-batched"),
    (SPLIT, "adam", 2, "gpipe"),
])
def test_pipelined_tables_train_as_model_fit(cut, optimizer, micro, schedule):
    """S=2 x R=2: each table sharded over the 2 replicas of its stage (row, table and
    column kinds mixed, a masked multi-hot feature), whichever stage holds it."""
    build = lambda: tables_model(optimizer)  # noqa: E731
    x, y = tables_data()
    start, want, _ = reference(build, x, y, epochs=2, batch_size=16)
    out = _fit(build, start, 4, num_stages=2, num_replicas=2, num_microbatches=micro,
               balance=cut, schedule=schedule)
    for weights, _ in out:
        diff = max_diff(weights, want)
        assert diff <= (1e-6 if optimizer == "sgd" else 2e-6), (cut, schedule, diff)
    # Rank (replica r, stage s) = 2r + s holds parts of its stage's tables only:
    # together the two replicas of a stage hold each of its tables once.
    for name, s in _stage_of(cut).items():
        held = [out[2 * r + s][1][name] for r in range(2)]
        assert all(out[2 * r + 1 - s][1][name] is None for r in range(2)), name
        if KINDS[name] == "column":
            assert held == [(ROWS[name], 2)] * 2
        else:
            assert sum(h[0] for h in held) == ROWS[name] and all(h[1] == 4 for h in held)
            assert (min(h[0] for h in held) == 0) == (KINDS[name] == "table")


@pytest.mark.parametrize("stages,replicas,cut,optimizer", [
    (1, 2, None, "adam"), (2, 2, SPLIT, "sgd")])
def test_tables_with_tensor_ranks_train_as_model_fit(stages, replicas, cut, optimizer):
    """num_tensor=2 (`hidden` split): a stage's tables over its R x T ranks; the tensor
    ranks of a replica look the same ids up, and only tensor rank 0's gradients reach
    the owners (the others' would count each lookup twice)."""
    build = lambda: named_model(optimizer)  # noqa: E731
    x, y = tables_data()
    start, want, _ = reference(build, x, y, epochs=2, batch_size=16)
    out = _fit(build, start, stages * replicas * 2, num_stages=stages, num_replicas=replicas,
               num_tensor=2, tensor_layers=["hidden"], num_microbatches=2, balance=cut,
               schedule="zb-h1" if stages > 1 else "1f1b")
    for weights, _ in out:
        diff = max_diff(weights, want)
        assert diff <= (1e-6 if optimizer == "sgd" else 2e-6), (stages, diff)
    # Rank ((r * S) + s) * 2 + t: the user table's rows cut over a stage's 4 ranks.
    user = [held["user"] for _, held in out if held["user"] is not None]
    assert [h[0] for h in user] == [13, 13, 12, 12]


def test_checkpoint_of_a_pipeline_resumes_on_replicas(tmp_path):
    """A checkpoint written by S=2 x R=2 with sharded tables (each stage's replica 0
    writes its stage's whole tables and slots, gathered from the stage's owners)
    resumes on S=1 x R=4 with another sharding, ending at model.fit's weights (Adam)."""
    from conftest import check_resumes

    x, y = tables_data()
    first = dict(num_stages=2, num_replicas=2, num_microbatches=2, balance=SPLIT,
                 embedding_sharding=KINDS)
    then = dict(num_replicas=4, embedding_sharding={"user": "column", "item": "row"},
                resume=True)
    check_resumes(lambda: tables_model("adam"), x, y, tmp_path, [(1, first), (2, then)],
                  batch_size=16, ranks=4, tol=2e-6)


def test_placement_per_stage():
    """Every rank places every stage's tables (the plan it prints), each over the ranks
    of its own stage, `memory_limit` per stage; a rank builds parts of its stage's only."""
    from hyparflow.graph import from_model
    from hyparflow.kinds.tables import Tables
    from hyparflow.layout import Layout

    model = tables_model("adam")
    graph = from_model(model)
    layout = Layout(num_stages=2, num_replicas=2)
    stage_of = {i: int(i >= FIRST[0]) for i in range(len(graph.nodes))}
    tables = Tables.make(model, graph, layout, "auto", 3, stage_of=stage_of)
    assert tables.stages == [0, 1, 1] and tables.ranks == 2
    # "auto" per stage, by cost (no data given: uniform ids): each table's rows cut
    # over its own stage's 2 ranks, its load even.
    user, item, cat = tables.placements
    assert (user.kind, item.kind, cat.kind) == ("row", "row", "row")
    assert user.sizes == (25, 25) and item.sizes == (15, 15) and cat.sizes == (6, 6)
    # Rank 3 = (replica 1, stage 1): parts of stage 1's tables.
    assert sorted(part.op.name for part in tables.parts) == ["cat", "item"]
    text = tables.describe()
    assert "stage 0: embedding sharding over 2 ranks" in text and "stage 1:" in text
    # memory_limit holds per rank, so per stage: 1,300 bytes (3 values per weight
    # with Adam) fit the tables over two stages, not all of them on one stage's ranks.
    Tables.make(model, graph, layout, "auto", 0, stage_of=stage_of, memory_limit=1300)
    with pytest.raises(ValueError, match="memory_limit=1,300"):
        Tables.make(model, graph, layout, "auto", 0, stage_of={i: 0 for i in stage_of},
                    memory_limit=1300)
    # "table-row": the hosts of the stage's ranks. S=2 x R=4, replicas 0-1 on host a,
    # 2-3 on b: stage 0 runs on ranks 0, 2, 4, 6 (hosts a, a, b, b).
    hosts = ["a"] * 4 + ["b"] * 4
    rows = Tables.make(model, graph, Layout(num_stages=2, num_replicas=4),
                       {"user": "table-row", "item": "table-row"}, 0, hosts=hosts,
                       stage_of={i: 0 for i in stage_of})
    assert [p.sizes for p in rows.placements[:2]] == [(25, 25, 0, 0), (0, 0, 15, 15)]
    with pytest.raises(ValueError, match=r"\['users'\]"):
        Tables.make(model, graph, layout, {"users": "row"}, 0, stage_of=stage_of)


def test_what_stays_refused():
    x, y = tables_data()
    errors = _errors(4, {
        "one replica": (tables_model, x, y, {"embedding_sharding": "auto", "num_stages": 4,
                                             "num_replicas": 1}),
        "interleaved": (tables_model, x, y, {"embedding_sharding": "auto", "num_stages": 2,
                                             "num_replicas": 2, "num_chunks": 2,
                                             "schedule": "interleaved",
                                             "num_microbatches": 2}),
        "split table": (lambda: named_model("sgd"), x, y, {
            "embedding_sharding": {"user": "row"}, "num_replicas": 2, "num_tensor": 2,
            "tensor_layers": ["user", "hidden"]}),
    })
    assert "at least 2 ranks per stage" in errors["one replica"]
    assert "num_replicas=1 and num_tensor=1" in errors["one replica"]
    assert "num_chunks=1" in errors["interleaved"]
    assert "tensor_layers names ['user']" in errors["split table"]
