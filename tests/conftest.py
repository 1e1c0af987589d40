"""Shared helpers: models, data and a way to run hyparflow ranks as threads."""

import os

os.environ.setdefault("HYPARFLOW_TIMEOUT", "120")
# Thread-ranks wait for each other inside compiled functions (tensor parallelism):
# each needs an inter-op thread of its own.
os.environ.setdefault("HYPARFLOW_INTER_OP_THREADS", "8")

import hyparflow  # noqa: E402,F401  (quiet TensorFlow first)
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

from hyparflow.local import run_ranks  # noqa: E402

# Each thread-rank traces its own stage function; TF counts them all as retraces.
tf.get_logger().setLevel("ERROR")


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


@pytest.fixture
def run_ranks_fixture():
    return run_ranks
