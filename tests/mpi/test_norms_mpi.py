"""BatchNormalization through TensorFlow's fused kernel (engine/norms.py) over real MPI
messages, with production's one inter-op thread; run under mpiexec by
tests/cluster/test_mpi.py:

    mpiexec -n 2 python -m pytest --with-mpi tests/mpi/test_norms_mpi.py
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import hyparflow as hf  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from mpi4py import MPI  # noqa: E402

from conftest import max_diff  # noqa: E402
from hyparflow.engine import norms  # noqa: E402

SIZE = MPI.COMM_WORLD.Get_size()
L = keras.layers


def cnn(accumulate=None):
    """Two convolution blocks (no bias before a normalization: Adam would turn the
    round-off of its zero gradient into steps) and a normalized Dense head."""
    keras.utils.set_random_seed(42)
    inp = keras.Input((8, 8, 3))
    x = inp
    for filters in (8, 16):
        x = L.Conv2D(filters, 3, padding="same", use_bias=False)(x)
        x = L.Activation("relu")(L.BatchNormalization(momentum=0.9)(x))
        x = L.MaxPooling2D()(x)
    x = L.Flatten()(x)
    x = L.Activation("relu")(L.BatchNormalization()(L.Dense(32, use_bias=False)(x)))
    model = keras.Model(inp, L.Dense(5)(x))
    model.compile(optimizer=keras.optimizers.Adam(0.005, epsilon=1e-5,
                                                  gradient_accumulation_steps=accumulate),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("stages,micro", [(1, 2), (2, 2)])
def test_fused_batchnorm_matches_model_fit(stages, micro, monkeypatch):
    taken = []
    plain = norms.Fused._takes
    monkeypatch.setattr(norms.Fused, "_takes",
                        lambda self, x, mask: taken.append(plain(self, x, mask)) or taken[-1])
    rng = np.random.default_rng(42)
    x = rng.normal(size=(64, 8, 8, 3)).astype("float32")
    y = rng.integers(0, 5, 64)
    replicas = SIZE // stages
    slices = replicas * micro
    # Each microbatch normalized by its own statistics: one process accumulating the
    # gradients of the same B / (R*M) slices.
    reference = cnn(slices)
    start = reference.get_weights()
    reference.fit(x, y, batch_size=32 // slices, epochs=2, shuffle=False, verbose=0)
    trainable = ["moving" not in v.path for v in reference.weights]
    want = [w for w, t in zip(reference.get_weights(), trainable) if t]
    model = cnn()
    model.set_weights(start)
    hf.fit(model, x, y, batch_size=32, epochs=2, num_stages=stages, num_replicas=replicas,
           num_microbatches=micro, shuffle=False, verbose=0)
    got = [w for w, t in zip(model.get_weights(), trainable) if t]
    diff = max_diff(got, want)
    mine = b"".join(w.tobytes() for w in model.get_weights())
    assert all(other == mine for other in MPI.COMM_WORLD.allgather(mine))
    assert diff <= 1e-5, f"S={stages} R={replicas} M={micro}: {diff:g}"
    # Every rank's stage ran its normalizations through the kernel.
    assert all(MPI.COMM_WORLD.allgather(any(taken)))
