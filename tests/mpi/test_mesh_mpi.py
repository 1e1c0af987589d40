"""The 2x2 tensor mesh over real MPI messages; run under mpiexec by tests/cluster/test_mpi.py
(with the rest of tests/mpi):

    mpiexec -n 4 python -m pytest --with-mpi tests/mpi/test_mesh_mpi.py
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import hyparflow as hf  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from conftest import max_diff, reference  # noqa: E402
from test_mesh import encoder_block  # noqa: E402


@pytest.mark.mpi(min_size=4)
def test_encoder_block_on_a_2x2_mesh_under_mpiexec():
    """Feed-forward pair, residual and LayerNorm on a 2x2 mesh (replicas on the
    other ranks at n=8), Adam, 2 microbatches: model.fit's weights."""
    rng = np.random.default_rng(3)
    x = rng.normal(size=(16, 4, 8)).astype("float32")
    y = rng.normal(size=(16, 3)).astype("float32")
    start, expected, _ = reference(encoder_block, x, y, batch_size=8, epochs=2)
    model = encoder_block()
    model.set_weights(start)
    history = hf.fit(model, x, y, batch_size=8, epochs=2, num_tensor=4, tensor_mesh=(2, 2),
                     num_microbatches=2, tensor_layers=["ffn_up", "ffn_down", "proj"],
                     shuffle=False, verbose=0)
    diff = max_diff(model.get_weights(), expected)
    if hf.is_main():
        print(f"\nencoder block on a 2x2 mesh: max weight difference {diff:.3g}, "
              f"{history.kept_per_sample:.0f} bytes kept per sample")
    assert diff <= 2e-5


@pytest.mark.mpi(min_size=4)
def test_transformer_encoder_with_attention_on_a_2x2_mesh_under_mpiexec():
    """Attention (projections by SUMMA, heads over the columns, a padding mask), the
    feed-forward pair, residuals and LayerNorms on a 2x2 mesh, Adam, 2 microbatches:
    model.fit's weights."""
    from test_mesh_models import ENCODER, encoder_classifier, encoder_data

    x, y = encoder_data()
    start, expected, _ = reference(encoder_classifier, x, y, batch_size=8, epochs=1)
    model = encoder_classifier()
    model.set_weights(start)
    hf.fit(model, x, y, batch_size=8, epochs=1, num_tensor=4, tensor_mesh=(2, 2),
           num_microbatches=2, tensor_layers=ENCODER, shuffle=False, verbose=0)
    diff = max_diff(model.get_weights(), expected)
    if hf.is_main():
        print(f"\ntransformer encoder on a 2x2 mesh: max weight difference {diff:.3g}")
    assert diff <= 2e-5


@pytest.mark.mpi(min_size=8)
def test_two_stages_of_2x2_meshes_under_mpiexec():
    """S=2 x a 2x2 mesh each on 8 processes (tests/cluster/test_mpi.py runs this file alone at
    n=8): the pipeline's boundary between two meshes (gathered on one, cut on the
    next), Adam, 2 microbatches: model.fit's weights."""
    from test_mesh import REGION, data, mlp

    x, y = data()
    build = lambda: mlp("adam")  # noqa: E731
    start, expected, _ = reference(build, x, y, batch_size=16, epochs=2)
    model = build()
    model.set_weights(start)
    hf.fit(model, x, y, batch_size=16, epochs=2, num_stages=2, num_tensor=4,
           tensor_mesh=(2, 2), num_microbatches=2, tensor_layers=REGION, balance=[3, 4],
           shuffle=False, verbose=0)
    diff = max_diff(model.get_weights(), expected)
    if hf.is_main():
        print(f"\ntwo stages of 2x2 meshes: max weight difference {diff:.3g}")
    assert diff <= 2e-5


@pytest.mark.mpi(min_size=4)
def test_padded_tagger_with_keras_masks_on_a_2x2_mesh_under_mpiexec():
    """A `mask_zero` Embedding, attention taking the padding and a causal mask from the
    Keras masks, a per-token loss over padded tokens (tests/kinds/test_mesh_masks.py) on
    a 2x2 mesh, Adam, 2 microbatches: model.fit's weights."""
    from test_mesh_masks import BLOCK, encoder, padded_ids

    ids = padded_ids(16, 33)
    tags = (ids % 5).astype("int32")
    build = lambda: encoder(causal=True, per_token=True)  # noqa: E731
    start, expected, _ = reference(build, ids, tags, batch_size=8, epochs=1)
    model = build()
    model.set_weights(start)
    hf.fit(model, ids, tags, batch_size=8, epochs=1, num_tensor=4, tensor_mesh=(2, 2),
           num_microbatches=2, tensor_layers=BLOCK + ["tags"], shuffle=False, verbose=0)
    diff = max_diff(model.get_weights(), expected)
    if hf.is_main():
        print(f"\npadded tagger on a 2x2 mesh: max weight difference {diff:.3g}")
    assert diff <= 2e-5
