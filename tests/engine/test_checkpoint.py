"""Checkpoints: resume equals an uninterrupted run, re-shape, bad checkpoints, safety."""

import json
import os

import keras
import numpy as np
import pytest

import hyparflow as hf
import models
from conftest import max_diff
from hyparflow.engine import checkpoint as C
from hyparflow.engine.local import run_ranks


def fit_ranks(stages, replicas, start, x, y, **kwargs):
    def body(comm):
        model = models.mlp("adam")
        model.set_weights(start)
        history = hf.fit(model, x, y, num_stages=stages, num_replicas=replicas, comm=comm,
                         verbose=0, batch_size=16, seed=3, **kwargs)
        return model.get_weights(), history.history

    return run_ranks(stages * replicas, body, timeout=300)


@pytest.fixture
def setting():
    x, y = models.mlp_data(96)
    return models.mlp("adam").get_weights(), x, y


def test_resume_mid_epoch_equals_an_uninterrupted_run(tmp_path, setting):
    start, x, y = setting
    whole = fit_ranks(2, 2, start, x, y, epochs=3, num_microbatches=2,
                      checkpoint_dir=str(tmp_path / "a"), checkpoint_every=4)[0][0]

    class Crash(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if self.model.optimizer.iterations.numpy() == 10:
                raise KeyboardInterrupt("simulated crash after step 10")

    with pytest.raises(KeyboardInterrupt):
        fit_ranks(2, 2, start, x, y, epochs=3, num_microbatches=2, callbacks=[Crash()],
                  checkpoint_dir=str(tmp_path / "b"), checkpoint_every=4)
    latest = C.latest_valid(str(tmp_path / "b"))[1]
    assert latest["global_step"] == 8  # the crash lost at most checkpoint_every steps
    resumed = fit_ranks(2, 2, start, x, y, epochs=3, num_microbatches=2,
                        checkpoint_dir=str(tmp_path / "b"), checkpoint_every=4, resume=True)
    assert max_diff(resumed[0][0], whole) == 0.0  # bit-exact: same ops, same order


def test_resume_runs_the_products_the_run_chose(tmp_path, setting, monkeypatch):
    """Which Dense layers keep W^T is timed, and the two products round differently:
    a resume whose own timing would choose otherwise still trains to the same bits."""
    from hyparflow.engine import kernels
    start, x, y = setting
    monkeypatch.setattr(kernels, "_PAYS", {})
    monkeypatch.setattr(kernels, "_measure", lambda kernel, rows, uses: True)
    whole = fit_ranks(2, 2, start, x, y, epochs=2, num_microbatches=2,
                      checkpoint_dir=str(tmp_path / "a"), checkpoint_every=3)[0][0]
    fit_ranks(2, 2, start, x, y, epochs=1, num_microbatches=2,
              checkpoint_dir=str(tmp_path / "b"), checkpoint_every=3)
    monkeypatch.setattr(kernels, "_PAYS", {})
    monkeypatch.setattr(kernels, "_measure", lambda kernel, rows, uses: False)
    resumed = fit_ranks(2, 2, start, x, y, epochs=2, num_microbatches=2,
                        checkpoint_dir=str(tmp_path / "b"), checkpoint_every=3, resume=True)
    manifest = C.read(C.latest_valid(str(tmp_path / "b"))[0])
    assert manifest["choices"]["transposed"] and all(manifest["choices"]["transposed"].values())
    assert max_diff(resumed[0][0], whole) == 0.0
    # A fresh run that times otherwise rounds otherwise where this CPU's two products
    # round apart (they do with AVX-512, not on every CPU): the check above can fail.
    if _products_round_apart(start, rows=4):
        fresh = fit_ranks(2, 2, start, x, y, epochs=2, num_microbatches=2)[0][0]
        assert max_diff(fresh, whole) > 0.0


def _products_round_apart(weights, rows):
    """Whether `dy @ W^T` folded into the product and through a kept transpose give
    different bits here, for any of the model's kernels."""
    import tensorflow as tf
    rng = np.random.default_rng(0)
    for w in (w for w in weights if w.ndim == 2):
        dy = tf.constant(rng.normal(size=(rows, w.shape[1])).astype("float32"))
        folded = tf.matmul(dy, tf.constant(w), transpose_b=True)
        kept = tf.matmul(dy, tf.constant(np.ascontiguousarray(w.T)))
        if not np.array_equal(folded.numpy(), kept.numpy()):
            return True
    return False


def test_resume_keeps_the_schedule_auto_chose(tmp_path, setting, monkeypatch):
    from hyparflow.engine import executor as ex
    start, x, y = setting
    d = str(tmp_path)
    fit_ranks(2, 1, start, x, y, epochs=2, num_microbatches=2, schedule="auto", checkpoint_dir=d)
    manifest = C.read(C.latest_valid(d)[0])
    chosen = manifest["choices"]["schedule"]
    assert chosen in ex.AUTO
    # The manifest's layout is the one the run used: the schedule kept, not "auto".
    assert {k: manifest["layout"][k] for k in ("num_stages", "num_replicas", "schedule")} == \
        {"num_stages": 2, "num_replicas": 1, "schedule": chosen}
    tried = []
    monkeypatch.setattr(ex.Executor, "_try", lambda self, seconds: tried.append(self.schedule))
    schedules = []
    original = ex.Executor.step

    def step(self, *args, **kwargs):
        schedules.append(self.schedule)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(ex.Executor, "step", step)
    fit_ranks(2, 1, start, x, y, epochs=3, num_microbatches=2, schedule="auto", checkpoint_dir=d,
              resume=True)
    assert not tried and set(schedules) == {chosen}


def test_reshape_4x1_to_2x2_to_1x1(tmp_path, setting):
    start, x, y = setting
    reference = models.mlp("adam")
    reference.set_weights(start)
    reference.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0)
    d = str(tmp_path)
    fit_ranks(4, 1, start, x, y, epochs=1, shuffle=False, num_microbatches=2, checkpoint_dir=d)
    fit_ranks(2, 2, start, x, y, epochs=2, shuffle=False, checkpoint_dir=d, resume=True)
    final = fit_ranks(1, 1, start, x, y, epochs=3, shuffle=False, checkpoint_dir=d, resume=True)
    assert max_diff(final[0][0], reference.get_weights()) <= 1e-5
    # ... and into a normal .keras file.
    C.export(d, str(tmp_path / "model.keras"))
    exported = keras.saving.load_model(tmp_path / "model.keras")
    assert max_diff(exported.get_weights(), final[0][0]) == 0.0


def test_rotation_keeps_the_newest(tmp_path, setting):
    start, x, y = setting
    fit_ranks(2, 1, start, x, y, epochs=2, checkpoint_dir=str(tmp_path), checkpoint_every=2, keep=2)
    kept = C.list_checkpoints(str(tmp_path))
    assert [os.path.basename(p) for p in kept] == ["ckpt-000000010", "ckpt-000000012"]
    assert open(tmp_path / "LATEST").read().strip() == "ckpt-000000012"


def corrupt(path, name):
    file = os.path.join(path, name)
    data = bytearray(open(file, "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(file, "wb").write(bytes(data))


def test_bad_checkpoints_give_errors_and_earlier_ones_still_load(tmp_path, setting):
    start, x, y = setting
    d = str(tmp_path)
    full = fit_ranks(2, 1, start, x, y, epochs=2, checkpoint_dir=d)[0][0]
    first, second = C.list_checkpoints(d)
    corrupt(second, "stage-1.npz")
    with pytest.raises(C.CheckpointError, match="corrupt or truncated"):
        C.read(second)
    warnings = []
    assert C.latest_valid(d, warn=warnings.append)[0] == first
    assert "corrupt" in warnings[0]
    # A truncated manifest.
    with open(os.path.join(second, "manifest.json"), "w") as f:
        f.write('{"format": "hyparflow-')
    with pytest.raises(C.CheckpointError, match="cannot be read"):
        C.read(second)
    # resume=True falls back to the previous valid checkpoint and redoes epoch 2 from it.
    resumed = fit_ranks(2, 1, start, x, y, epochs=2, checkpoint_dir=d, resume=True)
    assert max_diff(resumed[0][0], full) == 0.0


def test_checkpoint_of_another_model_is_refused(tmp_path, setting):
    start, x, y = setting
    fit_ranks(1, 1, start, x, y, epochs=1, checkpoint_dir=str(tmp_path))
    other = models.skip_cnn()
    with pytest.raises(C.CheckpointError, match=r"is not of this model \(10 differences: stem/kernel: shape \(3, 3, 1, 4\) in the model"):
        C.restore_model(other, C.list_checkpoints(str(tmp_path))[-1])


def test_missing_directory_and_export_errors(tmp_path):
    with pytest.raises(C.CheckpointError, match="No such checkpoint directory"):
        C.export(str(tmp_path / "nowhere"), str(tmp_path / "m.keras"))
    os.makedirs(tmp_path / "empty")
    with pytest.raises(C.CheckpointError, match="holds no valid checkpoint"):
        C.export(str(tmp_path / "empty"), str(tmp_path / "m.keras"))
    with pytest.raises(ValueError, match="needs `checkpoint_dir`"):
        run_ranks(1, lambda comm: hf.fit(models.mlp(), *models.mlp_data(16), resume=True, comm=comm))


def test_full_disk_during_a_write_leaves_the_previous_checkpoint(tmp_path, setting, monkeypatch):
    start, x, y = setting
    d = str(tmp_path)
    fit_ranks(2, 1, start, x, y, epochs=1, checkpoint_dir=d)
    before = C.list_checkpoints(d)
    real = np.savez

    def full(file, **arrays):
        if "stage-1" in str(file):
            raise OSError(28, "No space left on device")
        return real(file, **arrays)

    monkeypatch.setattr(np, "savez", full)
    with pytest.raises(C.CheckpointError, match=r"No space left on device.*previous checkpoint .* is intact"):
        fit_ranks(2, 1, start, x, y, epochs=2, checkpoint_dir=d, resume=True)
    monkeypatch.setattr(np, "savez", real)
    assert C.list_checkpoints(d) == before
    assert not [e for e in os.listdir(d) if ".tmp-" in e]
    C.restore_model(models.mlp("adam"), before[-1])


def test_loading_never_unpickles(tmp_path, setting):
    start, x, y = setting
    d = str(tmp_path)
    fit_ranks(1, 1, start, x, y, epochs=1, checkpoint_dir=d)
    path = C.list_checkpoints(d)[-1]
    evil = os.path.join(path, "stage-0.npz")
    np.savez(evil, **{"model/x": np.array([object()], dtype=object)})
    manifest = json.load(open(os.path.join(path, "manifest.json")))
    manifest["files"]["stage-0.npz"] = C._sha256(evil)
    json.dump(manifest, open(os.path.join(path, "manifest.json"), "w"))
    with pytest.raises(C.CheckpointError, match="cannot be loaded safely"):
        C.restore_model(models.mlp("adam"), path)


def test_nan_inputs_are_reported():
    x, y = models.mlp_data(32)
    x[7, 3] = np.nan
    with pytest.raises(ValueError, match=r"x\[0\] has NaN or infinite values \(first at sample 7\)"):
        run_ranks(1, lambda comm: hf.fit(models.mlp(), x, y, comm=comm, verbose=0))
    run_ranks(1, lambda comm: hf.fit(models.mlp(), x, y, comm=comm, verbose=0, check_finite=False))
