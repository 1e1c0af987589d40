"""Schedules as data: builders, lowering, validation and simulation (no TF, no MPI)."""

import pytest

from hyparflow import schedules as sched


def test_gpipe_reads_like_the_paper():
    assert [sched.format_actions(a) for a in sched.gpipe(2, 3)] == ["F0 F1 F2 B0 B1 B2"] * 2


def test_one_f_one_b_warms_up_then_alternates():
    lists = sched.one_f_one_b(3, 4)
    assert sched.format_actions(lists[0]) == "F0 F1 F2 B0 F3 B1 B2 B3"
    assert sched.format_actions(lists[1]) == "F0 F1 B0 F2 B1 F3 B2 B3"
    assert sched.format_actions(lists[2]) == "F0 B0 F1 B1 F2 B2 F3 B3"


def test_parse_is_the_inverse_of_format():
    text = "ra0@0 F0 sa0@2 rg0@2 B0 sg0@0 ALLREDUCE STEP"
    assert sched.format_actions(sched.parse(text)) == text


def chain(n):
    return [[s - 1] if s else [] for s in range(n)], [[s + 1] if s < n - 1 else [] for s in range(n)]


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages,micro", [(1, 1), (2, 4), (3, 3), (4, 8), (4, 2)])
def test_lowered_schedules_validate_and_run(name, stages, micro):
    sources, dests = chain(stages)
    lowered = sched.lower(sched.build(name, stages, micro), sources, dests)
    sched.validate(lowered, micro)
    result = sched.simulate(lowered, forward_time=1, backward_time=1)
    # Equal forward and backward times: the classic bubble (S-1)/(M+S-1).
    assert result.bubble == pytest.approx((stages - 1) / (micro + stages - 1))
    if name == "1f1b":
        assert result.peak_activations == [min(stages - s, micro) for s in range(stages)]
    else:
        assert result.peak_activations == [micro] * stages


def test_skip_edges_lower_to_direct_messages():
    # Stage 0 feeds stages 1 and 2 directly (a skip connection over stage 1).
    sources, dests = [[], [0], [0, 1]], [[1, 2], [2], []]
    lowered = sched.lower(sched.gpipe(3, 2), sources, dests)
    sched.validate(lowered, 2)
    assert sched.format_actions(lowered[0][:3]) == "F0 sa0@1 sa0@2"
    assert sched.simulate(lowered).makespan > 0


def test_validate_catches_mistakes():
    with pytest.raises(ValueError, match="before its forward"):
        sched.validate([sched.parse("B0 F0")], 1)
    with pytest.raises(ValueError, match="forwarded twice"):
        sched.validate([sched.parse("F0 F0 B0")], 1)
    with pytest.raises(ValueError, match="do not match"):
        sched.validate([sched.parse("F0 sa0@1 B0"), sched.parse("F0 B0")], 1)


def test_simulate_reports_deadlock():
    # Both stages wait for each other's activations first.
    lowered = [sched.parse("ra0@1 F0 sa0@1 B0"), sched.parse("ra0@0 F0 sa0@0 B0")]
    with pytest.raises(RuntimeError, match="deadlocks"):
        sched.simulate(lowered)


@pytest.mark.parametrize("name,stages,micro", [("gpipe", 3, 4), ("1f1b", 4, 8), ("1f1b", 2, 1)])
def test_shared_play_without_contention_is_the_plain_play(name, stages, micro):
    lowered = sched.lower(sched.build(name, stages, micro),
                          [[s - 1] if s else [] for s in range(stages)],
                          [[s + 1] if s < stages - 1 else [] for s in range(stages)])
    f, b = [1.0, 2.5, 0.5, 1.5][:stages], [2.0, 4.0, 1.5, 3.5][:stages]
    for latency in (0.0, 0.3):
        plain = sched.simulate(lowered, f, b, latency=latency)
        shared = sched.simulate(lowered, f, b, slowdown=lambda busy: 1.0, copies=3,
                                latency=latency)
        assert shared.makespan == pytest.approx(plain.makespan)
        assert shared.busy == pytest.approx(plain.busy)
        assert shared.peak_activations == plain.peak_activations
        tail = [0.7, 0.0, 2.0, 0.1][:stages]
        assert sched.simulate(lowered, f, b, slowdown=lambda busy: 1.0, latency=latency,
                              tail=tail).finish == pytest.approx(
            sched.simulate(lowered, f, b, latency=latency, tail=tail).finish)


def test_latency_holds_up_only_a_receiver_that_waits():
    # One microbatch over two stages: both messages are waited for.
    lowered = sched.lower(sched.gpipe(2, 1), [[], [0]], [[1], []])
    for slowdown in (None, lambda busy: busy):
        assert sched.simulate(lowered, 1.0, 2.0, slowdown=slowdown,
                              latency=0.25).makespan == pytest.approx(6.5)
    # Stage 1 is slow: stage 0's later activations arrive while it still computes,
    # so only the first forward and the first gradient (that stage 0 waits
    # for) pay the latency.
    lowered = sched.lower(sched.gpipe(2, 3), [[], [0]], [[1], []])
    base = sched.simulate(lowered, [1.0, 5.0], [1.0, 5.0]).makespan
    assert sched.simulate(lowered, [1.0, 5.0], [1.0, 5.0],
                          latency=0.25).makespan == pytest.approx(base + 0.5)


def test_a_network_link_carries_one_message_at_a_time():
    # Activations 0 -> 1 take 1.5 s on the link, longer than a forward (1 s): they
    # arrive at 2.5, then 4.0 and 5.5 (queued behind each other, not 3.5 and 4.5).
    # Stage 1's forwards end at 6.5, its backwards at 9.5; their gradients (instant)
    # reach stage 0, whose last backward ends at 10.5.
    lowered = sched.lower(sched.gpipe(2, 3), [[], [0]], [[1], []])
    for slowdown in (None, lambda busy: 1.0):
        sim = sched.simulate(lowered, 1.0, 1.0, slowdown=slowdown,
                             transfer={("act", 0, 1): 1.5})
        assert sim.makespan == pytest.approx(10.5)
    # Shorter than a forward, the link never queues: every message pays its 0.5 s once
    # on the way in, and the gradients back too, on their own link.
    base = sched.simulate(lowered, 1.0, 1.0).makespan
    sim = sched.simulate(lowered, 1.0, 1.0, transfer={("act", 0, 1): 0.5, ("grad", 1, 0): 0.5})
    assert sim.makespan == pytest.approx(base + 1.0)


def test_a_stage_s_tail_follows_its_own_last_backward():
    # One microbatch over two stages: stage 1's backward ends at 4, stage 0's at 6.
    lowered = sched.lower(sched.gpipe(2, 1), [[], [0]], [[1], []])
    plain = sched.simulate(lowered, 1.0, 2.0, tail=[0.5, 1.5])
    assert plain.makespan == pytest.approx(6.0)
    assert plain.finish == pytest.approx(6.5)      # stage 1's tail ran in stage 0's backward
    assert sched.simulate(lowered, 1.0, 2.0, tail=[0.5, 3.0]).finish == pytest.approx(7.0)
    assert sched.simulate(lowered, 1.0, 2.0).finish == plain.makespan
    # On one core, stage 1's tail takes half of it from stage 0's backward: both
    # end together, all the work in a row (1 + 1 + 2 + 2 + 1.5 + 0.5).
    one_core = sched.simulate(lowered, 1.0, 2.0, slowdown=lambda busy: busy, tail=[0.5, 1.5])
    assert one_core.finish == pytest.approx(8.0)
    assert one_core.makespan == pytest.approx(7.5)  # the pipeline's end: without tails
    assert one_core.bubble == pytest.approx(0.5)


def test_stages_on_one_core_take_turns():
    # Two stages on one core: whenever both compute, each goes at half speed, and the
    # core never idles once work has reached it, so the step is all the work in a row.
    lowered = sched.lower(sched.gpipe(2, 4), [[], [0]], [[1], []])
    one_core = sched.simulate(lowered, 1.0, 2.0, slowdown=lambda busy: busy)
    assert one_core.makespan == pytest.approx(2 * 4 * 3.0)
    assert sched.simulate(lowered, 1.0, 2.0).makespan < 20
    # Two replicas of the pipeline on the same core: twice as long again.
    assert sched.simulate(lowered, 1.0, 2.0, slowdown=lambda busy: busy,
                          copies=2).makespan == pytest.approx(48.0)
    with pytest.raises(RuntimeError, match="deadlocks"):
        sched.simulate([sched.parse("ra0@1 F0 sa0@1 B0"), sched.parse("ra0@0 F0 sa0@0 B0")],
                       slowdown=lambda busy: busy)


def test_unknown_schedule_names_the_choices():
    with pytest.raises(ValueError, match=r"choose one of \['1f1b', '1f1b-w', 'gpipe', 'interleaved', 'zb-batched', 'zb-h1'\]"):
        sched.build("zigzag", 2, 2)


def test_waits_in_a_computation_pass_at_full_speed_and_take_no_core():
    # One microbatch over two stages, each F 1 + a 1 s wait, each B 2 + a 1 s wait.
    lowered = sched.lower(sched.gpipe(2, 1), [[], [0]], [[1], []])
    waits = [(1.0, 1.0), (1.0, 1.0)]
    assert sched.simulate(lowered, 1.0, 2.0, waits=waits).makespan == pytest.approx(10.0)
    # Shared cores slow the work, never the waits: 2 copies on one core, doubled work.
    shared = sched.simulate(lowered, 1.0, 2.0, slowdown=lambda busy: busy, copies=2,
                            waits=waits)
    assert shared.makespan == pytest.approx(4 * 1.0 + 2 * (1 + 1 + 2 + 2))
    # On one core, stage 1's 2 s tail (from 7) runs at full speed during stage 0's
    # backward wait (7-8), then the two halve: the tail ends at 10, the backward at 11.
    one_core = sched.simulate(lowered, 1.0, 2.0, slowdown=lambda busy: busy,
                              tail=[0.0, 2.0], waits=waits)
    assert one_core.makespan == pytest.approx(11.0) and one_core.finish == pytest.approx(11.0)


# -- split backward: B and W ---------------------------------------------------
@pytest.mark.parametrize("name", ["1f1b-w", "zb-h1", "zb-batched"])
@pytest.mark.parametrize("stages,micro", [(1, 1), (2, 1), (2, 4), (3, 3), (4, 8), (4, 2), (3, 7)])
def test_split_schedules_validate_and_beat_1f1b(name, stages, micro):
    sources, dests = chain(stages)
    lowered = sched.lower(sched.fuse(sched.build(name, stages, micro), dests), sources, dests)
    sched.validate(lowered, micro)
    # B in microbatch order on every stage (the inputs' gradients sum as with 1F1B).
    for actions in lowered:
        assert [a.microbatch for a in actions if a.kind in (sched.B, sched.FB)] == list(range(micro))
    # F = B = W = 1 against 1F1B's F = 1, B = 2: never longer, and shorter once
    # there is a bubble to fill.
    split = sched.simulate(lowered, 1.0, 1.0, weight_time=1.0)
    base = sched.simulate(sched.lower(sched.build("1f1b", stages, micro), sources, dests), 1.0, 2.0)
    assert split.makespan <= base.makespan
    if stages > 1 and micro >= 2:
        assert split.makespan < base.makespan
    # 1F1B's tapes alive at most (F to B).
    assert split.peak_activations == [min(stages - s, micro) for s in range(stages)]
    if name == "zb-h1":
        assert all(a.count == 1 for actions in lowered for a in actions if a.kind == sched.W)
        assert max(split.peak_kept) <= 1 or stages > 2


def test_1f1b_w_is_1f1b_then_one_weight_call_over_every_microbatch():
    lists = sched.one_f_one_b_w(3, 4)
    for plain, split in zip(sched.one_f_one_b(3, 4), lists):
        assert split[:-1] == plain and sched.format_actions(split[-1:]) == "W0-3"


def test_zb_h1_keeps_1f1b_memory_from_forward_to_weights():
    for stages, micro in [(2, 8), (4, 8), (3, 5)]:
        for s, actions in enumerate(sched.zb_h1(stages, micro)):
            alive = peak = 0
            for a in actions:
                alive += {sched.F: 1, sched.W: -a.count}.get(a.kind, 0)
                peak = max(peak, alive)
            assert peak <= stages - s


def test_zb_batched_runs_weights_of_many_microbatches_in_one_call():
    lists = sched.zb_batched(2, 8)
    assert sched.format_actions(lists[1]) == "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7 W0-7"
    assert sched.format_actions(lists[0]).endswith("B6 W0-6 B7 W7")
    assert sched.format_actions(sched.parse("W0-6 W7 FB3")) == "W0-6 W7 FB3"
    # Batched weights cheaper per microbatch (what the kernels gain at more rows):
    # the batched schedule then wins over ZB-H1's one-at-a-time W.
    sources, dests = chain(2)
    cost = lambda s, k: 0.6 * k + 0.4  # noqa: E731
    batched = sched.simulate(sched.lower(sched.fuse(lists, dests), sources, dests), 1.0, 1.0,
                             weight_time=cost)
    h1 = sched.simulate(sched.lower(sched.fuse(sched.zb_h1(2, 8), dests), sources, dests),
                        1.0, 1.0, weight_time=cost)
    assert batched.makespan < h1.makespan
    assert batched.peak_kept == [7, 8]


def test_fuse_marks_the_forward_and_backward_done_in_one_call():
    sources, dests = chain(2)
    assert [sched.format_actions(a) for a in sched.fuse(sched.one_f_one_b(2, 2), dests)] == [
        "F0 F1 B0 B1", "FB0 FB1"]
    # GPipe with one microbatch fuses too (the planner once said it did not).
    assert sched.format_actions(sched.fuse(sched.gpipe(2, 1), dests)[1]) == "FB0"
    assert sched.format_actions(sched.fuse(sched.gpipe(2, 2), dests)[1]) == "F0 F1 B0 B1"
    # With recompute nothing fuses (the executor and the planner agree).
    assert sched.format_actions(sched.fuse(sched.one_f_one_b(2, 2), dests, recompute=True)[1]) \
        == "F0 B0 F1 B1"
    lowered = sched.lower(sched.fuse(sched.one_f_one_b(2, 2), dests), sources, dests)
    assert sched.format_actions(lowered[1]) == "ra0@0 FB0 sg0@0 ra1@0 FB1 sg1@0 ALLREDUCE STEP"
    sched.validate(lowered, 2)


def test_validate_catches_split_mistakes():
    with pytest.raises(ValueError, match="before its B"):
        sched.validate([sched.parse("F0 W0 B0")], 1)
    with pytest.raises(ValueError, match="computed twice"):
        sched.validate([sched.parse("F0 B0 W0 W0")], 1)
    with pytest.raises(ValueError, match="must compute them"):
        sched.validate([sched.parse("F0 B0 F1 B1 W0")], 2)
