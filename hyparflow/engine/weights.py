"""Moving Keras variables between ranks: start equal, average state, gather to all."""

import numpy as np

from ..flat import pack, unpack

__all__ = ["pack", "unpack", "broadcast", "average", "gather"]


def _by_dtype(variables):
    groups = {}
    for v in variables:
        groups.setdefault(str(v.dtype), []).append(v)
    return sorted(groups.items())


def _assign(variables, values):
    for v, a in zip(variables, values):
        v.assign(a)


def broadcast(comm, variables, root):
    """Every rank's `variables` take the values of rank `root`'s."""
    for dtype, group in _by_dtype(variables):
        flat = pack([v.numpy() for v in group], group[0].numpy().dtype)
        comm.bcast(flat, root)
        _assign(group, unpack(flat, group))


def average(comm, variables):
    """Floating `variables` become their mean over `comm`'s ranks (others stay)."""
    floats = [v for v in variables if np.dtype(v.numpy().dtype).kind == "f"]
    if comm is None or comm.size == 1 or not floats:
        return
    flat = pack([v.numpy() for v in floats], np.float64)
    comm.allreduce(flat)
    flat /= comm.size
    _assign(floats, unpack(flat, floats))


def gather(comm, variables, owner_rank):
    """Each variable takes the value held by `owner_rank[i]`, on every rank.

    One broadcast per owning rank (of all the variables it owns), so the cost
    is S broadcasts, not one per variable.
    """
    owners = sorted(set(owner_rank))
    for root in owners:
        mine = [v for v, o in zip(variables, owner_rank) if o == root]
        broadcast(comm, mine, root)
