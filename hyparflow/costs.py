"""Per-layer-call costs for a balance mode, and stage speeds, agreed by every rank."""

from . import profile as _profile
from .topology import Topology

__all__ = ["MODES", "resolve"]

MODES = ("estimate", "params", "time", "memory")


def resolve(graph, model, comm, balance, layout, *, speeds=None, memory_limit=None,
            microbatch=32):
    """Turn `balance` (None, a mode, or counts) and `speeds` (None, "measure" or one
    number per stage) into what `partition` takes. Collective: profiling and
    calibration run on this machine's ranks and their results are shared, so every
    rank cuts the model the same way. `layout`: the run's (hyparflow.layout.Layout)."""
    num_stages = layout.num_stages
    chunks = getattr(layout, "num_chunks", 1)
    if chunks > 1 and memory_limit is not None:
        raise NotImplementedError(
            f"memory_limit={memory_limit} with schedule='interleaved' is not supported yet (the "
            f"limit is per rank, which holds {chunks} chunks). Leave memory_limit out, or "
            "use schedule='1f1b'.")
    if balance is not None and not isinstance(balance, str) and speeds is None and memory_limit is None:
        return balance  # explicit counts
    mode = balance or "estimate"
    if mode not in MODES:
        raise ValueError(f"`balance` must be one of {MODES}, None or a list of counts. "
                         f"Received: balance={balance!r}")
    profiles = None
    if mode in ("time", "memory") or memory_limit is not None:
        profiles = comm.bcast_obj(_profile.profile(graph, model, batch=microbatch)
                                  if comm.rank == 0 else None, 0)
    if mode == "estimate":
        costs = [n.cost for n in graph.nodes]
    elif mode == "params":
        costs = [max(n.params, 1) for n in graph.nodes]  # weightless calls still count a little
    elif mode == "time":
        costs = [p.seconds for p in profiles]
    else:
        costs = [_memory(p, microbatch, num_stages) for p in profiles]
    if speeds == "measure":
        rates = comm.allgather_obj(_profile.calibrate())
        # A stage is as fast as its slowest rank (its T tensor ranks share the work).
        topo = _topology(layout)
        speeds = [min(rate for r, rate in enumerate(rates) if topo.stage(r) == s)
                  for s in range(num_stages)]
    elif speeds is not None and len(speeds) != num_stages:
        raise ValueError(f"`speeds` needs one value per stage ({num_stages}). Received: {speeds}")
    memory = [_memory(p, microbatch, num_stages) for p in profiles] if memory_limit else None
    if speeds is not None and chunks > 1:
        speeds = [speeds[j % num_stages] for j in range(num_stages * chunks)]  # per chunk
    return {"costs": costs, "speeds": list(speeds) if speeds is not None else None,
            "memory": memory, "limit": memory_limit}


def measured_shares(comm, layout):
    """tensor_shares="measure": each rank's calibrated speed, shared by all; a tensor
    rank's share is its speed (the slowest over replicas, whose parts must match),
    per stage. Returns this rank's stage's shares (collective)."""
    rates = comm.allgather_obj(_profile.calibrate())
    topo = _topology(layout)
    stage = topo.stage(comm.rank)
    return [min(rates[r] for r in topo.stage_ranks(stage, t)) for t in range(layout.num_tensor)]


def _topology(layout):
    return Topology(layout.num_stages, layout.num_replicas, layout.num_tensor)


def _memory(p, microbatch, num_stages):
    """Bytes a layer call holds on its rank: weights, optimizer state, and the
    activations of the microbatches in flight (at most S with 1F1B)."""
    return p.param_bytes + p.optimizer_bytes + p.activation_bytes * microbatch * num_stages
