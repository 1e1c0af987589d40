"""Every input form model.fit takes trains in hf.fit to model.fit's weights: arrays
read by rows (memmap, h5py), PyDatasets (threads, processes), generators (with
steps_per_epoch, or until exhausted), in fit, evaluate and predict."""

import numpy as np
import pytest

import hyparflow as hf
from conftest import max_diff, train_ranks
from inputs import B, Batches, arrays, generator, h5, memmap, mlp

pytestmark = pytest.mark.timeout(600)
EPOCHS = 2


@pytest.fixture(scope="module")
def want():
    """model.fit on the arrays, in order, with the sample weights."""
    x, y, w = arrays()
    model = mlp()
    start = model.get_weights()
    model.fit(x, y, sample_weight=w, batch_size=B, epochs=EPOCHS, shuffle=False, verbose=0)
    return start, model.get_weights()


def forms(tmp_path):
    x, y, w = arrays()
    return {
        "memmap": lambda: dict(x=memmap(tmp_path / "x.npy", x), y=y, sample_weight=w),
        "h5py": lambda: dict(x=h5(tmp_path / "x.h5", x), y=y, sample_weight=w),
        "pydataset": lambda: dict(x=Batches(x, y, w)),
        "pydataset threads": lambda: dict(x=Batches(x, y, w, workers=2, max_queue_size=3)),
        "pydataset processes": lambda: dict(x=Batches(x, y, w, workers=2,
                                                      use_multiprocessing=True)),
        "generator": lambda: dict(x=generator(x, y, w), steps_per_epoch=len(x) // B),
    }


@pytest.mark.parametrize("form", ["memmap", "h5py", "pydataset", "pydataset threads",
                                  "pydataset processes", "generator"])
@pytest.mark.parametrize("stages,replicas,micro", [(1, 2, 1), (2, 1, 2)])
def test_input_form_trains_to_model_fit(form, stages, replicas, micro, want, tmp_path):
    start, end = want
    data = forms(tmp_path)[form]()
    x, y = data.pop("x"), data.pop("y", None)
    if hasattr(x, "shape"):
        data["batch_size"] = B
    out = train_ranks(mlp, x, y, num_stages=stages, num_replicas=replicas,
                      num_microbatches=micro, weights=start, epochs=EPOCHS, shuffle=False,
                      **data)
    assert max(max_diff(weights, end) for weights, _ in out) < 2e-6


def test_generator_until_exhausted_is_one_epoch_as_in_model_fit():
    x, y, w = arrays()
    model = mlp()
    start = model.get_weights()
    model.fit(generator(x, y, w, repeat=False), epochs=1, verbose=0)
    out = train_ranks(mlp, generator(x, y, w, repeat=False), None, num_stages=1,
                      num_replicas=2, num_microbatches=1, weights=start, epochs=1)
    assert max(max_diff(weights, model.get_weights()) for weights, _ in out) < 2e-6


def test_pydataset_epoch_ends_as_in_model_fit_and_each_batch_read_once():
    x, y, w = arrays()
    plain = Batches(x, y, w)
    mlp().fit(plain, epochs=EPOCHS, shuffle=False, verbose=0)
    data = Batches(x, y, w)
    train_ranks(mlp, data, None, num_stages=1, num_replicas=2, num_microbatches=1,
                weights=mlp().get_weights(), epochs=EPOCHS, shuffle=False)
    assert data.ends == plain.ends >= EPOCHS
    # Across both ranks, each batch once an epoch: the first, read to size the stages, is
    # the first step's (model.fit reads some twice: its adapter peeks to learn the specs).
    assert sorted(data.reads) == sorted(list(range(len(data))) * EPOCHS)


def test_memmap_is_read_by_rows_never_cast_whole(tmp_path, monkeypatch):
    """A uint8 memmap fed to a float32 input: no read of more rows than a batch."""
    x, y, w = arrays()
    mapped = memmap(tmp_path / "x.npy", x)
    from hyparflow.readers import columns

    biggest = []
    plain = columns.rows

    def counted(array, index):
        out = plain(array, index)
        biggest.append(len(out))
        return out

    monkeypatch.setattr(columns, "rows", counted)
    model = mlp()
    hf.fit(model, mapped, y, batch_size=B, epochs=1, shuffle=True, verbose=0, check_finite=True)
    assert biggest and max(biggest) <= B


def test_evaluate_and_predict_take_pydatasets_and_generators():
    x, y, w = arrays()
    model = mlp()
    want_eval = model.evaluate(x, y, sample_weight=w, batch_size=B, verbose=0)
    want_pred = model.predict(x, batch_size=B, verbose=0)
    for data in (Batches(x, y, w), generator(x, y, w, repeat=False)):
        got = hf.evaluate(model, data, verbose=0)
        assert np.allclose(got, want_eval, atol=1e-6)
    assert np.allclose(hf.predict(model, Batches(x, y, w), verbose=0), want_pred, atol=1e-6)
    assert np.allclose(hf.predict(model, generator(x, y, w, repeat=False), verbose=0),
                       want_pred, atol=1e-6)


def test_data_wait_is_in_history_and_a_slow_reader_is_named(capfd):
    """A generator that takes 40 ms a batch against a step of a few ms."""
    import time

    def slow():
        for x, y, w in generator(*arrays()):
            time.sleep(0.04)
            yield x, y, w

    model = mlp()
    history = hf.fit(model, slow(), steps_per_epoch=10, epochs=1, verbose=0)
    wait = history.data_wait
    # (Keras peeks at a generator's first batches when it opens it: those come at once.)
    assert len(wait["seconds"]) == 10 and min(wait["seconds"][3:]) >= 0.035
    assert wait["fraction"] > 0.5
    assert "waiting for data took" in capfd.readouterr().err
    fast = hf.fit(mlp(), *arrays()[:2], batch_size=B, epochs=1, verbose=0)
    assert fast.data_wait["fraction"] < 0.2
    assert "waiting for data took" not in capfd.readouterr().err
