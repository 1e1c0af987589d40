"""The communicators a stage sums its gradients over: one per set of pipeline
positions sharing variables (normally one stage; tied weights join several)."""

__all__ = ["make_groups"]


def make_groups(comm, topo, part, stage, model_variables, per_replica=False):
    """One communicator per set of stages sharing variables (normally one stage):
    every rank joins each split, in the same sorted order. Returns
    {stage set: (communicator or None, positions in stage.trainable)}. With model
    chunks (`part` cut into more stages than the pipeline has ranks), the sets are
    of pipeline positions: virtual stage j is on position j % S. `per_replica`:
    replicas that step on their own (`hyparflow.replicas`) sum a tied variable's
    gradient over their own stages only."""
    s, t = topo.stage(comm.rank), topo.tensor(comm.rank)
    r = topo.replica(comm.rank)
    S = topo.num_stages
    users = {vid: tuple(sorted({u % S for u in us})) for vid, us in part.users.items()}
    index_of = {id(v): k for k, v in enumerate(stage.originals)}
    # Pack variables in the model's order, which every stage of a group shares.
    order = {id(v): k for k, v in enumerate(model_variables)}
    groups = {}
    for key in sorted(set(users.values())):
        # Tensor rank t of each stage sums with tensor rank t of the others only:
        # its split layers' parts are its own, and its unsplit weights' gradients
        # are the same on every tensor rank.
        color = (r * topo.num_tensor + t if per_replica else t) if s in key else None
        sub = comm.split(color, comm.rank) if topo.size > 1 else None
        if color is None:
            continue
        positions = sorted((index_of[vid] for vid, who in users.items()
                            if who == key and vid in index_of),
                           key=lambda k: order[id(stage.originals[k])])
        groups[key] = (sub, positions)
    return groups
