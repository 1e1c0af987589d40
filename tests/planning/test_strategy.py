"""Strategy files (docs/strategy.md): the schema and its validator agree, a bad file
is named field by field, old plan files load, the schedule goes out and back in as
torch pipelining's CSV, and a per-layer strategy trains to plain Keras's weights."""

import json
import re
import os
import pathlib
import subprocess
import sys

import keras
import numpy as np
import pytest

from conftest import max_diff, reference, train_ranks
from hyparflow import graph as G, plan as P, strategy as S
from hyparflow.engine.local import run_ranks
from hyparflow.layout import Layout

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCHEMA = json.loads((ROOT / "docs" / "strategy.schema.json").read_text())


def wide_mlp(optimizer=None):
    """Narrow Dense layers around one wide pair (a column and a row split)."""
    keras.utils.set_random_seed(5)
    inp = keras.Input((10,))
    x = keras.layers.Dense(12, activation="relu", name="narrow_in")(inp)
    x = keras.layers.Dense(64, activation="relu", name="wide_up")(x)
    x = keras.layers.Dense(12, activation="tanh", name="wide_down")(x)
    x = keras.layers.Dense(12, activation="relu", name="narrow_mid")(x)
    out = keras.layers.Dense(3, activation="softmax", name="head")(x)
    model = keras.Model(inp, out)
    model.compile(optimizer or keras.optimizers.Adam(0.01), "sparse_categorical_crossentropy")
    return model


def data(n=64):
    rng = np.random.default_rng(1)
    return rng.normal(size=(n, 10)).astype("float32"), rng.integers(0, 3, n)


def strategy(layers, shape, **extra):
    doc = {"format": "hyparflow-strategy", "version": 1,
           "mesh": {"axes": ["stage", "tensor", "replica"], "shape": shape},
           "num_microbatches": 2, "schedule": "1f1b",
           "stages": [{"recompute": False} for _ in range(shape[0])], "layers": layers}
    doc.update(extra)
    return doc


def test_the_schema_and_the_validator_name_the_same_fields_and_kinds():
    from hyparflow.kinds.tensor import registry

    assert set(S.KINDS) == set(registry.BY_NAME)
    layer = SCHEMA["properties"]["layers"]["items"]
    assert layer["properties"]["split"]["enum"] == list(S.SPLITS)
    assert set(layer["properties"]) == {"name", "stage", "split"}
    assert set(SCHEMA["properties"]) == S.TOP
    assert SCHEMA["properties"]["mesh"]["properties"]["axes"]["const"] == list(S.AXES)
    assert SCHEMA["properties"]["format"]["const"] == S.FORMAT


def test_a_bad_file_is_named_field_by_field():
    good = strategy([{"name": "a", "stage": 0}, {"name": "b", "stage": 1, "split": "whole"}],
                    [2, 1, None])
    assert S.validate(good) == []
    bad = strategy([{"name": "a", "stage": 1}, {"name": "b", "stage": 0, "split": "columns"},
                    {"name": "a", "stage": 1, "extra": 3}], [2, "two", 1],
                   num_microbatches=0)
    errors = "\n".join(S.validate(bad))
    assert "mesh.shape[1] (tensor): must be an integer >= 1. Received: 'two'" in errors
    assert "num_microbatches: must be an integer >= 1. Received: 0" in errors
    assert "layers[1].stage: 0 after a layer on stage 1" in errors
    assert "layers[1].split: unknown split 'columns'" in errors
    assert "layers[2].name: 'a' is listed twice" in errors
    assert "layers[2].extra: not a field of a layer entry" in errors
    split_alone = strategy([{"name": "a", "stage": 0, "split": "column"}], [1, 1, 1])
    assert "one tensor rank splits nothing" in "\n".join(S.validate(split_alone))
    mixed = strategy([{"name": "a", "stage": 0, "split": "auto"}, {"name": "b", "stage": 0}],
                     [1, 2, 1])
    assert "must be on every layer or on none" in "\n".join(S.validate(mixed))
    threads = dict(good, threads_per_rank=0)
    assert "threads_per_rank: must be a whole number of threads, 1 or more" in \
        "\n".join(S.validate(threads))


def test_plan_writes_a_valid_strategy_and_old_plan_files_still_load(tmp_path):
    graph = G.from_model(wide_mlp())
    names = [n.name for n in graph.nodes]
    path = tmp_path / "new.json"
    plan = P.write(str(path), graph, Layout(num_stages=2, num_tensor=1, num_microbatches=2,
                                            balance=(2, 3)),
                   predicted={"step_s": 0.01}, recompute=(True, False), threads_per_rank=3)
    doc = json.loads(path.read_text())
    assert S.validate(doc) == [] and doc["format"] == "hyparflow-strategy"
    assert doc["threads_per_rank"] == 3 == P.read(str(path))["threads_per_rank"]
    assert [e["stage"] for e in doc["layers"]] == [0, 0, 1, 1, 1]
    assert plan["recompute"] == [True, False] and P.read(str(path)).counts == [2, 3]
    old = {"format": "hyparflow-plan", "version": 1, "num_stages": 1, "num_replicas": 1,
           "num_microbatches": 2, "schedule": "1f1b", "num_tensor": 2,
           "tensor_layers": ["wide_up"], "stages": [{"layers": names}]}
    (tmp_path / "old.json").write_text(json.dumps(old))
    read = P.read(str(tmp_path / "old.json"))
    assert read.counts == [len(names)] and read["tensor_layers"] == ["wide_up"]
    as_strategy = read.strategy
    assert S.validate(as_strategy) == []
    assert [e["split"] for e in as_strategy["layers"]][1:3] == ["split", "whole"]
    back = S.to_plan(as_strategy)
    assert back["tensor_layers"] == ["wide_up"] and back["num_tensor"] == 2


@pytest.mark.parametrize("name,chunks", [("gpipe", 1), ("1f1b", 1), ("zb-h1", 1),
                                         ("zb-batched", 1), ("interleaved", 2)])
def test_schedules_go_out_and_back_in_as_torch_action_lists(name, chunks):
    from hyparflow.planning import schedule_csv as C
    from hyparflow.schedules import build

    lists = build(name, 2, 4, chunks)
    text = C.export(lists)
    assert all(cell[0].isdigit() and cell[1] in "FIWB" for row in text.split() for cell in
               row.split(","))
    back = C.parse(text)
    assert C.match(back, 4) == name
    makespan, bubble = C.check(back, 4)
    assert makespan > 0 and 0 <= bubble < 1
    with pytest.raises(ValueError, match="row 1, column 0: '0F0' is stage 0"):
        C.parse("0F0,0B0\n0F0,1B0\n")


def test_the_command_validates_and_shows_without_tensorflow(tmp_path):
    good = strategy([{"name": "narrow_in", "stage": 0},
                     {"name": "wide_up", "stage": 1, "split": "column"}], [2, 2, None])
    bad = dict(good, layers=[{"name": "x", "stage": 4}])
    (tmp_path / "good.json").write_text(json.dumps(good))
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    code = ("import sys, hyparflow_command; from hyparflow.cli import main; "
            "code = main(sys.argv[1:]); assert 'tensorflow' not in sys.modules; sys.exit(code)")

    def run(*args):
        return subprocess.run([sys.executable, "-c", code, "strategy", *args], env=env,
                              capture_output=True, text=True, timeout=120, cwd=str(tmp_path))

    shown = run("show", "good.json")
    assert shown.returncode == 0, shown.stderr
    assert "wide_up" in shown.stdout and "column" in shown.stdout
    assert "stage 1: ranks 2-3" in shown.stdout
    assert run("validate", "good.json").returncode == 0
    failed = run("validate", "bad.json")
    assert failed.returncode == 1 and "layers[0].stage: must be an integer in 0..1" in failed.stderr
    out = run("export-schedule", "good.json", "--output", "s.csv")
    assert out.returncode == 0, out.stderr
    imported = run("import-schedule", "s.csv")
    assert "'1f1b' gives the same lists" in imported.stdout, imported.stderr


# Two per-layer strategies at 2 ranks, each against plain Keras with Adam: a chosen
# uneven cut with stage 0 recomputing, and one stage whose tensor ranks split only
# the wide pair (the narrow layers stay whole).
CUT = [{"name": n, "stage": s} for n, s in (("narrow_in", 0), ("wide_up", 0),
                                              ("wide_down", 0), ("narrow_mid", 1),
                                              ("head", 1))]
SPLIT = [{"name": n, "stage": 0, "split": k} for n, k in (
    ("narrow_in", "whole"), ("wide_up", "column"), ("wide_down", "row"),
    ("narrow_mid", "whole"), ("head", "whole"))]


@pytest.mark.parametrize("layers,shape,recompute", [(CUT, [2, 1, 1], [True, False]),
                                                   (SPLIT, [1, 2, 1], [False])])
def test_a_per_layer_strategy_trains_to_keras_weights(tmp_path, monkeypatch, layers, shape,
                                                     recompute):
    from hyparflow.engine import stage
    from hyparflow.loop import runtime

    seen = {"recompute": set(), "split": set()}
    made, chose = stage.Stage.__init__, runtime.Runtime._choose_splits

    def init(self, graph, cut, *args, **kwargs):  # what each rank's stage was told
        made(self, graph, cut, *args, **kwargs)
        seen["recompute"].add((cut.index, self.recompute))

    def choose(self):
        mine, calls = chose(self)
        seen["split"].update(self.graph.nodes[i].op.name for i in calls)
        return mine, calls

    monkeypatch.setattr(stage.Stage, "__init__", init)
    monkeypatch.setattr(runtime.Runtime, "_choose_splits", choose)
    x, y = data()
    start, expected, _ = reference(wide_mlp, x, y, epochs=2, batch_size=16)
    doc = strategy([dict(e) for e in layers], shape,
                   stages=[{"recompute": r} for r in recompute])
    path = tmp_path / "strategy.json"
    path.write_text(json.dumps(doc))
    # (S and T passed again, as the plan says, for train_ranks to count the ranks)
    results = train_ranks(wide_mlp, x, y, num_stages=shape[0], num_replicas=None,
                          num_microbatches=None, num_tensor=shape[1], plan=str(path),
                          weights=start, batch_size=16, epochs=2, shuffle=False)
    assert max(max_diff(w, expected) for w, _ in results) <= 1e-5
    assert seen["recompute"] == set(enumerate(recompute))
    assert seen["split"] == {e["name"] for e in layers if e.get("split", "whole") != "whole"}


def test_a_kind_the_engine_would_not_use_is_named(tmp_path):
    x, y = data(32)
    wrong = [dict(e, split="row" if e["name"] == "wide_up" else e["split"]) for e in SPLIT]
    path = tmp_path / "strategy.json"
    path.write_text(json.dumps(strategy(wrong, [1, 2, 1])))

    def body(comm):
        import hyparflow as hf

        hf.fit(wide_mlp(), x, y, batch_size=16, epochs=1, plan=str(path), comm=comm, verbose=0)

    with pytest.raises(ValueError, match=r"layers\[1\]\.split: the strategy splits 'wide_up' "
                                         r"as 'row', but the engine splits it as 'column'"):
        run_ranks(2, body, timeout=120)


def one_wide_mlp():
    """Narrow Dense layers (each over MIN_PARAMS weights, so the global rule splits
    them too) and one very wide output layer."""
    inp = keras.Input((256,))
    x = inp
    for k in range(3):
        x = keras.layers.Dense(256, activation="relu", name=f"narrow{k}")(x)
    model = keras.Model(inp, keras.layers.Dense(16384, name="wide")(x))
    return model


def test_the_per_layer_search_splits_only_the_wide_layer_and_beats_every_global_tuple():
    from hyparflow.planning import planner, search

    graph = G.from_model(one_wide_mlp())
    # Compute in proportion to the weights; a network whose latency makes an exchange
    # dearer than a narrow layer's half.
    rows = [(0.0, 1e-10 * n.params, 4 * n.params, 8 * n.params, 4 * 256) for n in graph.nodes]
    network = planner.Network(2e-4, 1e-9)
    everything = planner.search(graph, rows, 0.0, network, 16, 2, microbatches=(1, 2))
    assert any(p["tensor"] == 2 and len(p["tensor_layers"]) == 4 for p in everything)
    best, done = search.layers(graph, rows, 0.0, network, 16, 2, microbatches=(1, 2),
                               seconds=20)
    assert best["tensor"] == 2 and best["tensor_layers"] == ["wide"], best
    assert best["step_s"] < min(p["step_s"] for p in everything)
    assert done["predicted"] >= done["shapes"] > 0


def test_plan_search_layers_writes_the_faster_strategy(tmp_path, capsys):
    from hyparflow.planning import command

    source = tmp_path / "wide.py"
    source.write_text("import keras\nimport test_strategy\n\ndef build_model():\n"
                      "    model = test_strategy.one_wide_mlp()\n"
                      "    model.compile('adam', keras.losses.SparseCategoricalCrossentropy("
                      "from_logits=True))\n    return model\n")
    out = tmp_path / "wide.json"
    # A given network (nothing under mpiexec) whose latency makes the narrow layers'
    # exchanges dearer than their halves.
    assert command.main([str(source), "--batch-size", "16", "--ranks", "2", "--latency",
                         "200us", "--bandwidth", "1GB/s", "--microbatches", "1", "2",
                         "--search", "layers", "--search-seconds", "5",
                         "--output", str(out)]) == 0
    text = capsys.readouterr().out
    found = {what: (float(step), [] if named == "nothing" else named.split(", "))
             for what, named, step in re.findall(
                 r"best (global tuple|per layer) .* splits (.*): step ([0-9.]+) s", text)}
    assert len(found) == 2, text
    doc = json.loads(out.read_text())
    assert S.validate(doc) == []
    split = [(e["name"], e["split"]) for e in doc["layers"] if e["split"] != "whole"]
    # The faster of the two is written (the steps are printed rounded: on a printed
    # tie, either); its split layers named with the engine's kinds.
    (fast, first), (slow, second) = sorted(found.values())
    assert [n for n, _ in split] in ([first] if fast < slow else [first, second]), text
    assert {k for _, k in split} <= {"column", "row"} and "wide" in dict(split)


def _plan_dataset(tmp_path, source, *extra):
    from hyparflow.planning import command, dataset

    out = tmp_path / "space.csv"
    assert command.main([str(source), "--batch-size", "16", "--ranks", "2", "--latency",
                         "200us", "--bandwidth", "1GB/s", "--microbatches", "1", "2",
                         "--search", "layers", "--search-seconds", "2", "--explore-all",
                         "--dataset", str(out), *extra]) == 0
    import csv

    with open(out) as f:
        table = list(csv.DictReader(f))
    assert tuple(table[0]) == dataset.COLUMNS
    return table


def test_the_explored_space_is_a_dataset_of_valid_strategies(tmp_path):
    source = tmp_path / "wide.py"
    source.write_text("import keras\nimport test_strategy\n\ndef build_model():\n"
                      "    model = test_strategy.one_wide_mlp()\n"
                      "    model.compile('adam', keras.losses.SparseCategoricalCrossentropy("
                      "from_logits=True))\n    return model\n")
    table = _plan_dataset(tmp_path, source)
    assert {r["search"] for r in table} == {"global", "layers"}
    # S x T x R = 2 in every way, each microbatch count, and no candidate twice.
    assert {(r["stages"], r["tensor"], r["replicas"]) for r in table} == {
        ("1", "2", "1"), ("2", "1", "1"), ("1", "1", "2")}
    assert len({(r["search"], r["strategy"]) for r in table}) == len(table)
    assert len({(r["model"], r["machine"]) for r in table}) == 1
    assert all(re.fullmatch(r"[0-9a-f]{12}", r[k]) for r in table for k in ("model", "machine"))
    for r in table:
        doc = json.loads(r["strategy"])
        assert S.validate(doc) == [], r
        assert doc["mesh"]["shape"] == [int(r["stages"]), int(r["tensor"]), int(r["replicas"])]
        assert float(r["predicted_step_s"]) > 0 and int(r["memory_per_rank_bytes"]) > 0
        assert r["measured_step_s"] == ""


@pytest.mark.mpiexec
def test_measure_runs_candidates_for_real(tmp_path):
    source = tmp_path / "small.py"
    # Self-contained: the ranks under mpiexec import it without this folder on their path.
    source.write_text("import keras\n\ndef build_model():\n"
                      "    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, "
                      "activation='relu', name='a'), keras.layers.Dense(4, name='b')])\n"
                      "    model.compile('adam', 'mse')\n    return model\n")
    table = _plan_dataset(tmp_path, source, "--measure", "2", "--measure-steps", "2")
    measured = [r for r in table if r["measured_step_s"]]
    assert len(measured) == 2 and all(float(r["measured_step_s"]) > 0 for r in measured)
    ranked = sorted((r for r in table if r["fits"] == "1"),
                    key=lambda r: float(r["predicted_step_s"]))
    assert measured[0] in (ranked[0], ranked[-1]) and measured[1] in (ranked[0], ranked[-1])
