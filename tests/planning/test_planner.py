"""The planner: units, the cost model's shape, and `hyparflow plan` end to end."""

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

import hyparflow as hf
import models
from hyparflow.planning import command, costmodel, measure, planner
from hyparflow.planning.shapes import Candidate, choose, shapes as node_shapes
from hyparflow import graph as G
from hyparflow.engine.local import run_ranks


def test_units():
    assert command.parse_bytes("12.5GB/s") == 12.5e9
    assert command.parse_bytes("4GiB") == 4 * 2 ** 30
    assert command.parse_seconds("2us") == pytest.approx(2e-6)
    with pytest.raises(ValueError, match="Cannot read"):
        command.parse_bytes("lots")


def test_cost_model_behaves_like_a_pipeline():
    graph = G.from_model(models.mlp())
    # Four equal layer calls of 1 ms per sample-batch, no overhead, a free network.
    rows = [(0.0, 1e-3, 1000, 0, 100)] * len(graph.nodes)
    free = planner.Network(0.0, 0.0)
    one = planner.predict(graph, rows, 0.0, free, [5], 64, 1, 1, "1f1b")
    two = planner.predict(graph, rows, 0.0, free, [2, 3], 64, 1, 8, "1f1b")
    # Stages of 2 and 3 calls: the slower one sets the pace, so more idle than (S-1)/(M+S-1).
    assert 1 / 9 < two["bubble"] < 0.3
    assert one["step_s"] / two["step_s"] > 1.3   # pipelining pays off
    slow = planner.Network(1e-3, 1e-9)
    dp = planner.predict(graph, rows, 0.0, slow, [5], 64, 2, 1, "1f1b")
    assert dp["comm_s"] > 0
    plans = planner.search(graph, rows, 0.0, free, 64, 4, memory_limit=10 ** 9)
    assert plans[0]["step_s"] == min(p["step_s"] for p in plans)
    assert {(p["stages"], p["replicas"]) for p in plans} >= {(1, 4), (2, 2), (4, 1)}


def test_measured_rings_replace_the_two_rank_figures():
    two = planner.Network(1e-6, 1e-10)
    crowded = planner.Network(1e-6, 1e-10, groups={4: (1e-3, 4e-10)})
    nbytes = 32e6
    assert two.allreduce(nbytes, 4) == pytest.approx(1.5 * nbytes * 1e-10 + 6e-6)
    # Rings of 4 use their own round latency and bandwidth; other sizes keep alpha, beta.
    assert crowded.allreduce(nbytes, 4) == pytest.approx(1.5 * nbytes * 4e-10 + 6e-3)
    assert crowded.allreduce(nbytes, 2) == two.allreduce(nbytes, 2)
    assert crowded.message(1e3, ranks=4) == pytest.approx(1e-3 + 1e3 * 4e-10)
    assert crowded.message(1e3) == two.message(1e3)
    # Across nodes: the given inter-node figures, whatever was measured here.
    far = planner.Network(1e-6, 1e-10, 5e-6, 1e-9, groups={4: (1e-3, 4e-10)})
    assert far.allreduce(nbytes, 4, across=True) == pytest.approx(1.5 * nbytes * 1e-9 + 30e-6)


@pytest.mark.mpiexec
def test_rings_are_measured_with_every_rank_running():
    # Four processes under the venv's mpiexec (on 2 cores: two per core).
    groups, exchanges, wait = measure.rings(4)
    assert sorted(groups) == sorted(exchanges) == [2, 4]
    for alpha, beta in [*groups.values(), *exchanges.values()]:
        assert 0 < alpha < 1.0 and 0 < beta < 1e-6
    assert 0 < wait < 1.0


def test_ranks_computing_at_once_slow_each_other_only_then():
    graph = G.from_model(models.mlp())
    rows = [(0.0, 1e-3, 1000, 0, 100)] * len(graph.nodes)
    free = planner.Network(0.0, 0.0)
    # Measured: one rank alone takes 5 ms + 1 ms/sample; two at once, twice as long.
    crowded = planner.Compute({1: {8: 0.013, 64: 0.069}, 2: {8: 0.026, 64: 0.138}}, 0.0)
    alone = planner.Compute({1: {8: 0.013, 64: 0.069}, 2: {8: 0.013, 64: 0.069}}, 0.0)
    assert crowded.slowdown(32)(2) == pytest.approx(2.0)
    assert crowded.slowdown(32)(4) == pytest.approx(4.0)  # beyond the measured: in proportion
    # The rows are rescaled to the rank's own measured speed (0.005 + 32 * 0.001).
    dp = planner.predict(graph, rows, 0.0, free, [5], 64, 2, 1, "1f1b", compute=alone)
    assert dp["step_s"] == pytest.approx(0.037)
    # Two replicas always compute together, so contention doubles their step ...
    slow = planner.predict(graph, rows, 0.0, free, [5], 64, 2, 1, "1f1b", compute=crowded)
    assert slow["step_s"] == pytest.approx(2 * dp["step_s"])
    # ... while two stages of one microbatch never do, and pay nothing for it.
    one = planner.predict(graph, rows, 0.0, free, [2, 3], 64, 1, 1, "1f1b", compute=alone)
    assert planner.predict(graph, rows, 0.0, free, [2, 3], 64, 1, 1, "1f1b",
                           compute=crowded)["step_s"] == pytest.approx(one["step_s"])


def test_stages_that_keep_a_tape_cost_more():
    graph = G.from_model(models.mlp())
    rows = [(0.0, 1e-3, 4000, 0, 100)] * len(graph.nodes)
    free = planner.Network(0.0, 0.0)
    costs = {"batches": [8, 64], "taped": [1.5, 1.5], "forward": [0.25, 0.25],
             "add_s_per_byte": 0.0}
    plain = planner.predict(graph, rows, 0.0, free, [2, 3], 64, 1, 1, "1f1b")
    taped = planner.predict(graph, rows, 0.0, free, [2, 3], 64, 1, 1, "1f1b", stage_costs=costs)
    # Stage 0 (2 calls of 64 ms) keeps a tape: 1.5 times longer; the last one fuses.
    assert taped["step_s"] - plain["step_s"] == pytest.approx(0.5 * 2 * 0.064)
    # One stage fuses too, so only summing its gradients adds to it.
    single = planner.predict(graph, rows, 0.0, free, [5], 64, 1, 1, "1f1b",
                             stage_costs=dict(costs, add_s_per_byte=1e-9))
    assert single["step_s"] == pytest.approx(5 * 0.064 + 5 * 4000 * 1e-9)


def test_stage_costs_are_measured_on_a_real_stage():
    import keras

    model = models.mlp()
    graph = G.from_model(model)
    rows, _ = __import__("hyparflow.profile", fromlist=["fit_model"]).fit_model(graph, model, (8, 32))
    for _ in range(3):   # timings: a neighbour's burst of load can spoil one measurement
        costs = measure.stage_costs(graph, model, rows, (8, 32), repeats=3)
        if all(0.1 < f < 0.9 for f in costs["forward"]):
            break
    assert costs["batches"] == [8, 32] and len(costs["taped"]) == len(costs["forward"]) == 2
    # A real stage's taped forward and backward cost more than its share of the fused
    # step (values are clamped below at 1), but not tens of times more.
    assert all(1.0 <= t < 50 for t in costs["taped"]), costs
    assert all(0.1 < f < 0.9 for f in costs["forward"]), costs["forward"]
    assert 0 < costs["add_s_per_byte"] < 1e-8
    assert measure.stage_costs(G.from_model(keras.Sequential([keras.Input((3,)),
                                                              keras.layers.Dense(2)])),
                               None, rows[:1], (8, 32)) is None


@pytest.mark.mpiexec
def test_compute_is_measured_with_every_rank_running(tmp_path):
    source = tmp_path / "model.py"
    tests = pathlib.Path(__file__).resolve().parents[1]   # models.py
    source.write_text(f"import sys\nsys.path.insert(0, {str(tests)!r})\n"
                      "import models\n\ndef build_model():\n    return models.mlp()\n")
    times, optimizer = measure.compute(2, str(source), "build_model", (4, 16))
    assert sorted(times) == [1, 2] and all(sorted(row) == [4, 16] for row in times.values())
    assert all(0 < t < 1.0 for row in times.values() for t in row.values())
    assert 0 < optimizer < 1e-3
    compute = planner.Compute(times, optimizer)
    # Two busy ranks on this machine's cores: slowed, but not past the share of a core
    # each gets when the cores are fewer than the ranks (factors below 1 are clamped).
    assert 1.0 <= compute.slowdown(8)(2) < 2.5


def test_slowdown_is_the_measured_ratio_and_extrapolates_linearly():
    compute = planner.Compute({1: {8: 0.010, 16: 0.020}, 2: {8: 0.015, 16: 0.024}}, 0.0)
    slow = compute.slowdown(8)
    assert slow(1) == pytest.approx(1.0)
    assert slow(2) == pytest.approx(1.5)
    assert slow(4) == pytest.approx(3.0)  # more ranks than measured: in proportion
    assert compute.slowdown(16)(2) == pytest.approx(1.2)


WIDE_MODEL = """import keras

def build_model():
    inp = keras.Input((256,))
    h = keras.layers.Dense(512, activation="relu")(inp)    # split by columns ...
    h = keras.layers.Dense(256, activation="relu")(h)      # ... and this one by rows
    model = keras.Model(inp, keras.layers.Dense(4)(h))
    model.compile(optimizer="sgd", loss="mse")
    return model
"""


@pytest.mark.mpiexec
def test_stages_with_split_layers_are_timed_under_mpiexec(tmp_path):
    source = tmp_path / "model.py"
    source.write_text(WIDE_MODEL)
    keys = [(0, 3, True, True, 2), (0, 2, False, False, 2), (2, 1, True, False, 2)]
    found = measure.tensor_stages(2, str(source), "build_model", (4, 16), keys, repeats=2)
    assert sorted(found) == sorted(keys) and all(len(v) == 2 for v in found.values())
    # Each batch: forward and backward with both ranks running, then the same alone
    # (here one group of 2 is all the ranks: two timings of the same thing).
    assert all(len(times) == 4 for v in found.values() for times in v)
    assert all(f == f1 == 0.0 and 0 < b < 1.0 and 0 < b1 < 1.0
               for f, b, f1, b1 in found[keys[0]])  # one fused call
    assert all(0 < t < 1.0 for key in keys[1:] for times in found[key] for t in times)


def test_stages_with_split_layers_use_their_timings_exchanges_included():
    graph = G.from_model(models.mlp())
    rows = [(0.0, 1e-3, 1000, 0, 100)] * len(graph.nodes)
    # An exchange would cost a second: none is added to the timed stages.
    slow = planner.Network(0.0, 0.0, exchanges={2: (1.0, 0.0)})
    # Two ranks at once run as fast as one; four (on two cores) take twice as long.
    busy = planner.Compute({1: {8: 0.01, 64: 0.01}, 2: {8: 0.01, 64: 0.01},
                            4: {8: 0.02, 64: 0.02}}, 0.0)
    asked = []

    class Timer:
        splits = True

        def __call__(self, counts, s, m, fused, num_tensor=1):
            asked.append((tuple(counts), s, fused, num_tensor))
            return (0.0, 0.09, 0.0, 0.06)  # fused: 90 ms with all 4 ranks, 60 with 2

    p = planner.predict(graph, rows, 0.0, slow, [5], 64, 2, 1, "1f1b", num_tensor=2,
                        compute=busy, stage_timer=Timer())
    # Both replicas always run it at once: as timed with every rank busy.
    assert asked == [((5,), 0, True, 2)]
    assert p["step_s"] == pytest.approx(0.09)
    # Of 90 and 60 ms, 30 ms are work (doubled with 4 busy) and 30 waits (never slowed):
    # alone in its pipeline, with no replica, the stage takes 60 ms.
    one = planner.predict(graph, rows, 0.0, slow, [5], 64, 1, 1, "1f1b", num_tensor=2,
                          ranks_per_node=4, compute=busy, stage_timer=Timer())
    assert one["step_s"] == pytest.approx(0.06)
    assert costmodel.work_and_wait(0.09, 0.06, busy.slowdown(64), 4, 2) == pytest.approx((0.03, 0.03))
    assert costmodel.work_and_wait(0.05, 0.06, busy.slowdown(64), 4, 2) == (0.0, 0.05)  # noise


@pytest.mark.mpiexec
def test_plan_command_writes_a_plan_fit_accepts(tmp_path, capsys):
    source = tmp_path / "model.py"
    source.write_text("import models\n\ndef build_model():\n    return models.mlp()\n")
    out = tmp_path / "plan.json"
    assert command.main([str(source), "--batch-size", "32", "--ranks", "2", "--latency", "5us",
                         "--bandwidth", "5GB/s", "--output", str(out)]) == 0
    text = capsys.readouterr().out
    assert "samples/s" in text and "wrote" in text
    # What it measures, and how long each part took; the ranking's column is the place.
    assert re.search(r"^profiling \d+ layer calls of .* \.\.\.\n  done in [0-9.]+ s$", text,
                     re.M), text
    assert re.search(r"^ +# +S +T +R +M schedule", text, re.M), text
    plan = json.loads(out.read_text())
    from hyparflow import strategy

    assert plan["format"] == "hyparflow-strategy" and strategy.validate(plan) == []
    stages, tensor, replicas = plan["mesh"]["shape"]
    assert stages * tensor * replicas == 2 and "predicted" in plan
    x, y = models.mlp_data(64)
    run_ranks(2, lambda comm: hf.fit(models.mlp(), x, y, batch_size=32, verbose=0,
                                     plan=str(out), comm=comm))


@pytest.mark.mpiexec
def test_plan_quick_mode_measures_only_a_ping_pong(tmp_path, capsys):
    source = tmp_path / "model.py"
    source.write_text("import models\n\ndef build_model():\n    return models.mlp()\n")
    assert command.main([str(source), "--batch-size", "32", "--ranks", "2", "--quick",
                         "--microbatches", "1", "2", "--top", "2"]) == 0
    text = capsys.readouterr().out
    assert "measuring the network: a ping-pong of 2 ranks under mpiexec ...\n  done in" in text
    for slow in ("rings of", "ranks computing at once", "timing every candidate"):
        assert slow not in text, text
    assert len(re.findall(r"^ +[12] +\d+ +\d+ +\d+ +\d+ ", text, re.M)) == 2, text


@pytest.mark.mpiexec
def test_projection_to_a_cluster(tmp_path, capsys):
    source = tmp_path / "model.py"
    source.write_text("import models\n\ndef build_model():\n    return models.mlp()\n")
    assert command.main([str(source), "--batch-size", "1024", "--nodes", "4", "--ranks-per-node", "2",
                         "--latency", "2us", "--bandwidth", "12.5GB/s", "--top", "3"]) == 0
    assert "(8 ranks)" in capsys.readouterr().out


def test_the_node_shapes_tried_and_a_choice_never_slower_than_one_rank():
    assert node_shapes(16) == [2, 4, 8, 16]
    assert node_shapes(12) == [2, 4, 12]
    assert node_shapes(2) == [2] and node_shapes(1) == []

    def shape(ranks, step, fits=True):
        plan = {"step_s": step, "fits": fits}
        return Candidate(ranks, 16 // ranks, [plan], plan, None, None)

    one = {"step_s": 1.0}   # one rank with all 16 cores
    assert choose([shape(2, 1.2), shape(16, 1.5)], one) is None
    assert choose([shape(2, 1.0)], one) is None
    assert choose([shape(2, 0.9), shape(4, 0.7), shape(16, 0.8)], one).ranks == 4
    assert choose([], one) is None


@pytest.mark.mpiexec
def test_plan_chooses_ranks_and_threads_and_run_takes_them(tmp_path, capsys):
    # A model file and a script of their own: the ranks `hyparflow run` starts import
    # nothing from the tests. Its layers are named: a plan names them, and the script
    # builds the model twice.
    (tmp_path / "model.py").write_text(
        "import keras\n\n"
        "def build_model():\n"
        "    keras.utils.set_random_seed(0)\n"
        "    inp = keras.Input((32,))\n"
        "    h = keras.layers.Dense(64, activation='relu', name='a')(inp)\n"
        "    h = keras.layers.Dense(64, activation='relu', name='b')(h)\n"
        "    model = keras.Model(inp, keras.layers.Dense(4, name='c')(h))\n"
        "    model.compile(optimizer='adam', loss=keras.losses.SparseCategoricalCrossentropy("
        "from_logits=True))\n"
        "    return model\n")
    out = tmp_path / "plan.json"
    # No --ranks on one node measured here: the ranks x threads are chosen.
    assert command.main([str(tmp_path / "model.py"), "--batch-size", "32",
                         "--microbatches", "1", "2", "--schedules", "1f1b", "--top", "3",
                         "--output", str(out)]) == 0
    text = capsys.readouterr().out
    cores = os.cpu_count()
    shapes = dict(re.findall(r"^ +(\d+ x \d+) +S=.*? ([0-9.]+) +[0-9.]+$", text, re.M))
    assert set(shapes) == {f"{n} x {cores // n}" for n in [1] + node_shapes(cores)}, text
    plan = json.loads(out.read_text())
    stages, tensor, replicas = plan["mesh"]["shape"]
    ranks, threads = stages * tensor * replicas, plan["threads_per_rank"]
    assert ranks * threads == cores and f"{ranks} x {threads}" in shapes
    assert (f"chosen: {ranks} ranks x {threads} threads" if ranks > 1 else
            f"chosen: one rank with all {cores} cores") in text
    # Never a plan predicted slower than one rank with all cores.
    assert round(plan["predicted"]["step_s"], 4) <= float(shapes[f"1 x {cores}"])  # as printed
    # `hyparflow run --plan`: the plan's ranks and threads, and the script's hf.fit,
    # which passes no plan=, trains by it to model.fit's weights.
    script = tmp_path / "train.py"
    script.write_text(
        "import numpy as np, tensorflow as tf\n"
        "import hyparflow as hf\n"
        "from model import build_model\n"
        "rng = np.random.default_rng(0)\n"
        "x, y = rng.normal(size=(128, 32)).astype('float32'), rng.integers(0, 4, 128)\n"
        "reference = build_model()\n"
        "reference.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)\n"
        "model = build_model()\n"
        "hf.fit(model, x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)\n"
        "diff = max(float(np.max(np.abs(a - b)))\n"
        "           for a, b in zip(model.get_weights(), reference.get_weights()))\n"
        "if hf.is_main():\n"
        "    print(f'{hf.size()} ranks x {tf.config.threading.get_intra_op_parallelism_threads()}'\n"
        "          f' threads, max weight difference {diff:.2e}', flush=True)\n"
        "assert diff < 1e-5, diff\n")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("HYPARFLOW_NUM_", "HYPARFLOW_THREADS", "SLURM_"))}
    env["HYPARFLOW_INTER_OP_THREADS"] = "1"   # production's (conftest gives thread ranks 16)
    run = subprocess.run([sys.executable, "-m", "hyparflow", "run", "--plan", str(out),
                          str(script)], capture_output=True, text=True, timeout=300,
                         cwd=tmp_path, env=env)
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"{ranks} ranks x {threads} threads, max weight difference" in run.stdout, run.stdout


def test_sums_across_nodes_are_hierarchical_where_the_engine_makes_them_so():
    net = planner.Network(1e-6, 1e-10, 5e-6, 8e-10)
    flat = net.allreduce(32e6, 512, across=True)
    assert flat == pytest.approx(2 * 511 / 512 * 32e6 * 8e-10 + 2 * 511 * 5e-6)
    # 128 nodes of 4: the node's sum (within), then a ring of the 128 nodes whose link
    # carries the whole buffer's 2 (N-1)/N, in 2 x 127 rounds instead of 2 x 511.
    tiered = net.allreduce(32e6, 512, across=True, per_node=4)
    assert tiered == pytest.approx(net.allreduce(32e6, 4)
                                   + 2 * 127 / 128 * 32e6 * 8e-10 + 2 * 127 * 5e-6)
    # Its gain is the rounds: where they dominate (1 MB), it is the faster.
    assert net.allreduce(1e6, 512, True, 4) < 0.6 * net.allreduce(1e6, 512, True)
    # Two per node too (engine/shm.py: across nodes only slices cross); one per node
    # is the flat ring.
    assert net.allreduce(32e6, 512, across=True, per_node=2) == pytest.approx(
        net.allreduce(32e6, 2) + 2 * 255 / 256 * 32e6 * 8e-10 + 2 * 255 * 5e-6)
    assert net.allreduce(32e6, 512, across=True, per_node=1) == flat
    # A plan's replicas per node: ranks per node // (S x T).
    graph = G.from_model(models.mlp())
    rows = [(0.0, 1e-6, 4 * n.params, 0, 1024) for n in graph.nodes]
    one = dict(ranks_per_node=8, cores=8)
    spread = planner.predict(graph, rows, 0.0, net, [len(graph.nodes)], 512, 32, 1, "1f1b",
                             **one)
    assert spread["comm_s"] == pytest.approx(net.allreduce(
        4 * sum(n.params for n in graph.nodes), 32, True, 8))


def test_cost_model_knows_the_tensor_axis():
    import keras

    inp = keras.Input((256,))
    x = keras.layers.Dense(512, activation="relu")(inp)
    x = keras.layers.Dense(512, activation="relu")(x)
    model = keras.Model(inp, keras.layers.Dense(4)(x))
    graph = G.from_model(model)
    rows = [(0.0, 1e-4 * n.params / 1e5, 4 * n.params, 8 * n.params, 4096) for n in graph.nodes]
    free = planner.Network(0.0, 0.0)
    one = planner.predict(graph, rows, 0.0, free, [3], 64, 1, 1, "1f1b")
    split = planner.predict(graph, rows, 0.0, free, [3], 64, 1, 1, "1f1b", num_tensor=2)
    # The two big Dense layers are split: their compute and state are halved.
    assert len(split["tensor_layers"]) == 2
    assert split["step_s"] < 0.7 * one["step_s"]
    assert max(split["memory_bytes"]) < 0.6 * max(one["memory_bytes"])
    # A slow network makes the exchanges cost.
    slow = planner.predict(graph, rows, 0.0, planner.Network(1e-3, 1e-9), [3], 64, 1, 1,
                           "1f1b", num_tensor=2)
    assert slow["step_s"] > split["step_s"] and slow["comm_s"] > 0
    plans = planner.search(graph, rows, 0.0, free, 64, 4)
    assert {(p["stages"], p["tensor"], p["replicas"]) for p in plans} >= {
        (1, 2, 2), (1, 4, 1), (2, 2, 1), (1, 1, 4)}
    # Tensor ranks on two hosts exchange over the link between them, ranks within a
    # host over its own.
    hosts = planner.Network(1e-6, 1e-10, 1e-4, 1e-8)
    within = planner.predict(graph, rows, 0.0, hosts, [3], 64, 1, 1, "1f1b", num_tensor=2,
                             ranks_per_node=2)
    spread = planner.predict(graph, rows, 0.0, hosts, [3], 64, 1, 1, "1f1b", num_tensor=2,
                             ranks_per_node=1)
    assert spread["comm_s"] > 10 * within["comm_s"] > 0


def test_profiles_are_taken_at_batches_that_fit_in_memory():
    # The plans' smallest and largest microbatch ...
    assert command.profile_batches(256, 4, [1, 4]) == (16, 256)
    # ... but no larger than an eighth of the memory holds in activations
    # (ResNet-1001 at batch 64 needs more than this machine's 24 GB).
    lo, hi = command.profile_batches(64, 4, [1, 8], per_sample=200e6, memory=24e9)
    assert hi == 15 and 1 <= lo < hi


@pytest.mark.parametrize("build,counts", [(models.mlp, [2, 1, 2]), (models.skip_cnn, [2, 3, 2])])
def test_stages_are_timed_whole_as_they_run(build, counts):
    model = build()
    graph = G.from_model(model)
    counts = counts[:-1] + [len(graph.nodes) - sum(counts[:-1])]
    timer = measure.StageTimer(graph, model, (8, 32), repeats=2)
    for s in range(len(counts)):
        small, large = timer(counts, s, 8, False), timer(counts, s, 32, False)
        # A backward is the whole call less its forward: on a busy host and a tiny
        # stage it can come out as nothing, never as a second.
        assert all(0 <= t < 1.0 for t in small + large) and small[0] > 0 and large[0] > 0
        middle = timer(counts, s, 20, False)  # between the two: interpolated
        assert min(small[0], large[0]) <= middle[0] <= max(small[0], large[0])
    forward, backward = timer(counts, len(counts) - 1, 16, True)  # one fused call
    assert forward == 0.0 and 0 < backward < 1.0
    assert len(timer._cache) == len(counts) + 1  # each stage timed once per kind


def test_timed_stages_replace_the_profiles_of_a_pipeline():
    graph = G.from_model(models.mlp())
    rows = [(0.0, 1e-3, 1000, 0, 100)] * len(graph.nodes)
    free = planner.Network(0.0, 0.0)

    def timer(counts, s, m, fused):
        return (0.0, 0.03) if fused else (0.01, 0.02)

    # Stage 0: 10 ms forward, 20 ms backward; the last stage's fused 30 ms counted a
    # third forward: one microbatch goes 10 + 10 + 20 + 20 ms.
    two = planner.predict(graph, rows, 0.0, free, [2, 3], 64, 1, 1, "1f1b", stage_timer=timer)
    assert two["step_s"] == pytest.approx(0.06)
    # One stage is timed too: its fused call, not its calls' profiles (5 * 64 ms).
    one = planner.predict(graph, rows, 0.0, free, [5], 64, 1, 1, "1f1b", stage_timer=timer)
    assert one["step_s"] == pytest.approx(0.03)
    # Split layers without a timer that knows them: the profiles still.
    split = planner.predict(graph, rows, 0.0, free, [5], 64, 1, 1, "1f1b", num_tensor=2,
                            stage_timer=timer)
    assert split["step_s"] > 0.1


def test_pipeline_boundaries_that_cross_hosts_pay_the_link_between_hosts():
    """2 hosts of 2 ranks, a link between hosts 100x slower than within: a 4-stage
    pipeline (its middle boundary crosses hosts) pays the slow link at every microbatch,
    2 stages x 2 replicas keep the boundaries within a host (only the small gradient sums
    cross), and the search ranks the latter first for a model of wide activations."""
    graph = G.from_model(models.mlp())
    rows = [(0.0, 1e-4, 10, 0, 100)] * len(graph.nodes)   # tiny weights, wide activations
    near = planner.Network(1e-6, 1e-10)
    split = planner.Network(1e-6, 1e-10, 1e-4, 1e-8)      # 10 GB/s within, 100 MB/s across
    counts = [1, 1, 1, 2]
    long_near = planner.predict(graph, rows, 0.0, near, counts, 4096, 1, 4, "1f1b",
                                ranks_per_node=2)
    long_split = planner.predict(graph, rows, 0.0, split, counts, 4096, 1, 4, "1f1b",
                                 ranks_per_node=2)
    assert long_split["comm_s"] > 10 * long_near["comm_s"]
    short_near = planner.predict(graph, rows, 0.0, near, [2, 3], 4096, 2, 4, "1f1b",
                                 ranks_per_node=2)
    short_split = planner.predict(graph, rows, 0.0, split, [2, 3], 4096, 2, 4, "1f1b",
                                  ranks_per_node=2)
    # Only the gradient sums (a few hundred bytes) cross: the pipeline's own messages not.
    assert short_split["comm_s"] - short_near["comm_s"] < 0.05 * (long_split["comm_s"]
                                                                  - long_near["comm_s"])
    assert costmodel.crosses(1, 2, 4, 1, 1, 2) and not costmodel.crosses(0, 1, 4, 1, 1, 2)
    assert not costmodel.crosses(0, 1, 2, 2, 1, 2)
    best = planner.search(graph, rows, 0.0, split, 4096, 4, microbatches=(4,),
                          schedules=("1f1b",), ranks_per_node=2, tensor=(1,))[0]
    assert best["stages"] <= 2, best     # no pipeline spans the two hosts


def test_cost_model_knows_the_split_schedules():
    """The planner plays zb-h1 / zb-batched with W's share of the backward taken from the
    deferred Dense calls' profiles: less bubble than 1F1B, and the batched W pays each
    call's fixed cost once. zb-batched's kept rows cost memory."""
    graph = G.from_model(models.mlp())
    # Every call: 2 ms fixed (what small products lose), 1 ms per sample.
    rows = [(2e-3, 1e-3, 1000, 0, 100)] * len(graph.nodes)
    free = planner.Network(0.0, 0.0)
    p = {name: planner.predict(graph, rows, 0.0, free, [2, 3], 64, 1, 8, name)
         for name in ("1f1b", "zb-h1", "zb-batched")}
    assert p["zb-h1"]["bubble"] < p["1f1b"]["bubble"]
    assert p["zb-batched"]["step_s"] < p["zb-h1"]["step_s"] < p["1f1b"]["step_s"]
    assert p["zb-batched"]["memory_bytes"][0] > p["1f1b"]["memory_bytes"][0]
    # GPipe with one microbatch fuses the last stage's F and B, as the executor does.
    assert planner.fuses(1, 2, "gpipe", 1) and not planner.fuses(1, 2, "gpipe", 2)
    assert planner.fuses(1, 2, "1f1b", 4) and not planner.fuses(0, 2, "1f1b", 4)
