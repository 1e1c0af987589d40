"""The contiguous partition solver against brute force, and the topology."""

import itertools
import random

import pytest

from hyparflow.balance import check_counts, solve, stage_costs
from hyparflow.topology import Topology


def brute_force(costs, stages):
    n = len(costs)
    best = None
    for cuts in itertools.combinations(range(1, n), stages - 1):
        bounds = [0, *cuts, n]
        worst = max(sum(costs[bounds[i]:bounds[i + 1]]) for i in range(stages))
        best = worst if best is None else min(best, worst)
    return best


def test_solver_is_optimal_on_small_cases():
    rng = random.Random(0)
    for _ in range(1500):
        n = rng.randint(1, 9)
        stages = rng.randint(1, n)
        costs = [rng.choice([0, 1, 2, 3, 5, 8, 13]) for _ in range(n)]
        counts = solve(costs, stages)
        assert len(counts) == stages and min(counts) >= 1 and sum(counts) == n
        assert max(stage_costs(costs, counts)) == brute_force(costs, stages)


def test_solver_errors():
    with pytest.raises(ValueError, match="Use num_stages <= 2"):
        solve([1, 2], 3)
    with pytest.raises(ValueError, match="at least one layer call"):
        check_counts([0, 3], 3, 2)


def test_topology_places_a_replica_on_consecutive_ranks():
    topo = Topology(3, 2)
    assert topo.size == 6
    assert [topo.rank(s, 1) for s in range(3)] == [3, 4, 5] == topo.pipeline_ranks(1)
    assert topo.stage_ranks(2) == [2, 5]
    assert all(topo.rank(topo.stage(r), topo.replica(r)) == r for r in range(6))
    with pytest.raises(ValueError):
        Topology(0, 1)


def brute_limited(costs, stages, speeds, memory, limit):
    n = len(costs)
    best = None
    for cuts in itertools.combinations(range(1, n), stages - 1):
        b = [0, *cuts, n]
        if any(sum(memory[b[i]:b[i + 1]]) > limit for i in range(stages)):
            continue
        worst = max(sum(costs[b[i]:b[i + 1]]) / speeds[i] for i in range(stages))
        best = worst if best is None else min(best, worst)
    return best


def test_limited_solver_with_speeds_and_memory_is_optimal():
    from hyparflow.balance import solve_limited

    rng = random.Random(1)
    checked = 0
    for _ in range(1500):
        n = rng.randint(1, 8)
        stages = rng.randint(1, n)
        costs = [rng.randint(0, 9) for _ in range(n)]
        memory = [rng.randint(0, 5) for _ in range(n)]
        speeds = [rng.choice([1.0, 2.0, 0.5]) for _ in range(stages)]
        limit = rng.randint(5, 20)
        want = brute_limited(costs, stages, speeds, memory, limit)
        if want is None:
            with pytest.raises(ValueError):
                solve_limited(costs, stages, speeds, memory, limit)
            continue
        counts = solve_limited(costs, stages, speeds, memory, limit)
        b = [0]
        for c in counts:
            b.append(b[-1] + c)
        assert len(counts) == stages and min(counts) >= 1
        assert all(sum(memory[b[i]:b[i + 1]]) <= limit for i in range(stages))
        got = max(sum(costs[b[i]:b[i + 1]]) / speeds[i] for i in range(stages))
        assert got == pytest.approx(want, rel=1e-9, abs=1e-9)
        checked += 1
    assert checked > 500


def test_a_rank_twice_as_fast_gets_twice_the_work():
    from hyparflow.balance import solve_limited

    assert solve_limited([1.0] * 30, 2, speeds=[2.0, 1.0]) == [20, 10]
