"""Embedding tables sharded over the replicas (issue 34, `kinds/tables`): every kind,
alone and mixed, at R=2 and R=4, with SGD, Adam and Adagrad, single-hot and multi-hot
(masked mean and sum pooling) lookups, against plain `model.fit` on one process; what
each rank holds; the planner; bad input."""

import keras
import numpy as np
import pytest

from conftest import reference

import hyparflow as hf
from hyparflow.engine.local import run_ranks
from hyparflow.kinds.tables import plan as tplan

ROWS = {"user": 50, "item": 30, "cat": 12}
SEEN = 40  # user ids come from [0, SEEN): rows SEEN.. are never looked up


def tables_model(optimizer="adam", dim=4, bag=3, rows=ROWS):
    """Single-hot `user`, multi-hot `item` (mask_zero, masked mean), multi-hot `cat`
    (sum over a bag with repeats), dense features; two Dense layers on top."""
    keras.utils.set_random_seed(1)
    u = keras.Input((1,), dtype="int32", name="user_ids")
    i = keras.Input((bag,), dtype="int32", name="item_ids")
    c = keras.Input((bag,), dtype="int32", name="cat_ids")
    d = keras.Input((4,), name="feats")
    eu = keras.layers.Flatten()(keras.layers.Embedding(rows["user"], dim, name="user")(u))
    ei = keras.layers.GlobalAveragePooling1D()(
        keras.layers.Embedding(rows["item"], dim, mask_zero=True, name="item")(i))
    ec = keras.ops.sum(keras.layers.Embedding(rows["cat"], dim, name="cat")(c), axis=1)
    h = keras.layers.Concatenate()([eu, ei, ec, d])
    out = keras.layers.Dense(1)(keras.layers.Dense(8, activation="relu")(h))
    model = keras.Model([u, i, c, d], out)
    opt = {"adam": keras.optimizers.Adam(0.05), "sgd": keras.optimizers.SGD(0.1),
           "adagrad": keras.optimizers.Adagrad(0.1)}[optimizer]
    model.compile(optimizer=opt, loss="mse")
    return model


def tables_data(n=32, bag=3, seed=0, rows=ROWS):
    rng = np.random.default_rng(seed)
    x = [rng.integers(0, SEEN, (n, 1)), rng.integers(0, rows["item"], (n, bag)),
         rng.integers(0, 4, (n, bag)),  # few ids: many repeats within a batch
         rng.normal(size=(n, 4))]
    x = [a.astype("int32") for a in x[:3]] + [x[3].astype("float32")]
    return x, rng.normal(size=(n, 1)).astype("float32")


def _fit_ranks(build, x, y, start, ranks, hosts=None, **kwargs):
    """hf.fit on `ranks` thread-ranks (reporting `hosts`, if given); per rank: (weights, {table: rows it held}, its
    part's bytes, its optimizer slots' shapes for each table)."""

    def body(comm):
        model = build()
        model.set_weights(start)
        held = {}

        class Look(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                for name in ROWS:
                    part = model.get_layer(name).__dict__.get("_hyparflow_table_part")
                    held[name] = None if part is None else tuple(part.variable.shape)

        hf.fit(model, x, y, batch_size=16, epochs=2, shuffle=False, verbose=0, comm=comm,
               num_replicas=ranks, callbacks=[Look()], **kwargs)
        return model.get_weights(), held

    return run_ranks(ranks, body, timeout=300, hosts=hosts)


CASES = [  # (ranks, sharding, optimizer, microbatches)
    (2, {"user": "row", "item": "table", "cat": "table"}, "adam", 1),
    (2, "auto", "sgd", 2),
    (4, {"user": "table", "item": "row", "cat": "data"}, "adagrad", 1),
    (4, {"user": "row", "item": "row", "cat": "row"}, "adam", 2),
    # Column-wise, mixed with the other kinds; R=3 cuts 4 columns unevenly (2, 1, 1).
    (2, {"user": "column", "item": "row", "cat": "table"}, "adam", 1),
    (3, {"user": "column", "item": "column", "cat": "row"}, "adagrad", 1),
    (3, {"user": "table", "item": "column", "cat": "column"}, "sgd", 2),
]


@pytest.mark.parametrize("ranks,sharding,optimizer,micro", CASES)
def test_sharded_tables_train_as_model_fit(ranks, sharding, optimizer, micro):
    build = lambda: tables_model(optimizer)  # noqa: E731
    x, y = tables_data()
    start, want, _ = reference(build, x, y, epochs=2, batch_size=16)
    out = _fit_ranks(build, x, y, start, ranks, embedding_sharding=sharding,
                     num_microbatches=micro)
    tol = 1e-6 if optimizer == "sgd" else 2e-6
    user = [k for k, w in enumerate(start) if w.shape == (ROWS["user"], 4)][0]
    placements = tplan.place([tplan.Table(n, r, 4) for n, r in ROWS.items()], sharding, ranks)
    for weights, held in out:
        diff = max(float(np.abs(a - b).max()) for a, b in zip(weights, want))
        assert diff <= tol, f"{sharding} {optimizer} R={ranks}: {diff}"
        # Rows no batch looked up did not move.
        np.testing.assert_array_equal(weights[user][SEEN:], start[user][SEEN:])
    # Each rank trained only its rows: together, every row of a sharded table once.
    for p in placements:
        name = p.table.name
        if p.kind == "data":
            assert all(held[name] is None for _, held in out)
            continue
        if p.kind == "column":
            # Every row on every rank, the columns cut: together, each column once.
            assert [held[name] for _, held in out] == [(ROWS[name], w) for w in p.widths]
            assert sum(p.widths) == 4
            continue
        rows = [held[name][0] for _, held in out]
        assert rows == list(p.sizes) and sum(rows) == ROWS[name]
        if p.kind == "row":
            assert max(rows) <= -(-ROWS[name] // ranks)
        else:
            assert sorted(rows)[-2] == 0  # whole on one rank, none elsewhere


@pytest.mark.parametrize("sharding,optimizer,micro", [
    ({"user": "table-row", "item": "table-row", "cat": "row"}, "adam", 2),
    ({"user": "table-row", "item": "column", "cat": "table-row"}, "sgd", 1)])
def test_table_row_trains_as_model_fit(sharding, optimizer, micro):
    """"table-row" over 4 thread-ranks reporting 2 hosts x 2: each table's rows cut
    over the ranks of one host (the tables spread over the hosts by bytes), mixed
    with the other kinds, ends with model.fit's weights."""
    hosts = ["node-a", "node-a", "node-b", "node-b"]
    build = lambda: tables_model(optimizer)  # noqa: E731
    x, y = tables_data()
    start, want, _ = reference(build, x, y, epochs=2, batch_size=16)
    out = _fit_ranks(build, x, y, start, 4, hosts=hosts, embedding_sharding=sharding,
                     num_microbatches=micro)
    for weights, _ in out:
        diff = max(float(np.abs(a - b).max()) for a, b in zip(weights, want))
        assert diff <= (1e-6 if optimizer == "sgd" else 2e-6), (sharding, diff)
    owners = {}
    for name, kind in sharding.items():
        if kind != "table-row":
            continue
        rows = [held[name][0] for _, held in out]
        owners[name] = [r for r in range(4) if rows[r]]
        # The ranks of one host, the rows cut evenly between them, none elsewhere.
        assert owners[name] in ([0, 1], [2, 3]), (name, rows)
        assert sum(rows) == ROWS[name] and max(rows) - min(rows[r] for r in owners[name]) <= 1
    # Two table-row tables: one on each host (the second goes to the lighter host).
    assert sorted(map(tuple, owners.values())) == [(0, 1), (2, 3)]


def test_table_row_placement():
    """Table-row tables spread over hosts by bytes (biggest first, each on the host
    whose ranks hold the fewest), a host's ranks need not be consecutive; on one host
    it is "row"; too few rows for a host's ranks is an error naming the fix."""
    tables = [tplan.Table("big", 1000, 8), tplan.Table("a", 600, 8), tplan.Table("b", 300, 8),
              tplan.Table("c", 100, 8)]
    kinds = {n: "table-row" for n in ("big", "a", "b", "c")}
    hosts = ["x", "y", "x", "y"]
    plan = {p.table.name: p for p in tplan.place(tables, kinds, 4, hosts=hosts)}
    assert plan["big"].sizes == (500, 0, 500, 0)
    assert plan["a"].sizes == (0, 300, 0, 300)
    assert plan["b"].ranks == [1, 3] and plan["c"].ranks == [1, 3]
    assert all(p.kind == "table-row" for p in plan.values())
    one = tplan.place(tables, kinds, 4)
    assert [p.sizes for p in one] == [p.sizes for p in tplan.place(
        tables, {n: "row" for n in kinds}, 4)]
    text = tplan.describe(list(plan.values()), 4)
    assert "table-row" in text and " 0,2 " in text
    with pytest.raises(ValueError, match=r"'table-row' needs at least as many rows.*2 < 3"):
        tplan.place([tplan.Table("tiny", 2, 8)], {"tiny": "table-row"}, 6,
                    hosts=["x"] * 3 + ["y"] * 3)


def test_planner_places_by_bytes():
    tables = [tplan.Table("big", 1000, 8, factor=3), tplan.Table("a", 100, 8, factor=3),
              tplan.Table("b", 90, 8, factor=3), tplan.Table("c", 10, 8, factor=3)]
    plan = {p.table.name: p for p in tplan.place(tables, "auto", 2)}
    assert plan["big"].kind == "row" and plan["big"].sizes == (500, 500)
    # The whole tables go to the least-loaded rank, biggest first: a on 0, b on 1, c on 1.
    assert [plan[n].ranks for n in "abc"] == [[0], [1], [1]]
    text = tplan.describe(list(plan.values()), 2)
    assert "big" in text and "row" in text and f"{500 * 8 * 4 * 3:,}" in text
    with pytest.raises(ValueError, match="memory_limit=1,000"):
        tplan.place(tables, "auto", 2, memory_limit=1000)
    # A memory limit below a table's share cuts it row-wise.
    limited = {p.table.name: p for p in tplan.place(tables, "auto", 4, memory_limit=40_000)}
    assert limited["big"].kind == "row" and limited["a"].kind == "table"
    column = tplan.place(tables, {"a": "column"}, 3)[1]
    assert column.widths == (3, 3, 2) and column.columns == [0, 3, 6]
    assert column.bytes_on(2) == 100 * 2 * 4 * 3 and column.ranks == [0, 1, 2]
    with pytest.raises(ValueError, match=r"'column' needs at least as many columns.*8 < 9"):
        tplan.place(tables, {"a": "column"}, 9)


def _errors(ranks, calls):
    """Run each of `calls`, {name: (build, x, y, kwargs)}, on `ranks` thread-ranks;
    return {name: the error every rank raised (the same text)}."""

    def body(comm):
        out = {}
        for name, (build, x, y, kwargs) in calls.items():
            model = build()
            try:
                hf.fit(model, x, y, batch_size=16, epochs=1, shuffle=False, verbose=0,
                       comm=comm, **kwargs)
                out[name] = None
            except Exception as exc:  # noqa: BLE001 - the test reads it
                out[name] = str(exc)
        return out

    results = run_ranks(ranks, body, timeout=300)
    for name in calls:
        texts = [r[name] for r in results]
        assert all(t is not None for t in texts), f"{name}: no error"
    return results[0]


def adafactor():
    model = tables_model()
    model.compile(keras.optimizers.Adafactor(), "mse")
    return model


def test_bad_input_is_named():
    x, y = tables_data()
    bad = [a.copy() for a in x]
    bad[0][20, 0] = ROWS["user"] + 3  # replica 1's slice of the first batch
    errors = _errors(2, {
        "unknown": (tables_model, x, y, {"embedding_sharding": {"users": "row"}}),
        "kind": (tables_model, x, y, {"embedding_sharding": {"user": "rows"}}),
        "pipeline": (tables_model, x, y, {"embedding_sharding": "auto", "num_stages": 2,
                                          "num_replicas": 1}),
        "dtype": (tables_model, x, y, {"embedding_sharding": "auto",
                                       "communication_dtype": "bf16"}),
        "no tables": (tables_model, x, y, {"communication_dtype": "bfloat16"}),
        "adafactor": (adafactor, x, y, {"embedding_sharding": "auto"}),
        # Last: a failure inside a step aborts the ranks' world (as MPI_Abort would).
        "vocabulary": (tables_model, bad, y, {"embedding_sharding": {"user": "row"}}),
    })
    assert "['users']" in errors["unknown"] and "'user'" in errors["unknown"]
    assert "'rows'" in errors["kind"] and "'table', 'row', 'column', 'data'" in errors["kind"]
    assert "layer 'user'" in errors["vocabulary"]
    assert f"= {ROWS['user'] + 3} is not in [0, {ROWS['user']})" in errors["vocabulary"]
    assert "at least 2 ranks per stage" in errors["pipeline"]
    assert "communication_dtype='bf16'" in errors["dtype"]
    assert "'float32', 'bfloat16', 'float16'" in errors["dtype"]
    assert "embedding_sharding is not set" in errors["no tables"]
    assert "Adafactor updates a weight matrix as a whole" in errors["adafactor"]
    assert "owners of a sharded table" in errors["adafactor"]


@pytest.mark.parametrize("dtype,optimizer,bound", [
    ("bfloat16", "sgd", 1e-4), ("float16", "adagrad", 5e-5), ("bfloat16", "adam", 0.1)])
def test_reduced_precision_exchanges(dtype, optimizer, bound):
    """communication_dtype: the rows and gradients of the lookups travel in 16 bits
    (half the bytes, counted), the sums stay float32; the weights leave model.fit's
    by the rounding only (a bound, not the exact contract), float32 stays exact.
    Adam divides each gradient by its own scale, so a coordinate whose gradient is
    mostly rounding still steps by up to lr (0.05): its bound is two steps, and the
    loss stays within 1%."""
    sharding = {"user": "row", "item": "column", "cat": "table"}
    x, y = tables_data()
    reference = tables_model(optimizer)
    start = reference.get_weights()
    want_loss = reference.fit(x, y, batch_size=16, epochs=2, shuffle=False,
                              verbose=0).history["loss"]
    want = reference.get_weights()

    def body(comm):
        out = {}
        for wire in ("float32", dtype):
            model = tables_model(optimizer)
            model.set_weights(start)
            loss = hf.fit(model, x, y, batch_size=16, epochs=2, shuffle=False, verbose=0,
                          comm=comm, embedding_sharding=sharding,
                          communication_dtype=wire).history["loss"]
            router = model.get_layer("user").__dict__["_hyparflow_table_part"].router
            diff = max(float(np.abs(a - b).max()) for a, b in zip(model.get_weights(), want))
            out[wire] = (router.payload, router.bytes, diff, loss)
        return out

    for out in run_ranks(2, body, timeout=300):
        (full, full_all, exact, _), (half, half_all, drift, loss) = out["float32"], out[dtype]
        assert full > 0 and half * 2 == full  # rows and gradients: half the bytes
        assert full_all - half_all == full - half  # ids and counts: as they were
        assert exact <= 2e-6
        assert 1e-7 < drift < bound, (dtype, optimizer, drift)
        np.testing.assert_allclose(loss, want_loss, rtol=1e-2)


@pytest.mark.parametrize("first,then", [
    ({"user": "row", "item": "table", "cat": "column"}, {"user": "column", "item": "row"}),
    ("auto", None)])
def test_checkpoint_resumes_with_another_sharding(tmp_path, first, then):
    """A checkpoint holds whole tables and whole optimizer slots (gathered from their
    owners), so a run with another sharding, or none, resumes from it: epoch 1 with
    `first`, epoch 2 with `then`, ends where two epochs of model.fit (Adam) end."""
    x, y = tables_data()
    reference = tables_model("adam")
    start = reference.get_weights()
    reference.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    want = reference.get_weights()

    def body(comm):
        for epochs, sharding in ((1, first), (2, then)):
            model = tables_model("adam")
            # The second run starts elsewhere: only what it resumes brings it back.
            model.set_weights([w + (epochs - 1) for w in start])
            hf.fit(model, x, y, batch_size=16, epochs=epochs, shuffle=False, verbose=0,
                   comm=comm, embedding_sharding=sharding, checkpoint_dir=str(tmp_path),
                   resume=True)
        return model.get_weights()

    for weights in run_ranks(2, body, timeout=300):
        diff = max(float(np.abs(a - b).max()) for a, b in zip(weights, want))
        assert diff <= 2e-6, (first, then, diff)


def test_short_last_batch_is_refused():
    """A last batch with fewer than R x M samples: refused up front (arrays), or when
    the dataset yields it (every rank iterates alike, so every rank raises)."""
    import tensorflow as tf

    x, y = tables_data(n=33)  # a last batch of 1 sample: replica 1 would have none
    dataset = lambda: tf.data.Dataset.from_tensor_slices((tuple(x), y)).batch(16)  # noqa: E731
    errors = _errors(2, {"short": (tables_model, x, y, {"embedding_sharding": "auto"}),
                         "dataset": (tables_model, dataset(), None,
                                     {"embedding_sharding": "auto"})})
    assert "last batch has 1 samples" in errors["short"]
    assert "the dataset's last batch has 1 samples" in errors["dataset"]
    assert "drop_remainder=True" in errors["dataset"]


def test_validation_looks_up_sharded_tables():
    """Validation inside fit runs the sharded lookups too (every replica its slice)."""
    x, y = tables_data()
    reference = tables_model()
    start = reference.get_weights()
    want = reference.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0,
                         validation_data=(x, y)).history

    def body(comm):
        model = tables_model()
        model.set_weights(start)
        return hf.fit(model, x, y, batch_size=16, epochs=2, shuffle=False, verbose=0,
                      comm=comm, validation_data=(x, y), embedding_sharding="auto").history

    for history in run_ranks(2, body, timeout=300):
        np.testing.assert_allclose(history["val_loss"], want["val_loss"], rtol=1e-6)
        np.testing.assert_allclose(history["loss"], want["loss"], rtol=1e-6)


def test_plan_costs_the_tables():
    """The placement's cost: the owners' load follows the ids (a hot row piles onto its
    row owner, not onto column slices), 16-bit exchanges halve the rows' bytes, the
    printed table names each table, and the plan file's kinds come back as
    embedding_sharding (an argument that differs is an error)."""
    from hyparflow.kinds.tables import cost as C

    tables = [tplan.Table("hot", 1000, 8, factor=3), tplan.Table("wide", 100, 8, factor=3)]
    placed = tplan.place(tables, {"hot": "row", "wide": "column"}, 2)
    hot = np.r_[np.zeros(90, int), np.arange(500, 510)]  # 90% on row 0: rank 0's
    rows = C.costs(placed, 2, {"hot": 100, "wide": 100}, {"hot": hot}, beta=1e-9)
    assert rows[0].looked_up == (90 * 8, 10 * 8)  # rank 0 owns the hot row
    assert rows[1].looked_up == (100 * 4, 100 * 4)  # every rank: its 4 columns of each
    uniform = C.costs(placed, 2, {"hot": 100, "wide": 100})[0]
    assert uniform.looked_up == (400, 400) and rows[0].seconds > uniform.seconds
    assert rows[0].stored == 500 * 8 * 4 * 3 and rows[1].stored == 100 * 4 * 4 * 3
    half = C.costs(placed, 2, {"hot": 100, "wide": 100}, {"hot": hot}, wire_bytes=2)
    ids = 50 * (1 - 0.9) * 8  # rank 0 asks rank 1 for 10% of its 50 ids
    assert half[0].sent[0] - ids == (rows[0].sent[0] - ids) / 2
    text = C.describe(rows, 2)
    assert "hot" in text and "column" in text and "est. ms" in text
    kinds = C.to_plan(placed)
    assert kinds == {"hot": "row", "wide": "column"}
    assert C.from_plan(None, {"tables": kinds}) == kinds
    assert C.from_plan("auto", {}) == "auto"
    with pytest.raises(ValueError, match="differ"):
        C.from_plan("auto", {"tables": kinds}, "plan.json")


def test_plan_file_places_the_tables(tmp_path):
    """fit(plan=FILE) shards the tables as the plan file's "tables" say, and still
    trains to model.fit's weights (Adagrad)."""
    from hyparflow import plan as P
    from hyparflow.graph import from_model
    from hyparflow.layout import Layout

    x, y = tables_data()
    reference = tables_model("adagrad")
    start = reference.get_weights()
    reference.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    want = reference.get_weights()
    kinds = {"user": "column", "item": "row", "cat": "table"}

    def body(comm):
        model = tables_model("adagrad")
        model.set_weights(start)
        # Each thread-rank's model has its own automatic layer names: its own plan.
        path = str(tmp_path / f"plan{comm.rank}.json")
        graph = from_model(model)
        P.write(path, graph, Layout(num_replicas=2, balance=(len(graph.nodes),)),
                tables=kinds)
        hf.fit(model, x, y, batch_size=16, epochs=2, shuffle=False, verbose=0, comm=comm,
               plan=path)
        held = {name: tuple(model.get_layer(name).__dict__["_hyparflow_table_part"]
                            .variable.shape) for name in kinds}
        return model.get_weights(), held

    out = run_ranks(2, body, timeout=300)
    for weights, held in out:
        assert max(float(np.abs(a - b).max()) for a, b in zip(weights, want)) <= 2e-6
    assert [held["user"] for _, held in out] == [(ROWS["user"], 2)] * 2
    assert [held["item"][0] for _, held in out] == [15, 15]


def test_plan_command_places_the_tables(tmp_path, capsys):
    """`hyparflow plan --embedding-sharding auto --ids FUNCTION`'s table step: the
    placement printed with its costs, the owners' load from the ids, only the plans
    with one stage and one tensor rank kept (their kinds go into the plan file)."""
    import argparse

    from hyparflow.graph import from_model
    from hyparflow.planning import command
    from hyparflow.planning.costmodel import Network

    source = tmp_path / "model.py"
    source.write_text("import numpy as np\n\ndef first_ids():\n"
                      "    return {'user': np.zeros(64, int)}\n")  # every lookup: row 0
    args = argparse.Namespace(embedding_sharding='{"user": "row", "item": "column"}',
                              ids="first_ids", communication_dtype="bfloat16",
                              batch_size=16, model=str(source))
    model = tables_model("adam")
    plans = [dict(stages=2, tensor=1, replicas=1, microbatches=2, schedule="1f1b", step_s=0.1),
             dict(stages=1, tensor=1, replicas=2, microbatches=1, schedule="1f1b", step_s=0.2)]
    kinds, allowed = command._tables(args, model, from_model(model), Network(50e-6, 1e-9), 2,
                                     None, plans)
    assert kinds == {"user": "row", "item": "column", "cat": "data"}
    assert allowed == plans[1:]
    text = capsys.readouterr().out
    user = next(line for line in text.splitlines() if line.strip().startswith("user"))
    assert " row " in user and "100%" in user  # rank 0 owns every looked-up row
    assert "S=1 T=1 R=2" in text
    with pytest.raises(ValueError, match="one stage and one tensor rank"):
        command._tables(args, model, from_model(model), Network(50e-6, 1e-9), 2, None,
                        plans[:1])
