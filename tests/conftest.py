"""Shared helpers: models, data and a way to run hyparflow ranks as threads."""

import os

os.environ.setdefault("HYPARFLOW_TIMEOUT", "120")

import hyparflow  # noqa: E402,F401  (quiet TensorFlow first)
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

from hyparflow.local import run_ranks  # noqa: E402

# Each thread-rank traces its own stage function; TF counts them all as retraces.
tf.get_logger().setLevel("ERROR")


def max_diff(a, b):
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in zip(a, b))


def train_ranks(build, x, y, *, num_stages, num_replicas, num_microbatches, weights,
                **kwargs):
    """Run hf.fit on S*R thread-ranks, each with its own copy of the model starting
    from `weights`; return [(weights, history) per rank]."""

    def body(comm):
        model = build()
        model.set_weights(weights)
        history = hyparflow.fit(model, x, y, num_stages=num_stages, num_replicas=num_replicas,
                                num_microbatches=num_microbatches, comm=comm, verbose=0,
                                **kwargs)
        return model.get_weights(), history.history

    return run_ranks(num_stages * num_replicas, body, timeout=300)


@pytest.fixture
def run_ranks_fixture():
    return run_ranks
