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
