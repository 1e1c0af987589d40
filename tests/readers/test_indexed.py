"""A PyDataset of known length read by index (hyparflow/readers/indexed.py): each
batch read once in the job, by the replicas' readers in turn, in model.fit's order
(shuffled by Python's random as model.fit shuffles it); resumed mid-epoch without
reading the epoch's earlier batches, bit-identical to the uninterrupted run."""

import random

import keras
import numpy as np
import pytest

import hyparflow as hf
from conftest import max_diff, train_ranks
from hyparflow.engine import checkpoint as C
from hyparflow.engine.local import run_ranks
from inputs import Batches, arrays, mlp

pytestmark = pytest.mark.timeout(600)
EPOCHS = 3


def built(ranks):
    """A build for `ranks` thread-ranks: the models built here, then Python's random
    seeded for the order. Ranks as threads share one `random`, and each model's build
    seeds and draws from it: built in the ranks, the state at rank 0's draw would
    depend on how the threads interleave (processes under MPI each have their own)."""
    models = [mlp() for _ in range(ranks)]
    random.seed(5)
    return models.pop


@pytest.mark.parametrize("stages,replicas,micro", [(1, 2, 1), (2, 1, 2)])
def test_shuffled_pydataset_trains_to_model_fit(stages, replicas, micro):
    x, y, w = arrays()
    model = mlp()
    start = model.get_weights()
    random.seed(5)
    model.fit(Batches(x, y, w), epochs=EPOCHS, shuffle=True, verbose=0)
    data = Batches(x, y, w)
    out = train_ranks(built(stages * replicas), data, None, num_stages=stages,
                      num_replicas=replicas,
                      num_microbatches=micro, weights=start, epochs=EPOCHS, shuffle=True)
    assert max(max_diff(weights, model.get_weights()) for weights, _ in out) < 2e-6
    assert sorted(data.reads) == sorted(list(range(len(data))) * EPOCHS)


def _fit(data, start, directory, seed=5, **kwargs):
    build = built(4)
    random.seed(seed)

    def body(comm):
        model = build()
        model.set_weights(start)
        hf.fit(model, data, num_stages=2, num_replicas=2, num_microbatches=2, comm=comm,
               verbose=0, epochs=EPOCHS, shuffle=True, checkpoint_dir=directory,
               checkpoint_every=4, **kwargs)
        return model.get_weights()

    return run_ranks(4, body, timeout=300)


def test_resume_mid_epoch_reads_no_earlier_batch_and_is_bit_identical(tmp_path):
    x, y, w = arrays()
    start = mlp().get_weights()
    whole = _fit(Batches(x, y, w), start, str(tmp_path / "a"))[0]

    class Crash(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if self.model.optimizer.iterations.numpy() == 10:
                raise KeyboardInterrupt("simulated crash after step 10")

    with pytest.raises(KeyboardInterrupt):
        _fit(Batches(x, y, w), start, str(tmp_path / "b"), callbacks=[Crash()])
    latest = C.latest_valid(str(tmp_path / "b"))[1]
    assert (latest["epoch"], latest["step"]) == (1, 2)   # 6 steps an epoch
    data = Batches(x, y, w)   # the resumed run draws the orders from the checkpoint's state
    resumed = _fit(data, start, str(tmp_path / "b"), seed=99, resume=True)[0]
    assert max_diff(resumed, whole) == 0.0
    # The set-up's first batch, then only the steps not done: epoch 1's last 4, epoch 2.
    assert len(data.reads) == 1 + 4 + 6


@pytest.mark.parametrize("form", ["pydataset", "arrays"])
def test_weighted_validation_data_as_in_model_fit(form):
    """Validation data with sample weights (training data without): the validation loss
    weighed as model.fit weighs it; a validation PyDataset's hooks called each run as
    model.fit's evaluate calls them, each of its batches read once a run."""
    x, y, w = arrays()
    plain = Batches(x, y, w) if form == "pydataset" else (x, y, w)
    model = mlp()
    start = model.get_weights()
    history = model.fit(x, y, batch_size=16, epochs=EPOCHS, shuffle=False, verbose=0,
                        validation_data=plain).history
    val = Batches(x, y, w) if form == "pydataset" else (x, y, w)
    out = train_ranks(built(2), x, y, num_stages=1, num_replicas=2, num_microbatches=1,
                      weights=start, batch_size=16, epochs=EPOCHS, shuffle=False,
                      validation_data=val)
    for weights, got in out:
        assert max_diff(weights, model.get_weights()) < 2e-6
        assert np.allclose(got["val_loss"], history["val_loss"], rtol=1e-5), (got, history)
    if form == "pydataset":
        assert val.ends == plain.ends
        assert sorted(val.reads) == sorted(list(range(len(val))) * EPOCHS)


def test_initial_epoch_draws_as_model_fit():
    x, y, w = arrays()
    model = mlp()
    start = model.get_weights()
    random.seed(5)
    model.fit(Batches(x, y, w), epochs=EPOCHS, initial_epoch=1, shuffle=True, verbose=0)
    out = train_ranks(built(2), Batches(x, y, w), None, num_stages=1, num_replicas=2,
                      num_microbatches=1, weights=start, epochs=EPOCHS, initial_epoch=1,
                      shuffle=True)
    assert max(max_diff(weights, model.get_weights()) for weights, _ in out) < 2e-6
