"""The input forms model.fit takes, over real MPI messages with production's one
inter-op thread; run under mpiexec by tests/cluster/test_mpi.py:

    mpiexec -n 2 python -m pytest --with-mpi tests/mpi/test_inputs_mpi.py
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "readers"))

import hyparflow as hf  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402
from mpi4py import MPI  # noqa: E402

from conftest import max_diff  # noqa: E402
from inputs import B, Batches, arrays, generator, memmap, mlp  # noqa: E402
from test_dtypes import columns, recommender, structured  # noqa: E402

SIZE = MPI.COMM_WORLD.Get_size()
LAYOUTS = [(1, SIZE, 1), (2, SIZE // 2, 2)]


def _want():
    x, y, w = arrays()
    model = mlp()
    start = model.get_weights()
    model.fit(x, y, sample_weight=w, batch_size=B, epochs=2, shuffle=False, verbose=0)
    return start, model.get_weights()


def _data(form, tmp):
    x, y, w = arrays()
    if form == "memmap":
        path = os.path.join(tmp, "x.npy")
        if MPI.COMM_WORLD.Get_rank() == 0:
            memmap(path, x)
        MPI.COMM_WORLD.Barrier()
        return dict(x=np.load(path, mmap_mode="r"), y=y, sample_weight=w, batch_size=B)
    if form == "generator":
        return dict(x=generator(x, y, w), steps_per_epoch=len(x) // B)
    return dict(x=Batches(x, y, w, workers=2, use_multiprocessing=(form == "processes")))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("form", ["memmap", "threads", "processes", "generator"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda s: "S{}R{}M{}".format(*s))
def test_input_forms_train_to_model_fit(form, layout, tmp_path_factory):
    stages, replicas, micro = layout
    tmp = MPI.COMM_WORLD.bcast(str(tmp_path_factory.mktemp("inputs")), 0)
    start, want = _want()
    model = mlp()
    model.set_weights(start)
    hf.fit(model, **_data(form, tmp), epochs=2, shuffle=False, verbose=0,
           num_stages=stages, num_replicas=replicas, num_microbatches=micro)
    diff = max_diff(model.get_weights(), want)
    print(f"{form} S={stages} R={replicas} M={micro}: max weight difference {diff:.2e}")
    assert diff < 2e-6


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda s: "S{}R{}M{}".format(*s))
def test_string_columns_and_int_ids_train_to_model_fit(layout):
    stages, replicas, micro = layout
    colour, number, y = columns()
    x = {"colour": tf.constant(colour), "number": number}
    plain = structured()
    start = plain.get_weights()
    plain.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    model = structured()
    model.set_weights(start)
    hf.fit(model, tf.data.Dataset.from_tensor_slices((x, y)).batch(16), epochs=2,
           verbose=0, num_stages=stages, num_replicas=replicas, num_microbatches=micro)
    assert max_diff(model.get_weights(), plain.get_weights()) < 2e-6
    if stages == 1:   # a subclassed model: one stage
        rng = np.random.default_rng(1)
        pairs = np.stack([rng.integers(0, 20, 64), rng.integers(0, 30, 64)], 1)
        target = rng.uniform(0, 1, (64, 1)).astype("float32")
        plain, model = recommender(), recommender()
        plain.fit(pairs, target, batch_size=16, epochs=2, shuffle=False, verbose=0)
        hf.fit(model, pairs, target, batch_size=16, epochs=2, shuffle=False, verbose=0,
               num_replicas=replicas)
        assert max_diff(model.get_weights(), plain.get_weights()) < 2e-6


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("form", ["function", "dataset"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda s: "S{}R{}M{}".format(*s))
def test_each_replica_reads_its_part_once(form, layout, tmp_path_factory):
    """A dataset function, or a dataset of files dealt to the replicas: model.fit's
    weights on the replicas' batches put together, each record decoded once an epoch
    across the job (counted in every process, summed)."""
    import records
    from test_sharded import B, EPOCHS, by_files, dealt, model, want

    stages, replicas, micro = layout
    comm = MPI.COMM_WORLD
    paths = records.written_once(comm, tmp_path_factory)
    parts = (records.replica_batches(paths, B, replicas) if form == "function"
             else dealt(paths, replicas))
    start = model().get_weights()
    expect = want(records.global_batches(parts), start)
    records.DECODED.clear()
    trained = model()
    trained.set_weights(start)
    hf.fit(trained, by_files(paths) if form == "function" else records.pipeline(paths, B),
           batch_size=B, epochs=EPOCHS, verbose=0, num_stages=stages, num_replicas=replicas,
           num_microbatches=micro)
    diff = max_diff(trained.get_weights(), expect)
    decoded = np.bincount(np.concatenate([np.array(d, np.int64) for d in comm.allgather(
        records.DECODED)]), minlength=4 * 24)
    print(f"{form} S={stages} R={replicas} M={micro}: max weight difference {diff:.2e}, "
          f"decodes per record {sorted(set(decoded.tolist()))}")
    assert diff < 2e-6
    assert decoded.tolist() == [EPOCHS] * (4 * 24)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda s: "S{}R{}M{}".format(*s))
def test_pydataset_read_by_index_once_by_the_readers_in_turn(layout):
    """A shuffled PyDataset (Python's random, as model.fit shuffles it): model.fit's
    weights; each batch read once an epoch across the job, by each replica's reader in
    turn (reads counted in every process: its own copy of the PyDataset)."""
    import random

    stages, replicas, micro = layout
    comm = MPI.COMM_WORLD
    x, y, w = arrays()
    reference = mlp()
    start = reference.get_weights()
    random.seed(5)
    reference.fit(Batches(x, y, w), epochs=2, shuffle=True, verbose=0)
    model = mlp()
    model.set_weights(start)
    data = Batches(x, y, w, workers=2)
    random.seed(5)
    hf.fit(model, data, epochs=2, shuffle=True, verbose=0, num_stages=stages,
           num_replicas=replicas, num_microbatches=micro)
    diff = max_diff(model.get_weights(), reference.get_weights())
    reads = comm.allgather(list(data.reads))
    print(f"pydataset S={stages} R={replicas} M={micro}: max weight difference {diff:.2e}, "
          f"reads per rank {[len(r) for r in reads]}")
    assert diff < 2e-6
    assert sorted(sum(reads, [])) == sorted(list(range(len(data))) * 2)
    readers = [r * stages for r in range(replicas)]
    assert all(bool(reads[r]) == (r in readers) for r in range(comm.size)), reads
