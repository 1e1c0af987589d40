"""Stage sizes from per-layer costs: an exact contiguous partition solver."""

from __future__ import annotations

from typing import List, Optional, Sequence, TypedDict

import numpy as np

__all__ = ["solve", "solve_limited", "check_counts", "stage_costs", "Resolved"]


class Resolved(TypedDict):
    """A balance mode turned into numbers (loop.costs.resolve), for `partition`: the
    arguments of `solve_limited`."""

    costs: List[float]               # per layer call
    speeds: Optional[List[float]]    # per stage (per chunk when interleaved); None: equal
    memory: Optional[List[float]]    # bytes per layer call, with `limit`
    limit: Optional[float]           # bytes per rank


def check_counts(counts: Sequence[int], num_items: int, num_stages: int) -> list[int]:
    """Validate a user's `balance` list; return it as a list of ints."""
    counts = list(counts)
    if len(counts) != num_stages:
        raise ValueError(
            f"`balance` must give one count per stage ({num_stages} stages). "
            f"Received: balance={counts}"
        )
    if any((not isinstance(c, int)) or c < 1 for c in counts):
        raise ValueError(
            f"Every stage needs at least one layer call: `balance` entries must be "
            f"integers >= 1. Received: balance={counts}"
        )
    if sum(counts) != num_items:
        raise ValueError(
            f"`balance` must sum to the number of layer calls in the model ({num_items}). "
            f"Received: balance={counts} (sum {sum(counts)})"
        )
    return counts


def stage_costs(costs: Sequence[float], counts: Sequence[int]) -> list[float]:
    out, start = [], 0
    for c in counts:
        out.append(sum(costs[start:start + c]))
        start += c
    return out


def solve(costs: Sequence[float], num_stages: int) -> list[int]:
    """Cut `costs` into `num_stages` non-empty contiguous runs minimising the largest sum.

    Exact dynamic programme, O(S * N log N). Ties go to the earliest
    cuts, so the result is deterministic. Returns the list of run lengths.
    """
    n = len(costs)
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1. Received: num_stages={num_stages}")
    if n < num_stages:
        raise ValueError(
            f"Cannot cut {n} layer calls into {num_stages} stages: each stage needs at "
            f"least one. Use num_stages <= {n}. Received: num_stages={num_stages}"
        )
    if any(c < 0 for c in costs):
        raise ValueError("costs must be non-negative")
    prefix = np.cumsum([0.0, *map(float, costs)])   # sequential, as a running sum
    inf = float("inf")
    # best[k][j]: smallest max-run over the first j items cut into k runs; each row
    # from the last at once, every j together (a planner's search at thousands of
    # ranks cuts ~3000 layer calls into up to 1000 stages, many times).
    best = np.full((num_stages + 1, n + 1), inf)
    cut = np.zeros((num_stages + 1, n + 1), np.int64)
    best[0, 0] = 0.0
    for k in range(1, num_stages + 1):
        last = best[k - 1]
        j = np.arange(k, n - (num_stages - k) + 1)
        # last[i] grows with i and the last run's sum shrinks, so the optimum sits
        # where they cross: binary-search it, for every j in step.
        lo, hi = np.full(j.shape, k - 1), j - 1
        while np.any(lo < hi):
            mid = (lo + hi) // 2
            crossed = last[mid] >= prefix[j] - prefix[mid]
            going = lo < hi
            hi = np.where(going & crossed, mid, hi)
            lo = np.where(going & ~crossed, mid + 1, lo)
        value, where = np.full(j.shape, inf), lo.copy()
        for i in (lo - 1, lo):   # the earlier cut first: it wins ties
            ok = (k - 1 <= i) & (i < j)
            at = np.where(ok, i, 0)
            cand = np.where(ok, np.maximum(last[at], prefix[j] - prefix[at]), inf)
            better = cand < value
            value, where = np.where(better, cand, value), np.where(better, i, where)
        best[k, j], cut[k, j] = value, where
    counts: list[int] = []
    end = n
    for k in range(num_stages, 0, -1):
        begin = int(cut[k, end])
        counts.append(end - begin)
        end = begin
    return counts[::-1]


def solve_limited(costs: Sequence[float], num_stages: int,
                  speeds: Optional[Sequence[float]] = None,
                  memory: Optional[Sequence[float]] = None,
                  limit: Optional[float] = None) -> list[int]:
    """Contiguous cut into `num_stages` runs minimising the slowest stage's time,
    where stage s takes `sum(costs) / speeds[s]`, and (with `limit`) keeping each
    stage's `sum(memory)` within `limit`. Speeds let a rank twice as fast take about
    twice the work (heterogeneous ranks).

    Exact up to float resolution: a binary search on the stage time with an exact
    O(S N) feasibility test.
    Raises ValueError when no cut fits the memory limit."""
    n = len(costs)
    if n < num_stages:
        raise ValueError(
            f"Cannot cut {n} layer calls into {num_stages} stages: each stage needs at "
            f"least one. Use num_stages <= {n}. Received: num_stages={num_stages}")
    speeds = list(speeds) if speeds is not None else [1.0] * num_stages
    if len(speeds) != num_stages or min(speeds) <= 0:
        raise ValueError(f"`speeds` must give one positive speed per stage. Received: {speeds}")
    memory = list(memory) if memory is not None else [0.0] * n
    if limit is not None and max(memory) > limit:
        worst = max(range(n), key=lambda i: memory[i])
        raise ValueError(f"Layer call {worst} alone needs {memory[worst]:.4g} bytes, more than the "
                         f"per-rank limit {limit:.4g}: no cut fits.")

    prefix_cost, prefix_mem = [0.0], [0.0]
    for c, m in zip(costs, memory):
        prefix_cost.append(prefix_cost[-1] + c)
        prefix_mem.append(prefix_mem[-1] + m)

    def cut(t: float) -> Optional[list[int]]:
        """Stage counts with every stage within time t (and memory), or None.

        reachable[i]: stages 0..s-1 can cover exactly items 0..i-1. For stage s,
        furthest[i] is the largest j such that items i..j-1 fit; it never
        decreases with i, so for each j the latest reachable i < j is the one to
        try. O(S N) per test."""
        reachable = [False] * (n + 1)
        reachable[0] = True
        back = []
        for s in range(num_stages):
            cap = t * speeds[s]
            furthest, j = [0] * n, 0
            for i in range(n):
                j = max(j, i)
                while (j < n and prefix_cost[j + 1] - prefix_cost[i] <= cap + 1e-12
                       and (limit is None or prefix_mem[j + 1] - prefix_mem[i] <= limit)):
                    j += 1
                furthest[i] = j
            nxt, frm, last = [False] * (n + 1), [-1] * (n + 1), -1
            for k in range(1, n + 1):
                if reachable[k - 1]:
                    last = k - 1
                if last >= 0 and furthest[last] >= k:
                    nxt[k], frm[k] = True, last
            reachable = nxt
            back.append(frm)
        if not reachable[n]:
            return None
        counts, j = [], n
        for s in range(num_stages - 1, -1, -1):
            i = back[s][j]
            counts.append(j - i)
            j = i
        return counts[::-1]

    lo, hi = 0.0, sum(costs) / min(speeds) + 1e-12
    best = cut(hi)
    if best is None:
        raise ValueError(f"No cut into {num_stages} stages keeps every stage within the memory "
                         f"limit {limit:.4g}; use more stages or ranks with more memory.")
    for _ in range(100):
        mid = (lo + hi) / 2
        counts = cut(mid)
        if counts is None:
            lo = mid
        else:
            hi, best = mid, counts
        if hi - lo <= 1e-12 * max(1.0, hi):
            break
    return best
