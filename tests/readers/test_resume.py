"""Resuming mid-epoch from streams that cannot start mid-way (a tf.data dataset read on
rank 0, a dataset function read per replica): each is read forward to the step, its
earlier batches read again and dropped, with a note on rank 0; the result is the
uninterrupted run's, bit for bit. (Arrays and PyDatasets start there by index:
tests/engine/test_checkpoint.py, tests/readers/test_indexed.py.)"""

import keras
import pytest
import tensorflow as tf

import hyparflow as hf
from conftest import max_diff
from hyparflow.engine import checkpoint as C
from hyparflow.engine.local import run_ranks
from inputs import arrays, mlp

pytestmark = pytest.mark.timeout(600)


def whole():
    x, y, w = arrays()
    return tf.data.Dataset.from_tensor_slices((x, y, w)).batch(16)   # 6 steps an epoch


def per_replica(ctx):
    x, y, w = arrays()
    return (tf.data.Dataset.from_tensor_slices((x, y, w))
            .shard(ctx.num_input_pipelines, ctx.input_pipeline_id)
            .batch(ctx.per_replica_batch_size))


class Crash(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if self.model.optimizer.iterations.numpy() == 10:
            raise KeyboardInterrupt("simulated crash after step 10")


@pytest.mark.parametrize("data,layout", [(whole, (2, 1, 2)), (per_replica, (1, 2, 1))],
                         ids=["dataset on rank 0", "dataset function"])
def test_resume_reads_a_stream_forward_and_is_bit_identical(data, layout, tmp_path, capfd):
    stages, replicas, micro = layout
    start = mlp().get_weights()
    built = [mlp() for _ in range(3 * stages * replicas)]

    def fit(directory, **kwargs):
        def body(comm):
            model = built.pop()
            model.set_weights(start)
            hf.fit(model, data() if data is whole else data, batch_size=16, epochs=3,
                   num_stages=stages, num_replicas=replicas, num_microbatches=micro,
                   comm=comm, verbose=0, checkpoint_dir=directory, checkpoint_every=4,
                   **kwargs)
            return model.get_weights()

        return run_ranks(stages * replicas, body, timeout=300)

    uninterrupted = fit(str(tmp_path / "a"))[0]
    with pytest.raises(KeyboardInterrupt):
        fit(str(tmp_path / "b"), callbacks=[Crash()])
    assert C.latest_valid(str(tmp_path / "b"))[1]["step"] == 2
    capfd.readouterr()
    resumed = fit(str(tmp_path / "b"), resume=True)[0]
    assert max_diff(resumed, uninterrupted) == 0.0
    said = capfd.readouterr().out
    assert said.count("resuming mid-epoch") == 1 and "read again up to step 2" in said, said
