"""Interleaved 1F1B (Megatron-LM's virtual pipeline): the schedule as data (lists per
rank whose actions name their model chunk; validate, simulate) and training with it
against plain Keras `model.fit`."""

import pytest

from hyparflow import schedules as sched
from hyparflow.layout import Layout


def virtual_chain(stages, chunks):
    """sources / dests of a chain of S x v virtual stages."""
    n = stages * chunks
    return ([[j - 1] if j else [] for j in range(n)],
            [[j + 1] if j < n - 1 else [] for j in range(n)])


def lowered(stages, micro, chunks):
    sources, dests = virtual_chain(stages, chunks)
    compute = sched.fuse(sched.build("interleaved", stages, micro, chunks), dests)
    return sched.lower(compute, sources, dests)


@pytest.mark.parametrize("stages,micro,chunks", [(2, 2, 2), (2, 4, 2), (4, 8, 2), (3, 6, 3),
                                                 (4, 4, 4)])
def test_valid_and_bubble_is_s_minus_1_over_v_m(stages, micro, chunks):
    low = lowered(stages, micro, chunks)
    sched.validate(low, micro)
    # Each chunk is 1/v of a stage: F 1/v, B 2/v. Idle per rank / busy per rank =
    # (S-1)/(vM), against 1F1B's (S-1)/M.
    sim = sched.simulate(low, 1.0 / chunks, 2.0 / chunks)
    busy = 3.0 * micro
    assert sim.makespan == pytest.approx(busy * (1 + (stages - 1) / (chunks * micro)))
    sources, dests = virtual_chain(stages, 1)
    plain = sched.simulate(sched.lower(sched.one_f_one_b(stages, micro), sources, dests))
    assert plain.makespan == pytest.approx(busy * (1 + (stages - 1) / micro))


def test_each_chunk_backwards_in_microbatch_order_and_text_round_trips():
    low = lowered(2, 4, 2)
    for actions in low:
        assert sched.parse(sched.format_actions(actions)) == actions
        for c in range(2):
            order = [a.microbatch for a in actions if a.kind in (sched.B, sched.FB)
                     and a.chunk == c]
            assert order == sorted(order)
    assert "F0.1" in sched.format_actions(low[0])  # chunk 1 of rank 0: virtual stage 2
    assert "sa0.1@3" in sched.format_actions(low[0])


def test_validate_catches_a_missing_chunk_and_a_wrong_peer():
    low = lowered(2, 2, 2)
    broken = [[a for a in low[0] if not (a.kind == sched.F and a.chunk == 1 and a.microbatch == 0)]
              ] + low[1:]
    with pytest.raises(ValueError, match="chunk 1"):
        sched.validate(broken, 2)
    wrong = [list(low[0]), list(low[1])]
    k = next(j for j, a in enumerate(wrong[0]) if a.kind == sched.SEND_ACT)
    wrong[0][k] = sched.Action(sched.SEND_ACT, wrong[0][k].microbatch, 2, chunk=0)
    with pytest.raises(ValueError, match="do not match"):
        sched.validate(wrong, 2)


def test_short_batch_fallback_and_inference_are_valid():
    sources, dests = virtual_chain(2, 2)
    sched.validate(sched.lower(sched.gpipe(2, 3, 2), sources, dests), 3)
    sched.validate(sched.lower(sched.forward_only(2, 3, 2), sources, dests), 3, backward=False)


IL = dict(schedule="interleaved")


@pytest.mark.parametrize("kwargs,match", [
    (dict(num_stages=2, num_microbatches=4, num_chunks=1, **IL), "num_chunks >= 2"),
    (dict(num_stages=1, num_microbatches=4, num_chunks=2, **IL), "num_stages >= 2"),
    (dict(num_stages=2, num_microbatches=3, num_chunks=2, **IL),
     "multiple of num_stages.*num_microbatches=4"),
    (dict(num_stages=2, num_microbatches=4, schedule="1f1b", num_chunks=2),
     "schedule='interleaved'"),
    (dict(num_stages=2, num_microbatches=4, num_chunks=0, **IL), "num_chunks"),
])
def test_bad_layouts_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Layout(**kwargs)


def test_tensor_splits_are_refused():
    with pytest.raises(NotImplementedError, match="num_tensor=2"):
        Layout(num_stages=2, num_microbatches=2, num_tensor=2, num_chunks=2, **IL)


# -- training: the numerical contract (thread ranks, as tests/engine/test_zero_bubble.py) ----

def test_matches_model_fit_with_batchnorm():
    """S=2, v=2 (4 virtual stages: BatchNorm in chunk 0, a layer called twice, a
    regulariser), M=4, Adam."""
    from conftest import max_diff, train_ranks
    from test_zero_bubble import BATCH, EPOCHS, build, data, fit_reference

    x, y = data()
    start, expected = fit_reference("adam", 4)
    results = train_ranks(lambda: build("adam"), x, y, num_stages=2, num_replicas=1,
                          num_microbatches=4, weights=start, batch_size=BATCH, epochs=EPOCHS,
                          shuffle=False, schedule="interleaved", num_chunks=2)
    for w, _ in results:
        assert max_diff(w, expected) <= 1e-4


def test_short_last_batch_falls_back_and_matches_model_fit():
    """67 samples in batches of 16: the last batch of 3 rows makes 3 microbatches, not a
    multiple of S=2, so that step runs the chunked GPipe order (same sums)."""
    from conftest import max_diff, reference, train_ranks
    from test_zero_bubble import build, data

    x, y = data(67)
    start, expected, _ = reference(lambda: build("sgd", bn=False), x, y, epochs=1, batch_size=16)
    results = train_ranks(lambda: build("sgd", bn=False), x, y, num_stages=2, num_replicas=1,
                          num_microbatches=4, weights=start, batch_size=16, epochs=1,
                          shuffle=False, schedule="interleaved", num_chunks=2)
    for w, _ in results:
        assert max_diff(w, expected) <= 1e-5


def test_planner_models_the_smaller_bubble():
    """Four equal layer calls and a free one, a free network: 1F1B's bubble at S=2, M=4 is
    (S-1)/(M+S-1) = 1/5; interleaved with v=2 cuts 4 virtual stages, 1/(vM+S-1) = 1/9."""
    import models
    from hyparflow import graph as G
    from hyparflow.planning import planner

    graph = G.from_model(models.mlp())
    rows = [(0.0, 1e-3, 1000, 0, 100)] * 4 + [(0.0, 0.0, 0, 0, 0)]
    free = planner.Network(0.0, 0.0)
    plain = planner.predict(graph, rows, 0.0, free, [2, 3], 64, 1, 4, "1f1b")
    chunked = planner.predict(graph, rows, 0.0, free, [1, 1, 1, 2], 64, 1, 4, "interleaved",
                              chunks=2)
    assert plain["bubble"] == pytest.approx(1 / 5)
    assert chunked["bubble"] == pytest.approx(1 / 9)
    assert chunked["step_s"] < plain["step_s"]
    assert len(chunked["memory_bytes"]) == 2  # per rank, all its chunks
    plans = planner.search(graph, rows, 0.0, free, 64, 2, schedules=("1f1b", "interleaved"))
    best = [p for p in plans if p["schedule"] == "interleaved"][0]
    layout = planner.as_layout(best)
    assert (layout.num_chunks, len(layout.balance)) == (2, 4)
