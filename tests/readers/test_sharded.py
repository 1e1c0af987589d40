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
