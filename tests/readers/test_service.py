"""A tf.data service decodes the replicas' parts (hf.fit(..., data_service=...)): a
dispatcher and two workers started in this process, the ranks as threads. In exact
mode each replica's part is one worker's whole stream, so the weights are those of
reading in place (model.fit on the replicas' batches put together) and each record is
decoded once an epoch; in dynamic mode the workers split the files, each read at most
once; a dispatcher that cannot be reached is named within 30 s."""

import os
import re
import socket
import time

import numpy as np
import pytest
import tensorflow as tf

import hyparflow as hf
from conftest import max_diff, train_ranks
from hyparflow.engine.local import run_ranks
import records
from test_sharded import B, EPOCHS, by_files, dealt, model, want

pytestmark = pytest.mark.timeout(600)
JOURNAL = None


def jobs():
    """The names of the jobs hyparflow asked the dispatcher for: {(run, replica, epoch)}."""
    found = set()
    for root, _, files in os.walk(JOURNAL):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                found |= set(re.findall(rb"hyparflow-(\w{12})-r(\d+)-e(\d+)-p\d+", f.read()))
    return {(run.decode(), int(r), int(e)) for run, r, e in found}


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    """A dispatcher and two workers in this process (the workers run the pipelines'
    counting numpy_functions here, so decodes are counted as in place). The
    dispatcher keeps a journal, where the jobs' names can be read."""
    global JOURNAL
    JOURNAL = str(tmp_path_factory.mktemp("dispatcher"))
    dispatcher = tf.data.experimental.service.DispatchServer(
        tf.data.experimental.service.DispatcherConfig(work_dir=JOURNAL,
                                                      fault_tolerant_mode=True))
    address = dispatcher.target.split("://")[1]
    workers = [tf.data.experimental.service.WorkerServer(
        tf.data.experimental.service.WorkerConfig(dispatcher_address=address))
        for _ in range(2)]
    yield dispatcher.target
    # Stopped on a thread, waited for a bounded time: a worker's stop once took 84 s
    # (under load, after the other tests), and the servers end with the process anyway.
    import threading

    stopping = threading.Thread(target=lambda: [s._stop() for s in workers + [dispatcher]],
                                daemon=True)
    stopping.start()
    stopping.join(20)


@pytest.mark.parametrize("stages,replicas,micro", [(1, 2, 1), (2, 2, 2)])
def test_exact_mode_trains_to_reading_in_place(stages, replicas, micro, service, tmp_path):
    paths = records.write(tmp_path, files=4)
    start = model().get_weights()
    expect = want(records.global_batches(records.replica_batches(paths, B, replicas)), start)
    records.DECODED.clear()
    before = jobs()
    out = train_ranks(model, by_files(paths), None, num_stages=stages, num_replicas=replicas,
                      num_microbatches=micro, weights=start, epochs=EPOCHS, batch_size=B,
                      data_service=service)
    assert max(max_diff(w, expect) for w, _ in out) < 2e-6
    assert np.bincount(records.DECODED, minlength=4 * 24).tolist() == [EPOCHS] * (4 * 24)
    # Read from the service: a job per replica and epoch, named by one run id.
    new = jobs() - before
    assert len({run for run, _, _ in new}) == 1
    assert {(r, e) for _, r, e in new} == {(r, e) for r in range(replicas) for e in range(EPOCHS)}


def test_a_dataset_of_files_dealt_to_the_replicas_through_the_service(service, tmp_path):
    paths = records.write(tmp_path, files=4)
    start = model().get_weights()
    expect = want(records.global_batches(dealt(paths, 2)), start)
    records.DECODED.clear()
    out = train_ranks(model, records.pipeline(paths, B), None, num_stages=1, num_replicas=2,
                      num_microbatches=1, weights=start, epochs=EPOCHS, data_service=service)
    assert max(max_diff(w, expect) for w, _ in out) < 2e-6
    assert np.bincount(records.DECODED, minlength=4 * 24).tolist() == [EPOCHS] * (4 * 24)


def test_a_dataset_rank_0_reads_whole_comes_from_the_service(service, tmp_path):
    """One file for two replicas: rank 0 reads the whole dataset, as model.fit's."""
    paths = records.write(tmp_path, files=1)
    start = model().get_weights()
    expect = want(list(records.pipeline(paths, B).as_numpy_iterator()), start)
    records.DECODED.clear()
    out = train_ranks(model, records.pipeline(paths, B), None, num_stages=1, num_replicas=2,
                      num_microbatches=1, weights=start, epochs=EPOCHS, data_service=service)
    assert max(max_diff(w, expect) for w, _ in out) < 2e-6
    assert np.bincount(records.DECODED, minlength=24).tolist() == [EPOCHS] * 24


def test_dynamic_mode_trains_and_reads_each_record_at_most_once(service, tmp_path):
    paths = records.write(tmp_path, files=4)
    start = model().get_weights()
    records.DECODED.clear()
    out = train_ranks(model, by_files(paths), None, num_stages=1, num_replicas=2,
                      num_microbatches=1, weights=start, epochs=EPOCHS, batch_size=B,
                      data_service=service, data_service_mode="dynamic")
    weights, history = out[0]
    assert all(max_diff(w, weights) == 0 for w, _ in out)   # the replicas agree
    assert max_diff(weights, start) > 1e-3 and np.isfinite(history["loss"]).all()
    counts = np.bincount(records.DECODED, minlength=4 * 24)
    assert counts.max() <= EPOCHS
    # No worker was lost: every file was read, once an epoch.
    assert counts.tolist() == [EPOCHS] * (4 * 24)


def _closed_port():
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def test_an_unreachable_dispatcher_is_named_within_30_seconds(tmp_path, monkeypatch):
    paths = records.write(tmp_path, files=4)
    address = f"grpc://localhost:{_closed_port()}"
    monkeypatch.setenv("HYPARFLOW_DATA_SERVICE", address)
    begun = time.monotonic()
    with pytest.raises(ValueError, match=f"dispatcher at {address} cannot be reached"):
        train_ranks(model, by_files(paths), None, num_stages=1, num_replicas=2,
                    num_microbatches=1, weights=model().get_weights(), batch_size=B)
    assert time.monotonic() - begun < 30


def test_bad_addresses_and_modes_are_refused(tmp_path):
    paths = records.write(tmp_path, files=2)
    for kwargs, message in [(dict(data_service="http://x:1"), "grpc://HOST:PORT"),
                            (dict(data_service="localhost:1", data_service_mode="static"),
                             "data_service_mode must be one of")]:
        with pytest.raises(ValueError, match=message):
            train_ranks(model, by_files(paths), None, num_stages=1, num_replicas=2,
                        num_microbatches=1, weights=model().get_weights(), batch_size=B,
                        **kwargs)


@pytest.mark.parametrize("mode", ["exact", "dynamic"])
def test_a_lost_worker_ends_every_rank_naming_the_service(mode, tmp_path, monkeypatch):
    """The one worker, a process of its own, killed after the first steps: TensorFlow's
    reader would wait for its task without end; every rank ends naming the service."""
    import keras

    paths = records.write(tmp_path, files=4)
    dispatcher = tf.data.experimental.service.DispatchServer(
        tf.data.experimental.service.DispatcherConfig(worker_timeout_ms=1000))
    worker, _ = records.data_service("--worker", dispatcher.target, "--host", "localhost")
    monkeypatch.setenv("HYPARFLOW_DATA_SERVICE_TIMEOUT", "5")
    killed = []

    class Kill(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 1:   # the worker served the first steps
                worker.kill()
                killed.append(batch)

    begun = time.monotonic()
    try:
        with pytest.raises((ValueError, RuntimeError),
                           match=f"No batch of replica \\d's part .* came from the tf.data "
                                 f"service at {dispatcher.target} \\({mode} mode\\) in 5 s"):
            train_ranks(model, records.by_files_uncounted(paths), None, num_stages=1,
                        num_replicas=2, num_microbatches=1, weights=model().get_weights(),
                        batch_size=B, epochs=3, data_service=dispatcher.target,
                        data_service_mode=mode, callbacks=[Kill()])
        assert killed and time.monotonic() - begun < 60
    finally:
        worker.kill()
        worker.wait()
        dispatcher._stop()


def test_the_processes_print_their_address_and_stop_cleanly_on_sigterm():
    """`hyparflow data-service`: one line with the address, then SIGTERM / SIGINT stop
    it with exit code 0, no process left behind."""
    import signal

    dispatcher, address = records.data_service("--dispatcher", "--host", "localhost")
    worker, where = records.data_service("--worker", address, "--host", "localhost")
    try:
        assert address.startswith("grpc://localhost:") and where.startswith("localhost:")
        got = tf.data.Dataset.range(6).apply(tf.data.experimental.service.distribute(
            "parallel_epochs", address)).as_numpy_iterator()
        assert sorted(got) == list(range(6))   # the worker serves
        for process, signum in ((worker, signal.SIGINT), (dispatcher, signal.SIGTERM)):
            process.send_signal(signum)
            out, _ = process.communicate(timeout=30)
            assert process.returncode == 0 and out.strip().endswith(": stopped")
    finally:
        for process in (worker, dispatcher):
            process.kill()
            process.wait()


def test_validation_data_is_read_from_the_service_too(service, tmp_path):
    """fit's validation data (a dataset function) through the service, as jobs of a run
    id of its own: its loss is model.evaluate's on the validation set."""
    (tmp_path / "train").mkdir()
    (tmp_path / "val").mkdir()
    paths = records.write(tmp_path / "train", files=4)
    held = records.write(tmp_path / "val", files=2, seed=1)
    start = model().get_weights()
    expect = want(records.global_batches(records.replica_batches(paths, B, 2)), start)
    before = jobs()
    out = train_ranks(model, by_files(paths), None, num_stages=1, num_replicas=2,
                      num_microbatches=1, weights=start, epochs=EPOCHS, batch_size=B,
                      data_service=service, validation_data=by_files(held))
    weights, history = out[0]
    assert max_diff(weights, expect) < 2e-6
    x, y, w = (np.concatenate([b[k] for b in records.pipeline(held, 48).as_numpy_iterator()])
               for k in range(3))
    plain = model()
    plain.set_weights(weights)
    loss = plain.evaluate(x, y, sample_weight=w, batch_size=len(x), verbose=0)[0]
    assert np.isclose(history["val_loss"][-1], loss, rtol=1e-5)
    assert len({run for run, _, _ in jobs() - before}) == 2   # training's and validation's


def test_evaluate_and_predict_read_from_the_service(service, tmp_path):
    """hf.evaluate (a dataset function, each replica's part) and hf.predict (a dataset,
    in order) decoded by the service's workers: model.evaluate's loss and metrics,
    model.predict's outputs in the dataset's order."""
    paths = records.write(tmp_path, files=4)
    plain = model()
    x, y, w = (np.concatenate([b[k] for b in records.pipeline(paths, 48).as_numpy_iterator()])
               for k in range(3))
    want_eval = plain.evaluate(x, y, sample_weight=w, batch_size=len(x), verbose=0)
    want_pred = plain.predict(x, batch_size=B, verbose=0)
    weights = plain.get_weights()
    before = jobs()

    def body(comm):
        m = model()
        m.set_weights(weights)
        got = hf.evaluate(m, by_files(paths), batch_size=B, num_replicas=2, comm=comm,
                          verbose=0, data_service=service)
        out = hf.predict(m, records.pipeline(paths, B), num_replicas=2, comm=comm,
                         verbose=0, data_service=service)
        return got, out

    for got, out in run_ranks(2, body, timeout=300):
        assert np.allclose(got, want_eval, rtol=1e-5), (got, want_eval)
        assert np.allclose(out, want_pred, atol=1e-6)
    # evaluate's run id (predict's whole dataset is an anonymous job of its own)
    assert len({run for run, _, _ in jobs() - before}) == 1
