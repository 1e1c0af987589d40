"""Pooled lookups of sharded tables (issue 34, `kinds/tables/pooled.py`): a bag of ids
per sample summed or averaged by the owners of its rows, against plain `model.fit` on
one process: masked (mask_zero, padded bags) and unmasked means, sums with repeated ids,
kinds row/table/column mixed, R=2 and 4, SGD/Adam/Adagrad, M=2; the bytes sent are one
vector per (sample, owner), counted; forms that are not a sum keep the per-id lookup."""

import keras
import numpy as np
import pytest

from conftest import reference

import hyparflow as hf
from hyparflow.engine.local import run_ranks

BAG, DIM = 4, 4
ROWS = {"bmean": 40, "bsum": 10, "bavg": 24, "user": 30, "bmax": 12}



def pooled_model(optimizer="adam"):
    """`bmean`: mask_zero + masked GlobalAveragePooling1D over padded bags; `bsum`:
    ops.sum over the bag (repeats); `bavg`: unmasked GlobalAveragePooling1D with
    keepdims; `user`: single-hot; `bmax`: GlobalMaxPooling1D (not a sum: per id)."""
    keras.utils.set_random_seed(2)
    ins = {n: keras.Input((1 if n == "user" else BAG,), dtype="int32", name=f"{n}_ids")
           for n in ROWS}
    emb = {n: keras.layers.Embedding(ROWS[n], DIM, mask_zero=(n == "bmean"), name=n)(ins[n])
           for n in ROWS}
    parts = [keras.layers.GlobalAveragePooling1D()(emb["bmean"]),
             keras.ops.sum(emb["bsum"], axis=1),
             keras.layers.Flatten()(keras.layers.GlobalAveragePooling1D(keepdims=True)(emb["bavg"])),
             keras.layers.Flatten()(emb["user"]),
             keras.layers.GlobalMaxPooling1D()(emb["bmax"])]
    h = keras.layers.Dense(6, activation="tanh")(keras.layers.Concatenate()(parts))
    model = keras.Model(list(ins.values()), keras.layers.Dense(1)(h))
    opt = {"adam": keras.optimizers.Adam(0.05), "sgd": keras.optimizers.SGD(0.1),
           "adagrad": keras.optimizers.Adagrad(0.1)}[optimizer]
    model.compile(optimizer=opt, loss="mse")
    return model


def pooled_data(n=32, seed=0):
    rng = np.random.default_rng(seed)
    # Padded bags of 1..BAG ids (0 pads), ids repeated across samples and in a bag.
    length = rng.integers(1, BAG + 1, n)
    mean = rng.integers(1, 12, (n, BAG)) * (np.arange(BAG) < length[:, None])
    x = {"bmean": mean, "bsum": rng.integers(0, 4, (n, BAG)), "bavg": rng.integers(0, 24, (n, BAG)),
         "user": rng.integers(0, 30, (n, 1)), "bmax": rng.integers(0, 12, (n, BAG))}
    return [x[k].astype("int32") for k in ROWS], rng.normal(size=(n, 1)).astype("float32")


def _fit(ranks, sharding, optimizer, micro, x, y, start, epochs=2):
    def body(comm):
        model = pooled_model(optimizer)
        model.set_weights(start)
        hf.fit(model, x, y, batch_size=16, epochs=epochs, shuffle=False, verbose=0, comm=comm,
               num_replicas=ranks, num_microbatches=micro, embedding_sharding=sharding)
        parts = {n: model.get_layer(n).__dict__.get("_hyparflow_table_part") for n in ROWS}
        pooling = {n: p.pooling for n, p in parts.items() if p is not None}
        payload = next(p for p in parts.values() if p is not None).router.payload
        return model.get_weights(), pooling, payload

    return run_ranks(ranks, body, timeout=300)


@pytest.mark.parametrize("ranks,sharding,optimizer,micro", [
    (2, {"bmean": "row", "bsum": "table", "bavg": "column", "user": "row", "bmax": "row"}, "adam", 2),
    (4, {"bmean": "column", "bsum": "row", "bavg": "table", "user": "table"}, "adagrad", 2),
    (4, {"bmean": "row", "bsum": "row", "bavg": "row", "bmax": "column"}, "sgd", 2),
])
def test_pooled_lookups_train_as_model_fit(ranks, sharding, optimizer, micro):
    x, y = pooled_data()
    start, want, _ = reference(lambda: pooled_model(optimizer), x, y, epochs=2, batch_size=16)
    tol = 1e-6 if optimizer == "sgd" else 2e-6
    for weights, pooling, _ in _fit(ranks, sharding, optimizer, micro, x, y, start):
        diff = max(float(np.abs(a - b).max()) for a, b in zip(weights, want))
        assert diff <= tol, (sharding, optimizer, ranks, diff)
        # The sums were pooled by the owners; the max and the single id were not.
        kinds = {n: (p.combiner, p.masked) for n, p in pooling.items() if p is not None}
        assert kinds == {n: k for n, k in {"bmean": ("mean", True), "bsum": ("sum", False),
                                           "bavg": ("mean", False)}.items() if n in sharding}
        assert all(pooling[n] is None for n in ("user", "bmax") if n in pooling)


def test_pooled_short_last_batch_trains_as_model_fit():
    """A last batch of 3 over R=4 x M=2: replica 3 has no sample, and serves the
    others' pooled lookups (one vector per sample back, its rows' pairs from their
    samples' gradients: `idle.py`) as a replica with samples would."""
    x, y = pooled_data(n=35)
    start, want, _ = reference(lambda: pooled_model("adam"), x, y, epochs=2, batch_size=16)
    sharding = {"bmean": "row", "bsum": "column", "bavg": "table", "user": "row",
                "bmax": "row"}
    for weights, pooling, _ in _fit(4, sharding, "adam", 2, x, y, start):
        diff = max(float(np.abs(a - b).max()) for a, b in zip(weights, want))
        assert diff <= 2e-6, diff
        assert pooling["bmean"] is not None and pooling["bsum"] is not None


def _vectors(x, ranks, placements):
    """(pooled, per id): the rows and gradients one epoch sends between ranks, in
    vectors: pooled, one per (sample, owning rank other than the sample's) with a
    kept id there (each way); per id, one per id looked up on another rank."""
    pooled = per_id = 0
    for name, ids in x.items():
        ends = np.cumsum(placements[name].sizes)
        owners_all = np.searchsorted(ends, ids, side="right")
        kept = ids != 0 if name == "bmean" else np.ones_like(ids, bool)
        for start in range(0, len(ids), 16):
            for r in range(ranks):  # replica r's slice of the batch
                sl = slice(start + r * 16 // ranks, start + (r + 1) * 16 // ranks)
                owners = owners_all[sl]
                per_id += 2 * int((owners != r).sum())
                pooled += 2 * sum(len(set(o[k & (o != r)].tolist()))
                                  for o, k in zip(owners, kept[sl]))
    return pooled, per_id


def test_pooled_bytes_are_counted():
    """One vector per (sample, owner) travels each way, counted by the router: the
    sum over ranks of the rows' and gradients' bytes is exactly the pooled count
    (the per-id path would send one per id: more here)."""
    from hyparflow.kinds.tables import plan as tplan

    ranks = 2
    sharding = {"bmean": "row", "bsum": "table", "bavg": "row"}  # the rest: replicated
    x, y = pooled_data()
    out = _fit(ranks, sharding, "sgd", 2, x, y, pooled_model("sgd").get_weights(), epochs=1)
    sent = sum(payload for _, _, payload in out)
    placements = {p.table.name: p for p in tplan.place(
        [tplan.Table(n, ROWS[n], DIM) for n in ROWS], sharding, ranks)}
    pooled, per_id = _vectors({n: x[list(ROWS).index(n)] for n in sharding}, ranks,
                              placements)
    assert sent == pooled * DIM * 4, (sent, pooled * DIM * 4)
    assert 0 < pooled < per_id, (pooled, per_id)


def rs_model(optimizer="adam", shared=False):
    """keras_rs's DistributedEmbedding (off TPU: an EmbedReduce per table) with the
    three combiners over bags, and a standalone EmbedReduce; `shared`: two features
    of one table."""
    keras_rs = pytest.importorskip("keras_rs")
    keras.utils.set_random_seed(3)
    tables = {c: keras_rs.layers.TableConfig(name=f"t_{c}", vocabulary_size=20, embedding_dim=DIM,
                                            combiner=c) for c in ("mean", "sum", "sqrtn")}
    features = {c: keras_rs.layers.FeatureConfig(name=c, table=t, input_shape=(None, 3),
                                                 output_shape=(None, DIM))
                for c, t in tables.items()}
    if shared:
        features["again"] = keras_rs.layers.FeatureConfig(
            name="again", table=tables["sum"], input_shape=(None, 3), output_shape=(None, DIM))
    ins = {c: keras.Input((3,), dtype="int32", name=c) for c in features}
    out = keras_rs.layers.DistributedEmbedding(features, name="dist")(ins)
    alone = keras_rs.layers.EmbedReduce(16, DIM, combiner="mean", name="alone")(ins["mean"])
    h = keras.layers.Concatenate()([out[c] for c in features] + [alone])
    model = keras.Model(ins, keras.layers.Dense(1)(keras.layers.Dense(6, activation="tanh")(h)))
    opt = {"adam": keras.optimizers.Adam(0.05), "adagrad": keras.optimizers.Adagrad(0.1)}[optimizer]
    model.compile(optimizer=opt, loss="mse")
    return model


def rs_data(n=32, shared=False):
    rng = np.random.default_rng(4)
    names = ("mean", "sum", "sqrtn") + (("again",) if shared else ())
    return ({c: rng.integers(0, 16, (n, 3)).astype("int32") for c in names},
            rng.normal(size=(n, 1)).astype("float32"))


@pytest.mark.parametrize("ranks,sharding,optimizer", [
    (2, {"t_mean": "row", "t_sum": "column", "t_sqrtn": "table", "alone": "row"}, "adam"),
    (4, {"t_mean": "column", "t_sum": "row", "alone": "table"}, "adagrad")])
def test_keras_rs_tables_train_as_model_fit(ranks, sharding, optimizer):
    """DistributedEmbedding's tables are the units, named by TableConfig.name; each
    combiner ("sum", "mean", "sqrtn") is a pooled lookup by the owners."""
    build = lambda: rs_model(optimizer)  # noqa: E731
    x, y = rs_data()
    start, want, _ = reference(build, x, y, epochs=2, batch_size=16)

    def body(comm):
        model = build()
        model.set_weights(start)
        hf.fit(model, x, y, batch_size=16, epochs=2, shuffle=False, verbose=0, comm=comm,
               num_replicas=ranks, num_microbatches=2, embedding_sharding=sharding)
        dist = model.get_layer("dist")
        layers = {t.name: t for t in dist._default_device_embedding_layers.values()}
        layers["alone"] = model.get_layer("alone")
        held = {n: layers[n].__dict__.get("_hyparflow_table_part") for n in layers}
        return model.get_weights(), {n: (None if p is None else (tuple(p.variable.shape),
                                                                 p.pooling.combiner))
                                     for n, p in held.items()}

    out = run_ranks(ranks, body, timeout=300)
    tol = 2e-6
    for weights, _ in out:
        diff = max(float(np.abs(a - b).max()) for a, b in zip(weights, want))
        assert diff <= tol, (sharding, diff)
    for name in ("t_mean", "t_sum", "t_sqrtn", "alone"):
        held = [h[name] for _, h in out]
        if name not in sharding:
            assert held == [None] * ranks
            continue
        rows = 16 if name == "alone" else 20
        assert all(h[1] == ("mean" if name == "alone" else name[2:]) for h in held)
        shapes = [h[0] for h in held]
        if sharding[name] == "column":
            assert [s[0] for s in shapes] == [rows] * ranks and sum(s[1] for s in shapes) == DIM
        else:
            assert sum(s[0] for s in shapes) == rows and all(s[1] == DIM for s in shapes)


def test_keras_rs_shared_table_is_refused_and_replicated_trains():
    """A table serving two features is not sharded: named, an error with the reason;
    under "auto" (and without embedding_sharding) it stays replicated and trains to
    model.fit's weights."""
    build = lambda: rs_model("adam", shared=True)  # noqa: E731
    x, y = rs_data(shared=True)
    start, want, _ = reference(build, x, y, epochs=2, batch_size=16)

    def body(comm):
        model = build()
        try:
            hf.fit(model, x, y, batch_size=16, epochs=1, verbose=0, comm=comm,
                   embedding_sharding={"t_sum": "row"})
            error = None
        except ValueError as exc:
            error = str(exc)
        model = build()
        model.set_weights(start)
        hf.fit(model, x, y, batch_size=16, epochs=2, shuffle=False, verbose=0, comm=comm,
               embedding_sharding="auto")
        return error, model.get_weights()

    for error, weights in run_ranks(2, body, timeout=300):
        assert error is not None and "'t_sum'" in error and "serves 2 features" in error, error
        assert max(float(np.abs(a - b).max()) for a, b in zip(weights, want)) <= 2e-6
