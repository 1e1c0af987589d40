"""Shared helpers: models, data and a way to run hyparflow ranks as threads."""

import contextlib
import os
import sys

# The wings (engine, kinds, loop, planning, cluster, sweeps, mpi, hosts, house) mirror
# the package. The builders every wing shares are here and in models.py, zoo.py and
# sweep_models.py; a file may also import another's builders by the file's name (the
# mpiexec files in mpi/ train the models of the files they check), so every wing is
# on the path, after this directory (test file names are unique across wings).
TESTS = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [TESTS] if TESTS not in sys.path else []
sys.path += [os.path.join(TESTS, d) for d in sorted(os.listdir(TESTS))
             if os.path.isdir(os.path.join(TESTS, d)) and not d.startswith(("_", "."))]

# Every process a test starts leaves out what Keras imports only because it is
# installed (tests/_lean/sitecustomize.py): 2 s of a core per rank.
LEAN = os.path.join(TESTS, "_lean")
if LEAN not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [LEAN, os.environ.get("PYTHONPATH")]))

os.environ.setdefault("HYPARFLOW_TIMEOUT", "120")
# Thread-ranks wait for each other inside compiled functions (tensor parallelism):
# each needs an inter-op thread of its own (9: the 3x3 mesh's ranks; with 8, the ninth
# rank's exchange never ran and the others timed out waiting for it), and a mesh
# rank's backward can have two independent exchanges waiting at once (8 threads
# for 8 mesh ranks ran out under S=2 x 2x2 with recompute: tests/kinds/test_mesh_compose.py).
os.environ.setdefault("HYPARFLOW_INTER_OP_THREADS", "16")

import hyparflow  # noqa: E402,F401  (quiet TensorFlow first)
import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

from hyparflow.engine.local import run_ranks  # noqa: E402

# Each thread-rank traces its own stage function; TF counts them all as retraces.
tf.get_logger().setLevel("ERROR")


def _take_turns():
    """Thread-ranks share classes, processes under mpiexec do not. Keras's
    `Model.__init__` rewrites the `__bases__` of a functional-style Model subclass on
    every construction, and Keras Hub's `PipelineModel.__init__` first resets its own
    to `(keras.Model,)`: thread-ranks building Keras Hub tasks at once meet a
    half-rewritten hierarchy ("a __bases__ item causes an inheritance cycle",
    "super(type, obj): obj must be an instance or subtype of type"). Rewrites take
    turns, and the reset is skipped for functional construction (the only kind these
    tests use): once `Functional` is in, construction goes straight to its `__init__`
    and rewrites nothing."""
    import threading

    from keras.src.models import model as keras_model

    inject, lock = keras_model.inject_functional_model_class, threading.RLock()

    def locked(cls):
        with lock:
            return inject(cls)

    keras_model.inject_functional_model_class = locked
    try:
        from keras_hub.src.utils.pipeline_model import PipelineModel
    except ImportError:
        return

    def init(self, *args, **kwargs):
        with lock:
            if not keras_model.functional_init_arguments(args, kwargs):
                PipelineModel.__bases__ = (keras_model.Model,)
        # Functional once injected (its __init__, as for Keras Hub's Backbone), else
        # Model's, which injects it.
        super(PipelineModel, self).__init__(*args, **kwargs)

    PipelineModel.__init__ = init


_take_turns()


# The quick tier (`pytest -m quick`, README): each wing's contract in process, in a few
# minutes on two cores. Node ids below the tests directory, a parametrisation's start
# enough to pick it; every entry must pick a test.
QUICK = [
    "readers/test_inputs.py::test_input_form_trains_to_model_fit[2-1-2-pydataset]",
    "readers/test_sharded.py::test_dataset_function_trains_to_model_fit_on_the_replicas_batches[4-1-2-1]",
    "readers/test_dtypes.py::test_string_columns_train_to_model_fit[2-1-2-tf.string]",
    "engine/test_equivalence.py::test_mlp[adam",
    "engine/test_equivalence.py::test_two_inputs_two_outputs",
    "engine/test_equivalence.py::test_sample_and_class_weight",
    "engine/test_graph.py",
    "engine/test_schedule.py",
    "engine/test_masks.py::test_a_mask_read_by_attention_on_one_stage_and_later_layers_on_another",
    "engine/test_sparse.py::test_embedding_with_stateful_optimizers[adam]",
    "engine/test_checkpoint.py::test_resume_mid_epoch_equals_an_uninterrupted_run",
    "engine/test_order.py::test_split_layers_collectives_form_one_chain_forward_and_backward",
    "engine/test_zero_bubble.py::test_deferred_kernels_are_the_plain_dense_calls_read_once",
    "engine/test_wire.py::test_sum_both_ways",
    "engine/test_norms.py::test_fused_batchnorm_trains_to_model_fits_weights[1-2-2]",
    "kinds/test_tensor.py::test_dense_uneven_shares_adam",
    "kinds/test_tensor.py::test_embedding_row_split_keeps_sparse_pairs_for_adam",
    "kinds/test_mesh.py::test_mlp_on_a_2x2_mesh_trains_as_model_fit[adam]",
    "kinds/test_zero.py::test_sharded_step_matches_model_fit[adam]",
    "kinds/test_tables.py::test_bad_input_is_named",
    "kinds/test_tables.py::test_table_row_placement",
    "kinds/test_attention_split.py::test_encoder_uneven_heads_adam",
    "loop/test_keras_loop.py::test_evaluate_and_predict_match_keras[config1]",
    "loop/test_keras_loop.py::test_tf_data_input_equals_numpy_input",
    "loop/test_loss_contract.py::test_masked_loss_over_microbatches_and_replicas",
    "loop/test_optimizer_contract.py::test_global_clipnorm_over_stages_and_replicas",
    "loop/test_errors.py::test_world_size_not_stages_times_replicas",
    "loop/test_errors.py::test_a_mistyped_keyword_is_told_what_it_meant",
    "planning/test_balance.py",
    "planning/test_planner.py::test_cost_model_behaves_like_a_pipeline",
    "planning/test_strategy.py::test_a_bad_file_is_named_field_by_field",
    "cluster/test_cli.py::test_run_dry_run_local",
    "cluster/test_cli.py::test_run_bad_counts",
    "cluster/test_restart.py::test_reshape_drops_replicas_then_stages_then_tensor",
    "cluster/test_restart.py::test_a_plan_file_follows_a_restart_on_fewer_ranks",
    "sweeps/test_sweep.py::test_every_member_trains_as_its_own_fit[mlp-3]",
    "house/test_imports.py::test_imports_point_down_the_wings",
    "house/test_imports.py::test_every_module_is_under_500_lines",
    "house/test_settings.py",
]


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    picked = {entry: 0 for entry in QUICK}
    for item in items:
        nodeid = item.nodeid.split("tests/", 1)[-1]
        for entry in QUICK:
            if nodeid.startswith(entry):
                item.add_marker(pytest.mark.quick)
                picked[entry] += 1
    # Only a run over the whole directory sees every entry's file.
    if config.getoption("markexpr") == "quick" and len({i.path.parent for i in items}) > 8:
        missing = [entry for entry, n in picked.items() if not n]
        if missing:
            raise pytest.UsageError(f"tests/conftest.py QUICK picks no test: {missing}")


@contextlib.contextmanager
def float64():
    """Layers built inside take float64 weights. Keras keeps the dtype policy it
    first makes from floatx (after a `clear_session`, at the next layer built), so
    both are set and both restored: restoring floatx alone left every later test's
    models float64."""
    keras.config.set_floatx("float64")
    keras.config.set_dtype_policy("float64")
    try:
        yield
    finally:
        keras.config.set_floatx("float32")
        keras.config.set_dtype_policy("float32")


@pytest.fixture(autouse=True)
def _float32_after():
    """A test that leaves float64 behind fails here, not in an unrelated test later."""
    yield
    policy = keras.config.dtype_policy().name
    if keras.config.floatx() != "float32" or policy != "float32":
        keras.config.set_floatx("float32")
        keras.config.set_dtype_policy("float32")
        pytest.fail(f"the test left floatx/dtype policy at {policy}; use conftest.float64()")


def max_diff(a, b):
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in zip(a, b))


def reference(build, x, y, *, epochs=3, batch_size=16, **fit_kwargs):
    """Plain Keras on one process, what every layout must reproduce: the weights
    before and after `model.fit(x, y, ...)` (no shuffling) and its history."""
    model = build()
    start = model.get_weights()
    history = model.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0,
                        **fit_kwargs)
    return start, model.get_weights(), history.history


def train_ranks(build, x, y, *, num_stages, num_replicas, num_microbatches, weights,
                **kwargs):
    """Run hf.fit on S*T*R thread-ranks (T: `num_tensor`, default 1), each with its own
    copy of the model starting from `weights`; return [(weights, history) per rank]."""

    def body(comm):
        model = build()
        model.set_weights(weights)
        history = hyparflow.fit(model, x, y, num_stages=num_stages, num_replicas=num_replicas,
                                num_microbatches=num_microbatches, comm=comm, verbose=0,
                                **kwargs)
        return model.get_weights(), history.history

    ranks = (num_stages or 1) * (num_replicas or 1) * kwargs.get("num_tensor", 1)
    return run_ranks(ranks, body, timeout=300)


def check_resumes(build, x, y, checkpoint_dir, runs, *, batch_size, ranks=2, tol=1e-5):
    """Train on `ranks` thread-ranks, resume, compare: each of `runs`, `(epochs,
    fit_kwargs)`, is an `hf.fit(..., epochs=epochs, checkpoint_dir=checkpoint_dir,
    **fit_kwargs)` (pass `resume=True` for the runs that resume), all starting from the
    same initial weights; the last run's weights on every rank must be plain Keras's
    `model.fit` for the last run's epochs, to `tol`. Returns them."""
    model = build()
    start = model.get_weights()
    model.fit(x, y, batch_size=batch_size, epochs=runs[-1][0], shuffle=False, verbose=0)
    want = model.get_weights()

    def fit(epochs, kwargs):
        def body(comm):
            model = build()
            model.set_weights(start)
            hyparflow.fit(model, x, y, batch_size=batch_size, epochs=epochs, shuffle=False,
                          verbose=0, comm=comm, checkpoint_dir=str(checkpoint_dir), **kwargs)
            return model.get_weights()

        return run_ranks(ranks, body, timeout=300)

    for epochs, kwargs in runs:
        final = fit(epochs, kwargs)
    assert max(max_diff(w, want) for w in final) <= tol
    return final


@pytest.fixture
def run_ranks_fixture():
    return run_ranks


def sbatch_wait(job_file, env, cwd, timeout):
    """`sbatch job_file` and wait for the job to end; returns (job's exit code, sbatch's
    output). Not `sbatch --wait`: it polls after 2, 10 and 42 s, which kept a job
    that ended after 11 s waiting until 42."""
    import subprocess
    import time

    submitted = subprocess.run(["sbatch", "--parsable", str(job_file)], capture_output=True,
                               text=True, timeout=30, env=env, cwd=cwd)
    said = submitted.stdout + submitted.stderr
    if submitted.returncode:
        return submitted.returncode, said
    job = submitted.stdout.strip().split(";")[0]
    deadline = time.monotonic() + timeout
    try:
        while True:
            shown = subprocess.run(["scontrol", "-o", "show", "job", job], capture_output=True,
                                   text=True, timeout=30, env=env).stdout
            fields = dict(w.split("=", 1) for w in shown.split() if "=" in w)
            state = fields.get("JobState", "")
            if state and state not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING",
                                       "REQUEUED", "RESIZING", "SUSPENDED"):
                code, sig = (int(v) for v in fields.get("ExitCode", "1:0").split(":"))
                return (code or (128 + sig if sig else 0) or int(state != "COMPLETED")), said
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(["sbatch", str(job_file)], timeout)
            time.sleep(0.5)
    except BaseException:
        subprocess.run(["scancel", job], env=env, timeout=30)
        raise
