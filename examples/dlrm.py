"""A DLRM-style click model with its embedding tables sharded over the ranks.

Synthetic click data made at run time from a planted model: 13 dense features and
`--features` categorical ones whose ids follow a power law (a few ids are most of the
traffic, as in click logs), tables from 10 to `--largest` rows. The model: a bottom
MLP on the dense features, one Embedding per categorical feature, the pairwise dot
products of all their vectors (DLRM's interaction), a top MLP to the click
probability. The tables are sharded (`embedding_sharding="auto"`: the plan is
printed), the MLPs data-parallel; it prints held-out AUC and log loss.

    hyparflow run -n 2 examples/dlrm.py
    mpiexec -n 4 python examples/dlrm.py --features 26 --largest 1000000
"""

import argparse

import keras
import numpy as np

import hyparflow as hf

DENSE, DIM = 13, 16


def sizes(features, largest):
    """Table rows from 10 to `largest`, spread on a log scale."""
    return [int(round(v)) for v in np.geomspace(10, largest, features)]


def click_data(n, rows, seed=0):
    """Dense features, power-law ids and clicks from a planted logistic model whose
    per-id effects are drawn once (seeded the same on every rank)."""
    planted = np.random.default_rng(1234)
    w_dense = planted.normal(size=DENSE) * 0.5
    effects = [planted.normal(size=r) * 0.8 for r in rows]
    rng = np.random.default_rng(seed)
    dense = rng.normal(size=(n, DENSE)).astype("float32")
    ids = [np.minimum((r * rng.random(n) ** 3).astype("int64"), r - 1).astype("int32")
           for r in rows]  # u**3: low ids far more often (a power law)
    logit = dense @ w_dense - 1.0 + sum(e[i] for e, i in zip(effects, ids)) / np.sqrt(len(rows))
    click = (rng.random(n) < 1 / (1 + np.exp(-logit))).astype("float32")[:, None]
    return [dense] + [i[:, None] for i in ids], click


def dlrm(rows):
    keras.utils.set_random_seed(7)
    dense_in = keras.Input((DENSE,), name="dense_features")
    bottom = keras.layers.Dense(32, activation="relu")(dense_in)
    bottom = keras.layers.Dense(DIM, activation="relu")(bottom)
    ins, vectors = [dense_in], [bottom]
    for k, r in enumerate(rows):
        ids = keras.Input((1,), dtype="int32", name=f"c{k}")
        ins.append(ids)
        vectors.append(keras.layers.Flatten()(keras.layers.Embedding(r, DIM, name=f"table{k}")(ids)))
    stacked = keras.ops.stack(vectors, axis=1)                      # (batch, F + 1, DIM)
    dots = keras.ops.matmul(stacked, keras.ops.transpose(stacked, (0, 2, 1)))
    f = len(vectors)
    upper = np.triu_indices(f, 1)
    pairs = keras.ops.take(keras.ops.reshape(dots, (-1, f * f)), upper[0] * f + upper[1], axis=1)
    top = keras.layers.Concatenate()([bottom, pairs])
    top = keras.layers.Dense(64, activation="relu")(top)
    out = keras.layers.Dense(1, activation="sigmoid")(top)
    model = keras.Model(ins, out)
    model.compile(optimizer=keras.optimizers.Adagrad(0.05), loss="binary_crossentropy",
                  metrics=[keras.metrics.AUC(name="auc")])
    return model


def build_model():
    """The default model, for `hyparflow plan examples/dlrm.py --embedding-sharding auto`."""
    return dlrm(sizes(8, 100_000))


def first_ids():
    """{table: its ids in the first 8 batches of 1024}, for `hyparflow plan --ids
    first_ids`: the power law puts most lookups on the low rows."""
    x, _ = click_data(8 * 1024, sizes(8, 100_000))
    return {f"table{k}": ids for k, ids in enumerate(x[1:])}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--samples", type=int, default=16384)
    p.add_argument("--features", type=int, default=8)
    p.add_argument("--largest", type=int, default=100_000)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch", type=int, default=512)
    args = p.parse_args()
    rows = sizes(args.features, args.largest)
    x, y = click_data(args.samples, rows)
    vx, vy = click_data(4096, rows, seed=1)
    model = dlrm(rows)
    hf.fit(model, x, y, batch_size=args.batch, epochs=args.epochs, embedding_sharding="auto",
           verbose=2 if hf.is_main() else 0)
    p = model.predict(vx, batch_size=4096, verbose=0)[:, 0].astype("float64")
    loss = float(np.mean(-(vy[:, 0] * np.log(p + 1e-7) + (1 - vy[:, 0]) * np.log(1 - p + 1e-7))))
    auc = keras.metrics.AUC()
    auc.update_state(vy, p)
    if hf.is_main():
        print(f"dlrm: held-out AUC {float(auc.result()):.4f}, log loss {loss:.4f} on 4096 "
              f"samples; {args.features} tables sharded over {hf.size()} ranks")


if __name__ == "__main__":
    main()
