"""The optimizer's own end-of-training and clipping, as `model.fit` does them (issue 48
items 1, 2, 5 and 6), against plain `model.fit` on one process, with Adam:

- `use_ema=True`: the moving averages become the weights after the last epoch
  (`optimizer.finalize_variable_values`, which `model.fit` calls), on every layout:
  pipelines, replicas, tensor ranks, sharded tables, ZeRO; with
  `ema_overwrite_frequency` too; what `evaluate` sees after fit and what a checkpoint
  resumes from.
- `global_clipnorm`: one norm summed over stages, tensor ranks and table owners, taken
  after the sums over microbatches and replicas, an Embedding's pairs counted as Keras
  counts them (its squares per lookup, then a dense step).
- `embedding_sharding="row"`: one kind for every table.
- the LossScaleOptimizer refusal says what holds for the layout at hand."""

import keras
import numpy as np
import pytest

import hyparflow
from conftest import check_resumes, max_diff, reference
from hyparflow.engine.local import run_ranks

L = keras.layers
BATCH, EPOCHS = 16, 2  # 64 samples: 8 steps


def model_with(optimizer, vocab=40):
    """An Embedding (sparse gradient pairs) averaged over 6 ids, then three Dense layers
    ("up" and "down" can be split over tensor ranks)."""
    def build():
        keras.utils.set_random_seed(4)
        ids = keras.Input((6,), dtype="int32", name="ids")
        h = L.GlobalAveragePooling1D()(L.Embedding(vocab, 8, name="table")(ids))
        h = L.Dense(32, activation="tanh", name="up")(h)
        h = L.Dense(16, activation="tanh", name="down")(h)
        out = L.Dense(3, name="head")(h)
        model = keras.Model(ids, out)
        model.compile(optimizer=optimizer(), loss="mse")
        return model
    return build


def data(n=64, vocab=40, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, vocab, (n, 6)).astype("int32")
    x[:, :3] = rng.integers(0, 4, (n, 3))  # repeated ids within a sample and a batch
    return x, rng.normal(size=(n, 3)).astype("float32")


def fit_layouts(build, layouts, tol=1e-5, evaluate=False, **fit_kwargs):
    """hf.fit at each layout ({fit's layout arguments}), thread ranks, against
    model.fit; returns {layout: max weight difference}. `evaluate`: every rank's
    `hf.evaluate` after fit gives model.evaluate's loss after model.fit."""
    x, y = data()
    start, want, _ = reference(build, x, y, epochs=EPOCHS, batch_size=BATCH, **fit_kwargs)
    if evaluate:
        model = build()
        model.set_weights(want)
        want_loss = model.evaluate(x, y, batch_size=BATCH, verbose=0)
    out = {}
    for layout in layouts:
        layout = dict(layout)
        env = layout.pop("env", {})
        sharded = layout.pop("shards", True)

        def body(comm, layout=layout):
            model = build()
            model.set_weights(start)
            hyparflow.fit(model, x, y, comm=comm, verbose=0, batch_size=BATCH, epochs=EPOCHS,
                          shuffle=False, **layout, **fit_kwargs)
            loss = None
            if evaluate:
                loss = hyparflow.evaluate(model, x, y, batch_size=BATCH, comm=comm, verbose=0,
                                          num_stages=layout.get("num_stages", 1))
            held = sum(int(np.prod(v.shape)) for v in model.optimizer.variables)
            return model.get_weights(), loss, held

        ranks = (layout.get("num_stages", 1) * layout.get("num_replicas", 1)
                 * layout.get("num_tensor", 1))
        with _env(env):
            got = run_ranks(ranks, body, timeout=600)
        diff = max(max_diff(w, want) for w, _, _ in got)
        print(f"{layout} {env}: max weight difference {diff:.2e}")
        out[str(layout)] = diff
        assert diff <= tol, f"{layout} {env}: max weight difference {diff:g} > {tol:g}"
        if evaluate:
            for _, loss, _ in got:
                assert loss == pytest.approx(want_loss, rel=1e-5), layout
        if env.get("HYPARFLOW_ZERO") == "1" and sharded:
            # Sharded: no rank holds the whole optimizer state (slots and averages).
            model = build()
            model.optimizer.build(model.trainable_variables)
            whole = sum(int(np.prod(v.shape)) for v in model.optimizer.variables)
            assert max(h for *_, h in got) < whole, (layout, [h for *_, h in got], whole)
    return out


class _env:
    def __init__(self, values):
        self.values, self.kept = values, {}

    def __enter__(self):
        import os
        for k, v in self.values.items():
            self.kept[k] = os.environ.get(k)
            os.environ[k] = v

    def __exit__(self, *exc):
        import os
        for k, v in self.kept.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def ema():
    return keras.optimizers.Adam(0.05, use_ema=True, ema_momentum=0.9)


# -- 1. use_ema -------------------------------------------------------------------------

def test_ema_weights_at_the_end_of_fit_on_pipelines_and_replicas():
    # Before: 4.2e-2 at S=2 M=2 and at S=1 R=2 (the averages never became the weights).
    fit_layouts(model_with(ema), [
        dict(num_stages=2, num_microbatches=2),
        dict(num_replicas=2),
        dict(num_stages=2, num_replicas=2, num_microbatches=2),
    ], evaluate=True)


def test_ema_overwrite_frequency():
    # Before: 1.6e-2 (8 steps: overwritten at steps 3 and 6, not at the end).
    opt = lambda: keras.optimizers.Adam(0.05, use_ema=True, ema_momentum=0.9,  # noqa: E731
                                        ema_overwrite_frequency=3)
    fit_layouts(model_with(opt), [dict(num_stages=2, num_microbatches=2),
                                  dict(num_replicas=2, num_microbatches=2)])


def test_ema_with_tensor_ranks_tables_and_zero():
    fit_layouts(model_with(ema), [
        dict(num_tensor=2, tensor_layers=["up", "down"], num_microbatches=2),
        dict(num_replicas=2, embedding_sharding={"table": "row"}),
        dict(num_stages=2, num_replicas=2, embedding_sharding={"table": "row"}),
        # ZeRO: each owner keeps the averages of its rows.
        dict(num_replicas=2, num_microbatches=2, env={"HYPARFLOW_ZERO": "1"}),
        dict(num_stages=2, num_replicas=2, env={"HYPARFLOW_ZERO": "1"}),
    ])


def test_ema_resumes_from_a_checkpoint(tmp_path):
    # The epoch-end checkpoint holds the weights and the averages (as a Keras
    # ModelCheckpoint sees them: before the end of fit); resumed, the end of the
    # second run is model.fit's over both epochs.
    x, y = data()
    check_resumes(model_with(ema), x, y, tmp_path, [(1, dict(num_stages=2)),
                                                     (2, dict(num_stages=2, resume=True))],
                  batch_size=BATCH)


def test_ema_with_replicas_stepping_on_their_own_is_refused():
    x, y = data()
    build = model_with(ema)

    def body(comm):
        hyparflow.fit(build(), x, y, comm=comm, verbose=0, batch_size=BATCH, num_replicas=2,
                      replica_sync=hyparflow.LocalSGD(every=2))

    with pytest.raises(NotImplementedError, match="use_ema=True with replica_sync"):
        run_ranks(2, body, timeout=300)


# -- 2. global_clipnorm -----------------------------------------------------------------

def clipped():
    return keras.optimizers.Adam(0.05, global_clipnorm=0.05)


def test_global_clipnorm_over_stages_and_replicas():
    # Before: refused at S >= 2 ("each stage would see only part of the gradients").
    fit_layouts(model_with(clipped), [
        dict(num_stages=2, num_microbatches=2),
        dict(num_stages=2, num_replicas=2, num_microbatches=2),
        dict(num_stages=3, num_microbatches=2, schedule="gpipe"),
    ])


def test_global_clipnorm_with_tensor_ranks_tables_and_zero():
    # Before: refused with num_tensor > 1 and with sharded tables.
    fit_layouts(model_with(clipped), [
        dict(num_tensor=2, tensor_layers=["up", "down"], num_microbatches=2),
        dict(num_stages=2, num_tensor=2, tensor_layers=["up", "down"]),
        dict(num_replicas=2, embedding_sharding={"table": "row"}, num_microbatches=2),
        dict(num_replicas=2, embedding_sharding={"table": "column"}),
        dict(num_stages=2, num_replicas=2, embedding_sharding={"table": "row"}),
        # ZeRO steps whole variables under global_clipnorm (`zero.why_not`).
        dict(num_stages=2, num_replicas=2, env={"HYPARFLOW_ZERO": "1"}, shards=False),
    ])


def test_global_clipnorm_counts_a_tied_embedding_once():
    # The GPT's token embedding is used on the first and the last stage: each holds
    # the summed gradient, which counts once (on the stage that owns it).
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
        __file__)))), "examples"))
    import gpt_text

    def build():
        model = gpt_text.build_model(context=16, dim=16, heads=2, blocks=2)
        model.compile(optimizer=keras.optimizers.Adam(1e-2, global_clipnorm=0.2, use_ema=True),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    x, y = gpt_text.windows(gpt_text.encode(gpt_text.read_source(4000)), 16, 8)
    x, y = x[:64], y[:64]
    start, want, _ = reference(build, x, y, epochs=1, batch_size=32)

    def body(comm):
        model = build()
        model.set_weights(start)
        hyparflow.fit(model, x, y, comm=comm, verbose=0, batch_size=32, epochs=1,
                      shuffle=False, num_stages=3, num_microbatches=2)
        return model.get_weights()

    diff = max(max_diff(w, want) for w in run_ranks(3, body, timeout=600))
    print(f"tied GPT, S=3: max weight difference {diff:.2e}")
    assert diff <= 1e-5


def test_global_clipnorm_and_ema_together():
    opt = lambda: keras.optimizers.Adam(0.05, global_clipnorm=0.05,  # noqa: E731
                                        use_ema=True, ema_momentum=0.9)
    fit_layouts(model_with(opt), [dict(num_stages=2, num_replicas=2, num_microbatches=2)])


def test_global_clipnorm_counts_embedding_pairs_as_keras():
    # Keras squares an IndexedSlices' values one lookup at a time and steps the
    # clipped gradient densely; SGD's pairs must not be summed first.
    sgd = lambda: keras.optimizers.SGD(0.5, momentum=0.9, global_clipnorm=0.05)  # noqa: E731
    fit_layouts(model_with(sgd), [dict(num_replicas=2), dict(num_stages=2, num_replicas=2)])


def test_clipnorm_per_variable_on_parts_is_still_refused():
    x, y = data()
    build = model_with(lambda: keras.optimizers.Adam(clipnorm=1.0))

    def body(comm):
        hyparflow.fit(build(), x, y, comm=comm, verbose=0, batch_size=BATCH, num_tensor=2,
                      tensor_layers=["up", "down"])

    with pytest.raises(NotImplementedError, match="clipnorm=1.0 clips each variable"):
        run_ranks(2, body, timeout=300)


# -- 5. embedding_sharding="row" --------------------------------------------------------

def two_tables():
    keras.utils.set_random_seed(7)
    a = keras.Input((3,), dtype="int32", name="a")
    b = keras.Input((1,), dtype="int32", name="b")
    ea = L.GlobalAveragePooling1D()(L.Embedding(30, 4, name="first")(a))
    eb = L.Flatten()(L.Embedding(20, 4, name="second")(b))
    out = L.Dense(1, name="head")(L.Concatenate()([ea, eb]))
    model = keras.Model([a, b], out)
    model.compile(keras.optimizers.Adam(0.05), "mse")
    return model


def test_one_kind_for_every_table(capsys):
    # Before: refused ("must be 'auto' or a dict").
    rng = np.random.default_rng(3)
    x = [rng.integers(0, 30, (48, 3)).astype("int32"), rng.integers(0, 20, (48, 1)).astype("int32")]
    y = rng.normal(size=(48, 1)).astype("float32")
    start, want, _ = reference(two_tables, x, y, epochs=EPOCHS, batch_size=BATCH)

    def body(comm):
        model = two_tables()
        model.set_weights(start)
        history = hyparflow.fit(model, x, y, comm=comm, verbose=1 if comm.rank == 0 else 0,
                                batch_size=BATCH, epochs=EPOCHS, shuffle=False,
                                num_replicas=2, embedding_sharding="row")
        return model.get_weights(), history

    got = run_ranks(2, body, timeout=300)
    diff = max(max_diff(w, want) for w, _ in got)
    print(f"embedding_sharding='row', R=2: max weight difference {diff:.2e}")
    assert diff <= 1e-5
    said = capsys.readouterr().out
    assert said.count("embedding_sharding='row' applies to") == 1, said
    assert "'first'" in said and "'second'" in said


def test_one_kind_keeps_what_cannot_take_it_and_names_what_is_wrong():
    from hyparflow.kinds.tables import plan as tplan

    tables = [tplan.Table("big", 100, 8), tplan.Table("tiny", 1, 8), tplan.Table("tied", 50, 8)]
    wanted, kept = tplan.expand("row", tables, 2, {"tied": "tied to another layer"})
    assert wanted == {"big": "row", "tiny": "data", "tied": "data"}
    assert set(kept) == {"tiny", "tied"}
    assert tplan.expand("column", tables, 2)[0] == {n: "column" for n in ("big", "tiny", "tied")}
    with pytest.raises(ValueError, match="embedding_sharding='rows' is not a sharding kind"):
        tplan.expand("rows", tables, 2)


# -- 6. the LossScaleOptimizer refusal, said for the layout -------------------------------

@pytest.mark.parametrize("layout, says, not_says", [
    ((1, 1, 1), "num_stages=1, num_tensor=1, num_replicas=1", "agreed"),
    ((1, 1, 2), "by the 2 replicas", "2 stages"),
    ((2, 1, 1), "by the 2 stages", "2 replicas"),
    ((2, 2, 1), "by the 2 stages and 2 tensor ranks", "2 replicas"),
])
def test_loss_scale_refusal_names_the_layout(layout, says, not_says):
    from hyparflow.engine.prepare import loss_scale_refusal

    text = loss_scale_refusal(*layout)
    assert says in text and not_says not in text, text
    assert "mixed_bfloat16" in text


def test_loss_scale_refused_at_one_stage_without_every_stage():
    x, y = data()
    build = model_with(lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam()))

    def body(comm):
        hyparflow.fit(build(), x, y, comm=comm, verbose=0, batch_size=BATCH, num_replicas=2)

    with pytest.raises(NotImplementedError) as info:
        run_ranks(2, body, timeout=300)
    assert "every stage" not in str(info.value)
    assert "2 replicas" in str(info.value)
