"""Stage sizes from per-layer costs: an exact contiguous partition solver; pure Python."""

__all__ = ["solve", "check_counts", "stage_costs"]


def check_counts(counts, num_items, num_stages):
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


def stage_costs(costs, counts):
    out, start = [], 0
    for c in counts:
        out.append(sum(costs[start:start + c]))
        start += c
    return out


def solve(costs, num_stages):
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
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    inf = float("inf")
    # best[k][j]: smallest max-run over the first j items cut into k runs.
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, num_stages + 1):
        for j in range(k, n - (num_stages - k) + 1):
            # best[k-1][i] grows with i and the last run's sum shrinks, so the
            # optimum sits where they cross: binary-search it.
            lo, hi = k - 1, j - 1
            while lo < hi:
                mid = (lo + hi) // 2
                if best[k - 1][mid] >= prefix[j] - prefix[mid]:
                    hi = mid
                else:
                    lo = mid + 1
            value, where = inf, lo
            for i in (lo - 1, lo):
                if k - 1 <= i < j:
                    cand = max(best[k - 1][i], prefix[j] - prefix[i])
                    if cand < value:
                        value, where = cand, i
            best[k][j], cut[k][j] = value, where
    counts, j = [], n
    for k in range(num_stages, 0, -1):
        i = cut[k][j]
        counts.append(j - i)
        j = i
    return counts[::-1]
