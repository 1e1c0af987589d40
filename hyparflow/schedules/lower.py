"""From compute lists to a step program: `fuse` (a forward and its backward in one call
where they come back to back on a stage that sends nothing), `lower` (the messages,
the allreduce and the optimizer step) and `validate`."""

from __future__ import annotations

from typing import Sequence

from .actions import (ALLREDUCE, B, F, FB, RECV_ACT, RECV_GRAD, SEND_ACT, SEND_GRAD, STEP, W,
                      Action, chunks_of, message, splits)

Lists = list[list[Action]]

__all__ = ["fuse", "lower", "validate"]


def fuse(compute: Sequence[Sequence[Action]], dests: Sequence[Sequence[int]],
         recompute: bool = False) -> Lists:
    """Replace, on each stage that sends no activations (the last), every F followed
    at once by the B of the same microbatch with one `FB` action: forward and
    backward in one compiled call, no tape kept between two calls. Not with
    `recompute` (whose point is to keep no forward's intermediates across calls;
    fused, a stage keeps them only inside the call, so fusing would be allowed, but
    the recomputed backward is what the user asked to measure)."""
    if recompute:
        return [list(a) for a in compute]
    out, n = [], len(compute)
    for s, actions in enumerate(compute):
        if all(dests[s + c * n] for c in range(chunks_of([actions]))):
            out.append(list(actions))
            continue
        fused, k = [], 0
        while k < len(actions):
            a = actions[k]
            nxt = actions[k + 1] if k + 1 < len(actions) else None
            if (a.kind == F and nxt is not None and nxt.kind == B and nxt.chunk == a.chunk
                    and nxt.microbatch == a.microbatch and not dests[s + a.chunk * n]):
                fused.append(Action(FB, a.microbatch, chunk=a.chunk))
                k += 2
            else:
                fused.append(a)
                k += 1
        out.append(fused)
    return out


def lower(compute: Sequence[Sequence[Action]], sources: Sequence[Sequence[int]],
          dests: Sequence[Sequence[int]]) -> Lists:
    """Insert communication into compute-only lists.

    `sources[s]`: stages that send activations to stage s (its gradients go
    back to them); `dests[s]`: stages stage s sends activations to. With model
    chunks (interleaved), these are virtual stages: chunk c of rank s is virtual
    stage s + c * len(compute), and every message's peer is a virtual stage. Every
    forward is preceded by its receives and followed by its sends; every
    backward is preceded by the gradient receives and followed by the gradient
    sends. The step ends with `ALLREDUCE` and `STEP` on every stage.
    """
    lowered, n = [], len(compute)
    for s, actions in enumerate(compute):
        out = []
        for a in actions:
            v, i, c = s + a.chunk * n, a.microbatch, a.chunk
            if a.kind == F:
                out += [Action(RECV_ACT, i, p, chunk=c) for p in sources[v]]
                out.append(a)
                out += [Action(SEND_ACT, i, p, chunk=c) for p in dests[v]]
            elif a.kind == B:
                out += [Action(RECV_GRAD, i, p, chunk=c) for p in dests[v]]
                out.append(a)
                out += [Action(SEND_GRAD, i, p, chunk=c) for p in sources[v]]
            elif a.kind == FB:
                out += [Action(RECV_ACT, i, p, chunk=c) for p in sources[v]]
                out += [Action(RECV_GRAD, i, p, chunk=c) for p in dests[v]]
                out.append(a)
                out += [Action(SEND_GRAD, i, p, chunk=c) for p in sources[v]]
            else:
                out.append(a)
        lowered.append(out + [Action(ALLREDUCE), Action(STEP)])
    return lowered


def validate(lowered: Sequence[Sequence[Action]], num_microbatches: int,
             backward: bool = True) -> None:
    """Raise ValueError unless every stage forwards and (with `backward`) backwards
    each microbatch once, backward after forward, and every receive has a
    matching send. A stage that splits its backward (W actions) computes the
    weights of every microbatch once, each after its B. With model chunks
    (interleaved), each rank does all this for every one of its chunks, and
    messages are matched between virtual stages."""
    sends: dict[tuple[object, ...], int] = {}
    recvs: dict[tuple[object, ...], int] = {}
    n, chunks = len(lowered), chunks_of(lowered)
    for s, actions in enumerate(lowered):
        done_f: set[tuple[int, int]] = set()
        done_b: set[tuple[int, int]] = set()
        done_w: set[tuple[int, int]] = set()
        for a in actions:
            where = f"stage {s}" if chunks == 1 else f"stage {s} chunk {a.chunk}"
            key = (a.chunk, a.microbatch)
            if a.kind in (F, FB):
                if key in done_f:
                    raise ValueError(f"{where}: microbatch {a.microbatch} forwarded twice")
                done_f.add(key)
            if a.kind in (B, FB):
                if key not in done_f:
                    raise ValueError(f"{where}: backward of {a.microbatch} before its forward")
                if key in done_b:
                    raise ValueError(f"{where}: microbatch {a.microbatch} backwarded twice")
                done_b.add(key)
            elif a.kind == W:
                for i in a.microbatches:
                    if (a.chunk, i) not in done_b:
                        raise ValueError(f"{where}: weights of {i} ({a}) before its B")
                    if (a.chunk, i) in done_w:
                        raise ValueError(f"{where}: weights of {i} computed twice ({a})")
                    done_w.add((a.chunk, i))
            elif a.kind in (SEND_ACT, SEND_GRAD, RECV_ACT, RECV_GRAD):
                table = sends if a.kind in (SEND_ACT, SEND_GRAD) else recvs
                about = message(a, s, n)
                table[about] = table.get(about, 0) + 1
        expected = {(c, i) for c in range(chunks) for i in range(num_microbatches)}
        if done_f != expected or done_b != (expected if backward else set()):
            def show(done: set[tuple[int, int]]) -> list[tuple[int, int]] | list[int]:
                return sorted(done) if chunks > 1 else sorted(i for _, i in done)
            raise ValueError(
                f"stage {s}: forwards {show(done_f)} and backwards {show(done_b)} "
                f"must each be {show(expected)}"
            )
        if done_w and done_w != expected:
            raise ValueError(f"stage {s}: weights of {sorted(i for _, i in done_w)} computed; "
                             f"a stage that splits its backward must compute them for "
                             f"{sorted(range(num_microbatches))}")
    if sends != recvs:
        unmatched = sorted(set(sends.items()) ^ set(recvs.items()))
        raise ValueError(f"sends and receives do not match: {unmatched[:5]}")
