"""Each replica reads its own part, once: a dataset function (hf.InputContext), or a
tf.data.Dataset whose files are dealt out to the replicas. The weights equal
model.fit's on the global batches the replicas' batches make, and each record is
decoded once an epoch across the job."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import hyparflow as hf
from conftest import max_diff, train_ranks
from inputs import mlp
import records

pytestmark = pytest.mark.timeout(600)
B, EPOCHS = 16, 2


def model():
    m = mlp()
    return m


def want(batches, start):
    """model.fit on exactly these global batches, in order, each epoch."""
    plain = model()
    plain.set_weights(start)

    def again():
        while True:
            yield from batches

    plain.fit(again(), steps_per_epoch=len(batches), epochs=EPOCHS, verbose=0)
    return plain.get_weights()


def by_files(paths):
    def fn(ctx):
        mine = paths[ctx.input_pipeline_id::ctx.num_input_pipelines]
        return records.pipeline(mine, ctx.per_replica_batch_size)
    return fn


@pytest.mark.parametrize("stages,replicas,micro", [(1, 2, 1), (2, 1, 2), (2, 2, 2)])
@pytest.mark.parametrize("files", [4, 3])   # 3 files over 2 replicas: one part ends early
def test_dataset_function_trains_to_model_fit_on_the_replicas_batches(
        stages, replicas, micro, files, tmp_path):
    paths = records.write(tmp_path, files=files)
    start = model().get_weights()
    expect = want(records.global_batches(records.replica_batches(paths, B, replicas)), start)
    records.DECODED.clear()
    out = train_ranks(model, by_files(paths), None, num_stages=stages, num_replicas=replicas,
                      num_microbatches=micro, weights=start, epochs=EPOCHS, batch_size=B)
    assert max(max_diff(w, expect) for w, _ in out) < 2e-6
    # Each record once an epoch across all ranks (the first batch, read at the start to
    # build the model and size the stages, is the first step's).
    assert np.bincount(records.DECODED, minlength=files * 24).tolist() == [EPOCHS] * (files * 24)


def dealt(paths, replicas):
    """What FILE auto-sharding gives replica r of the whole pipeline: files r, r + R, ...
    batched by the global batch, each batch cut to the replica's share (`rebatch`)."""
    from hyparflow.readers.context import per_replica

    parts = []
    for r in range(replicas):
        share = per_replica(B, replicas, r)
        mine = pipeline_of(paths[r::replicas]).rebatch(share)
        parts.append(list(mine.as_numpy_iterator()))
    return parts


def pipeline_of(paths):
    return records.pipeline(paths, B)


@pytest.mark.parametrize("stages,replicas,micro", [(1, 2, 1), (2, 2, 2)])
def test_a_dataset_of_files_is_dealt_to_the_replicas(stages, replicas, micro, tmp_path):
    paths = records.write(tmp_path, files=4)
    start = model().get_weights()
    expect = want(records.global_batches(dealt(paths, replicas)), start)
    records.DECODED.clear()
    out = train_ranks(model, records.pipeline(paths, B), None, num_stages=stages,
                      num_replicas=replicas, num_microbatches=micro, weights=start,
                      epochs=EPOCHS)
    assert max(max_diff(w, expect) for w, _ in out) < 2e-6
    assert np.bincount(records.DECODED, minlength=4 * 24).tolist() == [EPOCHS] * (4 * 24)


def test_fewer_files_than_replicas_read_whole_on_one_rank_with_a_note(tmp_path, capfd):
    paths = records.write(tmp_path, files=1)
    start = model().get_weights()
    expect = want(list(records.pipeline(paths, B).as_numpy_iterator()), start)
    records.DECODED.clear()
    out = train_ranks(model, records.pipeline(paths, B), None, num_stages=1, num_replicas=2,
                      num_microbatches=1, weights=start, epochs=EPOCHS)
    assert max(max_diff(w, expect) for w, _ in out) < 2e-6
    assert "cannot be dealt to the 2 replicas" in capfd.readouterr().out


def test_auto_shard_off_keeps_model_fits_batches(tmp_path):
    paths = records.write(tmp_path, files=4)
    start = model().get_weights()
    expect = want(list(records.pipeline(paths, B).as_numpy_iterator()), start)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    out = train_ranks(model, records.pipeline(paths, B).with_options(options), None,
                      num_stages=1, num_replicas=2, num_microbatches=1, weights=start,
                      epochs=EPOCHS)
    assert max(max_diff(w, expect) for w, _ in out) < 2e-6


def test_batches_larger_than_a_replicas_share_are_refused(tmp_path):
    paths = records.write(tmp_path, files=2)
    with pytest.raises((ValueError, RuntimeError), match=r"more than its share .* "
                       r"ctx.per_replica_batch_size"):
        train_ranks(model, lambda ctx: records.pipeline(paths, B), None, num_stages=1,
                    num_replicas=2, num_microbatches=1, weights=model().get_weights(),
                    batch_size=B)


def test_evaluate_reads_per_replica_too(tmp_path):
    paths = records.write(tmp_path, files=4)
    plain = model()
    batches = records.global_batches(records.replica_batches(paths, B, 2))
    x, y, w = (np.concatenate([b[k] for b in batches]) for k in range(3))
    # The mean over all samples does not depend on how they were batched.
    expect = plain.evaluate(x, y, sample_weight=w, batch_size=len(x), verbose=0)

    def body(comm):
        mine = model()   # a model per thread-rank, as each process has its own
        mine.set_weights(plain.get_weights())
        return hf.evaluate(mine, by_files(paths), batch_size=B, comm=comm, verbose=0,
                           num_replicas=2, num_stages=1)

    from hyparflow.engine.local import run_ranks
    for got in run_ranks(2, body, timeout=300):
        assert np.allclose(got, expect, rtol=1e-5)


def test_tensor_ranks_take_the_batch_from_one_reader(tmp_path):
    """T=2 x R=2: each replica's first tensor rank reads, the other decodes nothing."""
    paths = records.write(tmp_path, files=4)
    start = model().get_weights()
    expect = want(records.global_batches(records.replica_batches(paths, B, 2)), start)
    records.DECODED.clear()
    out = train_ranks(model, by_files(paths), None, num_stages=1, num_replicas=2,
                      num_microbatches=1, weights=start, epochs=EPOCHS, batch_size=B,
                      num_tensor=2, tensor_layers=["hidden", "middle"])
    assert max(max_diff(w, expect) for w, _ in out) < 2e-6
    assert np.bincount(records.DECODED, minlength=4 * 24).tolist() == [EPOCHS] * (4 * 24)


def test_files_shuffled_without_a_seed_are_refused_before_dealing(tmp_path):
    """list_files shuffles unseeded by default: each reader would deal its own order of
    the files (overlapping parts). Refused naming the fix; seeded, or shuffled after
    reading, it trains."""
    records.write(tmp_path, files=4)
    pattern = str(tmp_path / "*")

    def listed(seed=None, shuffle=None):
        tf.random.set_seed(None)   # the models' builds set a global seed (which seeds it)
        files = tf.data.Dataset.list_files(pattern, seed=seed, shuffle=shuffle)
        return files.interleave(tf.data.TFRecordDataset).map(records.decode)

    def fit(data):
        built = [model() for _ in range(2)]   # not in the ranks: they seed TF globally
        return train_ranks(built.pop, data, None, num_stages=1, num_replicas=2,
                           num_microbatches=1, weights=built[0].get_weights(), batch_size=B)

    for unseeded in (listed().batch(B),
                     lambda ctx: listed().shard(ctx.num_input_pipelines,
                                                ctx.input_pipeline_id).batch(8)):
        with pytest.raises((ValueError, RuntimeError),
                           match=r"without a seed .*list_files\(pattern, seed=\.\.\.\)"):
            fit(unseeded)
    fit(listed(seed=3).batch(B))
    fit(listed(shuffle=False).shuffle(32).batch(B))
