"""Keras masks and split layers over real MPI messages; run under mpiexec by
tests/cluster/test_mpi.py (with the rest of tests/mpi):

    mpiexec -n 4 python -m pytest --with-mpi tests/mpi/test_masks_mpi.py
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import hyparflow as hf  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from mpi4py import MPI  # noqa: E402

from hyparflow.topology import Topology  # noqa: E402
from test_masks import SPLIT, encoder_decoder, tokens, two_branches  # noqa: E402

SIZE = MPI.COMM_WORLD.Get_size()


def max_diff(a, b):
    return max(float(np.abs(np.asarray(p) - np.asarray(q)).max()) for p, q in zip(a, b))


@pytest.mark.mpi(min_size=4)
def test_independent_split_branches_under_mpiexec():
    """Two equal-shaped split branches on the first of two stages (its backward a
    compiled gradient function, whose collectives TensorFlow does not order), the
    branch each tensor rank reaches first set by a delay on the other: model.fit's
    weights after 12 microbatches each way (one tag for every collective paired
    the wrong branches' parts here: wrong weights, or an abort)."""
    rng = np.random.default_rng(5)
    x = [rng.normal(size=(48, 6)).astype("float32") for _ in range(2)]
    y = rng.integers(0, 3, 48)
    reference = two_branches()
    start = reference.get_weights()
    reference.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    expected = reference.get_weights()
    tensor = Topology(2, SIZE // 4, 2).tensor(MPI.COMM_WORLD.Get_rank())
    model = two_branches(left=0.03 if tensor == 0 else 0.0, right=0.03 if tensor == 1 else 0.0)
    model.set_weights(start)
    hf.fit(model, x, y, batch_size=8, epochs=2, num_stages=2, num_tensor=2,
           num_microbatches=2, balance=[8, 2], tensor_layers=["left", "right"],
           shuffle=False, verbose=0)
    diff = max_diff(model.get_weights(), expected)
    if hf.is_main():
        print(f"\nsplit branches in other orders: max weight difference {diff:.3g}")
    assert diff <= 1e-6


@pytest.mark.mpi(min_size=2)
def test_encoder_decoder_with_masks_split_over_tensor_ranks():
    """Padding masks, causal self-attention, cross-attention and FFN pairs, the
    attention and FFN layers split over 2 tensor ranks (with 2 stages and 2
    microbatches on 4 ranks), Adam: model.fit's weights."""
    x = [tokens(10, 30, [9, 4, 10, 3, 6, 8, 5, 7] * 2, 2),
         tokens(7, 30, [4, 6, 3, 7, 5, 5, 3, 7] * 2, 3)]
    y = np.random.default_rng(4).integers(0, 30, (16, 7))
    reference = encoder_decoder()
    start = reference.get_weights()
    reference.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    expected = reference.get_weights()
    s, m = (2, 2) if SIZE >= 4 else (1, 1)
    model = encoder_decoder()
    model.set_weights(start)
    hf.fit(model, x, y, batch_size=8, epochs=1, num_stages=s, num_tensor=2,
           num_microbatches=m, tensor_layers=SPLIT, shuffle=False, verbose=0)
    diff = max_diff(model.get_weights(), expected)
    if hf.is_main():
        print(f"\nencoder-decoder (S,T,M)={(s, 2, m)} max weight difference {diff:.3g}")
    assert diff <= 2e-5
