"""The 2x2 mesh composed with the rest of hyparflow: replicas (8 ranks), ZeRO-1,
pipeline stages under the split-backward schedules, recompute, and checkpoints
resumed into the 1D layout and back; every case against plain `model.fit` on one
process (the MLP of test_mesh.py, one epoch of 2 batches)."""

import functools

import numpy as np
import pytest

import hyparflow
from conftest import check_resumes, max_diff, reference
from hyparflow.engine.local import run_ranks
from test_mesh import REGION, data, mlp

MESH = dict(num_tensor=4, tensor_mesh=(2, 2), tensor_layers=REGION)
ONE_D = dict(num_tensor=4, tensor_layers=REGION)
TWO_STAGES = dict(num_stages=2, num_microbatches=2, balance=[3, 4])


def slot_elements(model):
    return sum(int(np.prod(v.shape)) for v in model.optimizer.variables if len(v.shape))


def fit_ranks(build, x, y, start, ranks, **kwargs):
    """hf.fit, one epoch of 2 batches, on `ranks` thread-ranks: [(weights, elements of
    the optimizer's state)] per rank."""

    def body(comm):
        model = build()
        model.set_weights(start)
        hyparflow.fit(model, x, y, epochs=1, batch_size=16, shuffle=False, verbose=0,
                      comm=comm, **kwargs)
        return model.get_weights(), slot_elements(model)

    return run_ranks(ranks, body, timeout=300)


@functools.cache  # one plain Keras run per optimizer for every case (tests only read it)
def fit_reference(optimizer):
    return reference(lambda: mlp(optimizer), *data(), epochs=1, batch_size=16)


@pytest.mark.parametrize("optimizer, ranks, layout", [
    ("sgd", 8, dict(num_replicas=2, num_microbatches=2)),
    # recompute: every backward replays its forward's exchanges (no F and B fused).
    ("sgd", 8, dict(TWO_STAGES, schedule="zb-batched", recompute=True)),
    ("adam", 8, dict(TWO_STAGES, schedule="zb-h1")),
    ("adam", 8, dict(TWO_STAGES, schedule="1f1b-w", recompute=True)),
], ids=["replicas-sgd", "zb-batched-recompute-sgd", "zb-h1-adam", "1f1b-w-recompute-adam"])
def test_the_mesh_composes_and_trains_as_model_fit(optimizer, ranks, layout):
    x, y = data()
    build = lambda: mlp(optimizer)  # noqa: E731
    start, want, _ = fit_reference(optimizer)
    for weights, _ in fit_ranks(build, x, y, start, ranks, **MESH, **layout):
        assert max_diff(weights, want) < 2e-5


def test_zero_over_replicas_of_the_mesh(monkeypatch):
    """ZeRO-1 over R=2 replicas of a 2x2 mesh: weights as model.fit's; as for 1D
    parts, each replica steps its mesh blocks whole (their Adam state on both), and
    the state of the layers outside the mesh (the head) is held once over the two."""
    x, y = data()
    build = lambda: mlp("adam")  # noqa: E731
    start, want, _ = fit_reference("adam")
    alone = [s for _, s in fit_ranks(build, x, y, start, 4, num_microbatches=2, **MESH)]
    monkeypatch.setenv("HYPARFLOW_ZERO", "1")
    got = fit_ranks(build, x, y, start, 8, num_replicas=2, num_microbatches=2, **MESH)
    for weights, _ in got:
        assert max_diff(weights, want) < 2e-5
    slots = [s for _, s in got]  # rank = replica * 4 + mesh rank
    head = 2 * build().get_layer("head").count_params()  # Adam: 2 slots per weight
    for t in range(4):
        assert (alone[t] - slots[t]) + (alone[t] - slots[4 + t]) == head, (slots, alone)


@pytest.mark.parametrize("first, second", [(MESH, ONE_D), (ONE_D, MESH)],
                         ids=["2x2-to-1d", "1d-to-2x2"])
def test_a_checkpoint_moves_between_the_mesh_and_1d(first, second, tmp_path):
    """Written after epoch 1 in one layout (whole weights and Adam state), resumed for
    epoch 2 in the other: model.fit's weights after 2 epochs. (2x2 to T=1 with
    replicas: test_mesh.py and test_mesh_models.py.)"""
    check_resumes(lambda: mlp("adam"), *data(), tmp_path,
                  [(1, first), (2, dict(resume=True, **second))], batch_size=16, ranks=4,
                  tol=2e-5)


def test_interleaved_with_the_mesh_is_refused_with_the_reason():
    from hyparflow.layout import resolve

    with pytest.raises(NotImplementedError, match="split layers inside model chunks"):
        resolve(8, num_stages=2, num_microbatches=2, schedule="interleaved", num_chunks=2,
                num_tensor=4, tensor_mesh=(2, 2))
