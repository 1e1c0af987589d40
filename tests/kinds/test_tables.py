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
from hyparflow.kinds.tables import auto as tauto
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
                    layer = model.get_layer(name)
                    part = layer.__dict__.get("_hyparflow_table_part")
                    held[name] = None if part is None else tuple(part.variable.shape)
                    # A sharded table's whole copy is dropped while fit trains.
                    rows = layer.embeddings.numpy().shape[0]
                    assert rows == (ROWS[name] if part is None else 0), (name, rows)

        hf.fit(model, x, y, batch_size=16, epochs=2, shuffle=False, verbose=0, comm=comm,
               num_replicas=ranks, callbacks=[Look()], **kwargs)
        assert held, "the callback did not run"
        return model.get_weights(), held

    return run_ranks(ranks, body, timeout=300, hosts=hosts)


CASES = [  # (ranks, sharding, optimizer, microbatches)
    (2, {"user": "row", "item": "table", "cat": "table"}, "adam", 1),
    (2, "auto", "adam", 2),  # the costs choose "row" for user and item, "column" for cat
    (4, {"user": "table", "item": "row", "cat": "data"}, "adagrad", 1),
    (4, {"user": "row", "item": "row", "cat": "row"}, "adam", 2),
    # Column-wise, mixed with the other kinds; R=3 cuts 4 columns unevenly (2, 1, 1).
    (2, {"user": "column", "item": "row", "cat": "table"}, "adam", 1),
    (3, {"user": "column", "item": "column", "cat": "row"}, "adagrad", 1),
    (3, {"user": "table", "item": "column", "cat": "column"}, "sgd", 2),
]


def _placed(sharding, ranks, optimizer, x, batch_size=16):
    """The placements fit makes: "auto" costs the ids of the data's first batches."""
    factor, dense = {"adam": (3, True), "sgd": (1, False), "adagrad": (2, False)}[optimizer]
    tables = [tplan.Table(n, r, 4, 4, factor, dense) for n, r in ROWS.items()]
    if sharding != "auto":
        return tplan.place(tables, sharding, ranks)
    per_sample = {n: a.shape[1] * batch_size for n, a in zip(ROWS, x)}
    return tauto.place(tables, "auto", ranks, lookups=per_sample, ids=dict(zip(ROWS, x)))


@pytest.mark.parametrize("ranks,sharding,optimizer,micro", CASES)
def test_sharded_tables_train_as_model_fit(ranks, sharding, optimizer, micro):
    build = lambda: tables_model(optimizer)  # noqa: E731
    x, y = tables_data()
    start, want, _ = reference(build, x, y, epochs=2, batch_size=16)
    out = _fit_ranks(build, x, y, start, ranks, embedding_sharding=sharding,
                     num_microbatches=micro)
    tol = 1e-6 if optimizer == "sgd" else 2e-6
    user = [k for k, w in enumerate(start) if w.shape == (ROWS["user"], 4)][0]
    placements = _placed(sharding, ranks, optimizer, x)
    if sharding == "auto":  # cat's ids are 4 rows of 12: all on one row owner
        assert [p.kind for p in placements] == ["row", "row", "column"]
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
    """The first planner's kinds by bytes (`by_bytes`, the benchmark's baseline), placed
    by `place`: whole tables on the least-loaded rank, biggest first."""
    tables = [tplan.Table("big", 1000, 8, factor=3), tplan.Table("a", 100, 8, factor=3),
              tplan.Table("b", 90, 8, factor=3), tplan.Table("c", 10, 8, factor=3)]
    plan = {p.table.name: p for p in tplan.place(tables, tplan.by_bytes(tables, 2), 2)}
    assert plan["big"].kind == "row" and plan["big"].sizes == (500, 500)
    # The whole tables go to the least-loaded rank, biggest first: a on 0, b on 1, c on 1.
    assert [plan[n].ranks for n in "abc"] == [[0], [1], [1]]
    text = tplan.describe(list(plan.values()), 2)
    assert "big" in text and "row" in text and f"{500 * 8 * 4 * 3:,}" in text
    with pytest.raises(ValueError, match="memory_limit=1,000"):
        tplan.place(tables, tplan.by_bytes(tables, 2, 1000), 2, memory_limit=1000)
    # A memory limit below a table's share cuts it row-wise.
    limited = {p.table.name: p for p in tplan.place(
        tables, tplan.by_bytes(tables, 4, 40_000), 4, memory_limit=40_000)}
    assert limited["big"].kind == "row" and limited["a"].kind == "table"
    column = tplan.place(tables, {"a": "column"}, 3)[1]
    assert column.widths == (3, 3, 2) and column.columns == [0, 3, 6]
    assert column.bytes_on(2) == 100 * 2 * 4 * 3 and column.ranks == [0, 1, 2]
    with pytest.raises(ValueError, match=r"'column' needs at least as many columns.*8 < 9"):
        tplan.place(tables, {"a": "column"}, 9)


def test_auto_chooses_the_kinds_by_cost():
    """"auto" costs every candidate of each table (pure, the plan's own numbers):
    uniform ids keep a table "row"; ids piled on one row owner pick "column" (or spread
    the tables over the ranks when "column" cannot be); a table with no room whole
    goes "row"; tiny tables stay "data"; a memory_limit nothing fits under is an
    error naming the table and its bytes."""
    from hyparflow.kinds.tables import auto, cost as C

    hot = [tplan.Table("hot", 1000, 8, factor=3)]
    piled = {"hot": np.r_[np.zeros(900, int), np.arange(500, 600)]}  # 90% on row 0
    assert tauto.place(hot, "auto", 2, lookups={"hot": 1000})[0].kind == "row"
    chosen = tauto.place(hot, "auto", 2, lookups={"hot": 1000}, ids=piled)[0]
    assert chosen.kind == "column"
    # The cheapest of the candidates by the busiest rank's estimate.
    priced = {p.kind + str(p.ranks): C.cost_of(p, 2, 1000, C.hits(p, piled["hot"], 2)).seconds
              for p in auto.candidates(hot[0], 2, [[0, 1]], False)}
    assert priced["column[0, 1]"] == min(priced.values()) < priced["row[0, 1]"]
    # One column each (output_dim 1 < R): the hot tables spread over the ranks instead
    # of both piling onto rank 0, the owner of their hot rows under "row".
    two = [tplan.Table("a", 1000, 1, factor=3), tplan.Table("b", 1000, 1, factor=3)]
    low = {"a": np.arange(400), "b": np.arange(400)}  # rank 0's rows under "row"
    look = {"a": 1000, "b": 1000}
    spread = tauto.place(two, "auto", 2, lookups=look, ids=low)
    owners = [int(np.argmax(C.hits(p, low[p.table.name], 2))) for p in spread]
    assert sorted(owners) == [0, 1], spread
    piled_rows = tplan.place(two, {"a": "row", "b": "row"}, 2)
    assert (C.step_seconds(C.costs(spread, 2, look, low), 2)
            < C.step_seconds(C.costs(piled_rows, 2, look, low), 2))
    # 12,000 bytes each: with a's rows on both ranks, b has no room whole: "row".
    limited = tauto.place(two, "auto", 2, memory_limit=12_000, lookups=look, ids=low)
    assert [p.kind for p in limited] == ["row", "row"]
    assert max(sum(p.bytes_on(r) for p in limited) for r in range(2)) <= 12_000
    # A tiny table (under 1% of a rank's share) stays replicated.
    mixed = tauto.place([tplan.Table("big", 10_000, 8), tplan.Table("tiny", 10, 8)], "auto", 2)
    assert [p.kind for p in mixed] == ["row", "data"]
    with pytest.raises(ValueError, match=r"'b' \(1,000 x 1, 12,000 bytes.*smallest share is "
                                         r"6,000 bytes.*memory_limit=9,000"):
        tauto.place(two, "auto", 2, memory_limit=9_000, lookups=look, ids=low)


def test_auto_places_table_row_within_a_host():
    """Over 2 hosts x 2 ranks with a slow link between them, a table of 3 rows (too
    few for "row" over 4 ranks, too narrow for "column") goes "table-row": its rows
    over one host's two ranks, each answering the other host's lookups of its rows
    only, so its owners send fewer bytes across hosts than "table"'s one owner and
    its busiest rank's estimate is lower; on one host it is "table"."""
    from hyparflow.kinds.tables import cost as C

    hosts = ["x", "x", "y", "y"]
    link = C.Link(alpha_inter=100e-6, beta_inter=10e-9)
    few = [tplan.Table("few", 3, 2, factor=3)]
    look = {"few": 4096}
    placed = tauto.place(few, "auto", 4, hosts=hosts, lookups=look, link=link)[0]
    assert placed.kind == "table-row" and placed.ranks in ([0, 1], [2, 3])
    mine = C.costs([placed], 4, look, link=link, hosts=hosts)[0]
    for r in range(4):
        whole = tplan.Placement(few[0], "table", tuple(3 if q == r else 0 for q in range(4)))
        theirs = C.costs([whole], 4, look, link=link, hosts=hosts)[0]
        assert max(mine.cross[q] for q in placed.ranks) < theirs.cross[r]
        assert mine.seconds < theirs.seconds
    assert "cross-host" in C.describe([mine], 4)
    assert tauto.place(few, "auto", 4, lookups=look, link=link)[0].kind == "table"


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
        "no tables": (tables_model, x, y, {"communication_dtype": {"tables": "bfloat16"}}),
        "adafactor": (adafactor, x, y, {"embedding_sharding": "auto"}),
        "saves mid-fit": (tables_model, x, y, {"embedding_sharding": "auto", "callbacks": [
            keras.callbacks.ModelCheckpoint("/tmp/hyparflow-never.weights.h5",
                                            save_weights_only=True, save_freq=2)]}),
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
    assert "ModelCheckpoint(save_freq=2)" in errors["saves mid-fit"]
    assert "checkpoint_dir" in errors["saves mid-fit"]


def test_epoch_end_callbacks_see_the_whole_tables(tmp_path):
    """The whole copies are dropped while an epoch trains, and put back for the
    user's callbacks at its end: ModelCheckpoint (per epoch) saves, and
    EarlyStopping(restore_best_weights=True) restores, the weights model.fit's do."""
    x, y = tables_data()
    vx, vy = [a[:16] for a in x], y[:16]

    def callbacks(where):
        return [keras.callbacks.ModelCheckpoint(str(where), save_weights_only=True),
                keras.callbacks.EarlyStopping("val_loss", patience=1,
                                              restore_best_weights=True)]

    keras_file = tmp_path / "keras.weights.h5"
    start, want, _ = reference(lambda: tables_model("adam"), x, y, epochs=3, batch_size=16,
                               validation_data=(vx, vy), callbacks=callbacks(keras_file))
    saved = tables_model("adam")
    saved.load_weights(str(keras_file))

    def body(comm):
        model = tables_model("adam")
        model.set_weights(start)
        mine = tmp_path / f"rank{comm.rank}.weights.h5"
        hf.fit(model, x, y, batch_size=16, epochs=3, shuffle=False, verbose=0, comm=comm,
               num_replicas=2, validation_data=(vx, vy), callbacks=callbacks(mine),
               embedding_sharding={"user": "row", "item": "column", "cat": "table"})
        if comm.rank != 0:  # ModelCheckpoint writes on rank 0 only
            return model.get_weights(), None
        last = tables_model("adam")
        last.load_weights(str(mine))
        return model.get_weights(), last.get_weights()

    out = run_ranks(2, body, timeout=300)
    assert out[0][1] is not None
    for weights, checkpoint in out:
        assert max(float(np.abs(a - b).max()) for a, b in zip(weights, want)) <= 2e-6
        assert checkpoint is None or max(float(np.abs(a - b).max())
                   for a, b in zip(checkpoint, saved.get_weights())) <= 2e-6


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
                          communication_dtype={"tables": wire}).history["loss"]
            router = model.get_layer("user").__dict__["_hyparflow_table_part"].router
            diff = max(float(np.abs(a - b).max()) for a, b in zip(model.get_weights(), want))
            out[wire] = (router.payload, router.bytes, diff, loss)
        return out

    for out in run_ranks(2, body, timeout=300):
        (full, full_all, exact, _), (half, half_all, drift, loss) = out["float32"], out[dtype]
        if dtype == "bfloat16":
            assert full > 0 and half * 2 == full  # rows and gradients: half the bytes
        else:  # float16: half, and each gradient message's scale row (`lookup.pack`)
            assert full > 0 and full < half * 2 < full * 1.5, (half, full)
        assert full_all - half_all == full - half  # ids and counts: as they were
        assert exact <= 2e-6
        assert 1e-7 < drift < bound, (dtype, optimizer, drift)
        np.testing.assert_allclose(loss, want_loss, rtol=1e-2)


def test_float16_table_gradients_carry_their_scale():
    """A float16 gradient message travels scaled by its own power of two (`lookup.pack`):
    gradients of 1e-9 (0 in plain float16) and of 1e6 (inf) arrive within float16's
    relative rounding, from every rank to every rank."""
    from hyparflow.kinds.tables.lookup import Router

    def block(p, q):
        rng = np.random.default_rng(10 * p + q)
        size = 1e-9 if (p + q) % 2 else 1e6
        return (rng.normal(size=(3 + p + q, 4)) * size).astype(np.float32)

    assert not np.float16(1e-9) and np.isinf(np.float16(1e6))  # what a plain cast does

    def body(comm):
        router = Router(np.dtype(np.float16))
        router.comm = comm
        got = router.gradients([block(comm.rank, q) for q in range(comm.size)],
                               [len(block(p, comm.rank)) for p in range(comm.size)], (4,),
                               np.float32, 900, "test")
        return [np.abs(g / block(p, comm.rank) - 1).max() for p, g in enumerate(got)]

    for errors in run_ranks(3, body, timeout=60):
        assert max(errors) < 1e-3, errors


def test_float16_tables_with_a_short_last_batch():
    """The idle replica of a short last batch takes the float16 gradients with their
    scale, as the others do: the weights stay within float16's rounding of model.fit's."""
    from conftest import train_ranks

    x, y = tables_data(n=33)
    start, want, _ = reference(lambda: tables_model("sgd"), x, y, epochs=2, batch_size=16)
    out = train_ranks(lambda: tables_model("sgd"), x, y, num_stages=1, num_replicas=2,
                      num_microbatches=2, weights=start, batch_size=16, epochs=2,
                      shuffle=False, communication_dtype={"tables": "float16"},
                      embedding_sharding={"user": "row", "item": "column", "cat": "table"})
    for weights, _ in out:
        assert max(float(np.abs(a - b).max()) for a, b in zip(weights, want)) <= 1e-4


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


@pytest.mark.parametrize("ranks,optimizer,n,sharding", [
    # R=4, M=2: a last batch of 3 (replica 3 has no sample); validation's last
    # batch of 3 too; every kind.
    (4, "adam", 35, {"user": "row", "item": "column", "cat": "table"}),
    # R=2, M=2: a last batch of 1 (replica 1 has none, replica 0 one microbatch).
    (2, "sgd", 33, "auto")])
def test_short_last_batch_trains_as_model_fit(ranks, optimizer, n, sharding):
    """A last batch with fewer than R x M samples is cut as for plain replicas
    (uneven microbatches, some replica with none): a replica that lacks a microbatch
    still serves the others' lookups of it and takes the gradients of its rows, so
    the weights (and the validation loss) are model.fit's."""
    from conftest import train_ranks

    build = lambda: tables_model(optimizer)  # noqa: E731
    x, y = tables_data(n=n)
    start, want, history = reference(build, x, y, epochs=2, batch_size=16,
                                     validation_data=([a[:19] for a in x], y[:19]))
    out = train_ranks(build, x, y, num_stages=1, num_replicas=ranks, num_microbatches=2,
                      weights=start, batch_size=16, epochs=2, shuffle=False,
                      validation_data=([a[:19] for a in x], y[:19]),
                      embedding_sharding=sharding)
    for weights, hist in out:
        diff = max(float(np.abs(a - b).max()) for a, b in zip(weights, want))
        assert diff <= (1e-6 if optimizer == "sgd" else 2e-6), (ranks, sharding, diff)
        np.testing.assert_allclose(hist["val_loss"], history["val_loss"], rtol=1e-5)


def test_short_last_batch_with_a_masked_loss():
    """A per-token loss under the Embedding's mask (its normaliser a count over the
    whole batch, agreed before the first backward: an idle replica joins it), sample
    weights, and recompute (the others' backward runs their lookups again): a last
    batch of 3 over R=4 x M=2 still trains as model.fit (Adam)."""
    from conftest import train_ranks

    def build():
        keras.utils.set_random_seed(3)
        ids = keras.Input((5,), dtype="int32")
        out = keras.layers.Dense(1)(keras.layers.Embedding(40, 4, mask_zero=True,
                                                           name="tok")(ids))
        model = keras.Model(ids, out)
        model.compile(keras.optimizers.Adam(0.05), "mse")
        return model

    rng = np.random.default_rng(0)
    x = rng.integers(1, 40, (35, 5)).astype("int32")
    x[:, 3:] = 0  # padding: masked out of the loss
    y = rng.normal(size=(35, 5, 1)).astype("float32")
    sw = rng.uniform(0.5, 2.0, (35, 5)).astype("float32")  # per token
    start, want, _ = reference(build, x, y, epochs=2, batch_size=16, sample_weight=sw)
    out = train_ranks(build, x, y, num_stages=1, num_replicas=4, num_microbatches=2,
                      weights=start, batch_size=16, epochs=2, shuffle=False, sample_weight=sw,
                      recompute=True, embedding_sharding={"tok": "row"})
    for weights, _ in out:
        assert max(float(np.abs(a - b).max()) for a, b in zip(weights, want)) <= 2e-6


def test_short_last_batch_of_a_dataset():
    """A tf.data dataset batched without drop_remainder: its short last batch (3
    samples over 2 replicas x 2 microbatches) trains as in model.fit (Adam)."""
    import tensorflow as tf

    from conftest import train_ranks

    x, y = tables_data(n=35)
    dataset = lambda: tf.data.Dataset.from_tensor_slices((tuple(x), y)).batch(16)  # noqa: E731
    model = tables_model("adam")
    start = model.get_weights()
    model.fit(dataset(), epochs=2, verbose=0)
    want = model.get_weights()
    out = train_ranks(lambda: tables_model("adam"), dataset(), None, num_stages=1,
                      num_replicas=2, num_microbatches=2, weights=start, epochs=2,
                      embedding_sharding={"user": "row", "item": "table", "cat": "column"})
    for weights, _ in out:
        assert max(float(np.abs(a - b).max()) for a, b in zip(weights, want)) <= 2e-6


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
    # Over hosts (`--hosts`, or --nodes x --ranks-per-node): each "table-row" table on
    # one host's ranks (the second on the other host), the bytes to other hosts
    # costed at the link between them.
    four = [dict(stages=1, tensor=1, replicas=4, microbatches=1, schedule="1f1b", step_s=0.2)]
    for hosts, nodes, names in (("a:2,b:2", 2, "a (ranks 0,1), b (ranks 2,3)"),
                                (None, 2, "node0 (ranks 0,1), node1 (ranks 2,3)")):
        args = argparse.Namespace(
            embedding_sharding='{"user": "table-row", "item": "table-row"}', ids=None,
            communication_dtype=None, batch_size=16, model=str(source), hosts=hosts,
            nodes=nodes, ranks_per_node=2)
        command._tables(args, model, from_model(model), Network(50e-6, 1e-9, 200e-6, 1e-8),
                        4, None, four)
        text = capsys.readouterr().out
        assert f"the tables' hosts: {names}" in text and "cross-host" in text
        rows = {line.split()[0]: line.split()[2] for line in text.splitlines()
                if line.strip().startswith(("user", "item"))}
        assert rows == {"user": "0,1", "item": "2,3"}, text
