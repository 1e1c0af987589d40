"""The schedules' builders: compute-only lists (F, B, W), one per rank, for S stages
and M microbatches. `table.TABLE` names them; nothing else should call a builder by
name."""

from __future__ import annotations

from typing import Sequence

from .actions import (ALLREDUCE, B, F, FB, RECV_ACT, RECV_GRAD, SEND_ACT, SEND_GRAD, STEP, W,
                      Action, chunks_of, splits)

Lists = list[list[Action]]

__all__ = ["gpipe", "one_f_one_b", "interleaved", "check_interleaved", "zb_h1", "zb_batched",
           "one_f_one_b_w", "forward_only"]


def _check_sizes(num_stages: int, num_microbatches: int) -> None:
    if num_stages < 1 or num_microbatches < 1:
        raise ValueError(
            "A schedule needs num_stages >= 1 and num_microbatches >= 1. "
            f"Received: num_stages={num_stages}, num_microbatches={num_microbatches}"
        )


def gpipe(num_stages: int, num_microbatches: int, chunks: int = 1) -> Lists:
    """All forwards, then all backwards (GPipe); M activations alive per stage. With
    model chunks, forwards chunk by chunk and backwards from the last chunk down (any
    M: what the interleaved schedule falls back to for a short last batch)."""
    _check_sizes(num_stages, num_microbatches)
    m = range(num_microbatches)
    return [[Action(F, i, chunk=c) for c in range(chunks) for i in m]
            + [Action(B, i, chunk=c) for c in reversed(range(chunks)) for i in m]
            for _ in range(num_stages)]


def one_f_one_b(num_stages: int, num_microbatches: int) -> Lists:
    """PipeDream-Flush: warm-up forwards, then one forward one backward, then drain.

    Stage s keeps at most S - s microbatches of activations alive, and
    microbatches are backwarded in the same order as with `gpipe`, so both
    accumulate the same gradients in the same order.
    """
    _check_sizes(num_stages, num_microbatches)
    lists = []
    for s in range(num_stages):
        warm = min(num_stages - s - 1, num_microbatches)
        actions = [Action(F, i) for i in range(warm)]
        backward = 0
        for i in range(warm, num_microbatches):
            actions.append(Action(F, i))
            actions.append(Action(B, backward))
            backward += 1
        actions += [Action(B, i) for i in range(backward, num_microbatches)]
        lists.append(actions)
    return lists


def interleaved(num_stages: int, num_microbatches: int, chunks: int = 2) -> Lists:
    """Interleaved 1F1B (Megatron-LM's virtual pipeline, Narayanan et al. SC'21): the
    model is cut into S * v virtual stages and rank s runs chunks c = 0 .. v-1 as
    virtual stages s, s + S, s + 2S, ...; one list per rank, each action naming its
    chunk. Forwards go through the chunks in groups of S microbatches (chunk 0 of
    microbatches 0..S-1, then chunk 1 of the same, ...), backwards likewise from the
    last chunk down; rank s warms up with 2 (S - s - 1) + (v - 1) S forwards, then
    alternates, then drains. With compute split evenly, the bubble is (S-1) chunk
    times at each end: (S - 1) / (v M) of the ideal time instead of (S - 1) / M.

    Each chunk backwards its microbatches in increasing order, as `gpipe` does, so
    gradients sum in the same order. Needs M a multiple of S (as Megatron does)."""
    _check_sizes(num_stages, num_microbatches)
    check_interleaved(num_stages, num_microbatches, chunks)
    S, M, v = num_stages, num_microbatches, chunks
    total = M * v

    def nth(k: int, forward: bool) -> tuple[int, int]:
        """The k-th forward (or backward) of a rank: (chunk, microbatch)."""
        chunk = (k % (S * v)) // S
        return (chunk if forward else v - 1 - chunk), (k // (S * v)) * S + k % S

    lists = []
    for s in range(S):
        warm = total if M == S else min((S - s - 1) * 2 + (v - 1) * S, total)
        actions = []
        for k in range(warm):
            c, i = nth(k, True)
            actions.append(Action(F, i, chunk=c))
        for k in range(total - warm):
            c, i = nth(k + warm, True)
            actions.append(Action(F, i, chunk=c))
            c, i = nth(k, False)
            actions.append(Action(B, i, chunk=c))
        for k in range(total - warm, total):
            c, i = nth(k, False)
            actions.append(Action(B, i, chunk=c))
        lists.append(actions)
    return lists


def check_interleaved(num_stages: int, num_microbatches: int, chunks: int) -> None:
    """Clear errors for what interleaving needs: v >= 2 chunks, S >= 2, M % S == 0."""
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 2:
        raise ValueError(f"schedule='interleaved' needs num_chunks >= 2 model chunks per "
                         f"rank (1 is plain '1f1b'). Received: num_chunks={chunks!r}")
    if num_stages < 2:
        raise ValueError(f"schedule='interleaved' needs num_stages >= 2 (one stage has no "
                         f"pipeline bubble to shrink). Received: num_stages={num_stages}")
    if num_microbatches % num_stages:
        raise ValueError(
            f"schedule='interleaved' needs num_microbatches to be a multiple of num_stages "
            f"(microbatches go through the chunks in groups of num_stages, as in Megatron-LM). "
            f"Received: num_microbatches={num_microbatches}, num_stages={num_stages}; use "
            f"num_microbatches={-(-num_microbatches // num_stages) * num_stages}.")


def _greedy(num_stages: int, num_microbatches: int, batch_w: bool) -> Lists:
    """A split-backward schedule found by playing the pipeline with unit-time F, B
    and W (as Qi et al. build theirs). Each stage, when it can, starts what can
    start earliest, B before F before W at equal times: the oldest B whose gradient
    has come; the next F while fewer than S - s microbatches are alive on stage s;
    deferred W work.

    Without `batch_w` (ZB-H1) a microbatch is alive from its F to its W (1F1B's
    memory) and each W is one microbatch's. With `batch_w` it is alive from F to B
    (1F1B's tapes), and W runs only when the stage would otherwise wait (or has
    nothing else left), for every microbatch waiting, in one call.

    B's come in microbatch order on every stage, as with `gpipe` and `one_f_one_b`,
    so the inputs' gradients sum in the same order."""
    S, M = num_stages, num_microbatches
    lists: Lists = [[] for _ in range(S)]
    free = [0] * S                             # when each stage is next free
    f_end: list[list[int | None]] = [[None] * M for _ in range(S)]
    b_end: list[list[int | None]] = [[None] * M for _ in range(S)]
    nf, nb, nw = [0] * S, [0] * S, [0] * S
    while any(nw[s] < M for s in range(S)):
        best = None  # (start, priority, stage, kind)
        for s in range(S):
            options = []
            if nb[s] < nf[s]:
                ready = b_end[s + 1][nb[s]] if s + 1 < S else f_end[s][nb[s]]
                if ready is not None:
                    options.append((max(free[s], ready), 0, s, B))
            alive = nf[s] - (nb[s] if batch_w else nw[s])
            if nf[s] < M and alive < S - s:
                ready = f_end[s - 1][nf[s]] if s > 0 else 0
                if ready is not None:
                    options.append((max(free[s], ready), 1, s, F))
            if nw[s] < nb[s]:
                soonest = min((o[0] for o in options), default=None)
                if not batch_w or soonest is None or soonest > free[s]:
                    options.append((free[s], 2, s, W))
            for o in options:
                if best is None or o[:3] < best[:3]:
                    best = o
        if best is None:
            raise RuntimeError("no stage can move")  # cannot happen: B's always come
        start, _, s, kind = best
        length = 1
        if kind == B:
            lists[s].append(Action(B, nb[s]))
            b_end[s][nb[s]] = start + 1
            nb[s] += 1
        elif kind == F:
            lists[s].append(Action(F, nf[s]))
            f_end[s][nf[s]] = start + 1
            nf[s] += 1
        else:
            length = nb[s] - nw[s] if batch_w else 1
            lists[s].append(Action(W, nw[s], count=length))
            nw[s] += length
        free[s] = start + length
    return lists


def zb_h1(num_stages: int, num_microbatches: int) -> Lists:
    """ZB-H1 (Qi et al.): 1F1B with each backward split into B and W, W filling
    the waits. At most S - s microbatches alive on stage s from F to W, as
    1F1B's activations from F to B."""
    _check_sizes(num_stages, num_microbatches)
    return _greedy(num_stages, num_microbatches, batch_w=False)


def zb_batched(num_stages: int, num_microbatches: int) -> Lists:
    """Zero-bubble with batched W: F's and B's with 1F1B's bound (at most S - s
    microbatches' tapes alive on stage s), and W only where the stage would wait
    (and at its end), for every microbatch waiting, in one call over their
    concatenated rows. Costs, besides 1F1B's memory, the kept inputs and output
    gradients of the deferred layers for up to M microbatches (the replica's
    batch)."""
    _check_sizes(num_stages, num_microbatches)
    return _greedy(num_stages, num_microbatches, batch_w=True)


def one_f_one_b_w(num_stages: int, num_microbatches: int) -> Lists:
    """1F1B's order with the backward split: each B computes only what the stage's
    inputs need (so the gradient goes upstream sooner, and the drain is shorter),
    and one W at the end computes every deferred weight gradient over the whole
    replica batch's rows, where the products run fastest and no per-microbatch
    gradient is summed. Costs, besides 1F1B's memory, the kept inputs and output
    gradients of the deferred layers for the M microbatches (the replica's batch)."""
    lists = one_f_one_b(num_stages, num_microbatches)
    return [actions + [Action(W, 0, count=num_microbatches)] for actions in lists]


def forward_only(num_stages: int, num_microbatches: int, chunks: int = 1) -> Lists:
    """Inference: every stage forwards each microbatch in order, no backward (with
    model chunks, chunk by chunk: a rank's chunk c needs only earlier chunks)."""
    _check_sizes(num_stages, num_microbatches)
    return [[Action(F, i, chunk=c) for c in range(chunks) for i in range(num_microbatches)]
            for _ in range(num_stages)]
