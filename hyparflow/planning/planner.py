"""The planner's search: predict a plan's step time and memory, and rank every plan
(stages, replicas, microbatches, schedule, balance) by the cost model with an
alpha-beta network. The `hyparflow plan` command that measures and prints is
`command`'s.

Cost model, per plan (S stages, R replicas, M microbatches of m = B / (R M) samples):

- compute: each layer call's forward+backward time is affine in its batch, fitted
  from profiles at the plans' smallest and largest microbatch, scaled to the model's
  compiled step; a stage's microbatch takes the sum over its calls, times what a
  stage that keeps a tape pays (`measure.stage_costs`: its forward's share, gradient
  sums); on one node, scaled to one rank's own measured speed (`measure.compute`);
- pipeline: the schedule is played by `schedule.simulate` with those per-stage times,
  each message adding alpha + bytes * beta on the sending stage and, on one node, the
  measured wait of a receiver until it has the message; with measured compute, every
  computing stage is slowed by how many ranks compute at that moment;
- gradients: a ring allreduce over the R replicas, 2 (R-1)/R * bytes * beta +
  2 (R-1) alpha (across nodes that hold 2 or more of them each, as the engine sums
  them: within the node, then a ring of the N nodes, 2 (N-1) rounds), then the
  optimizer step (measured per parameter byte), both played
  as each stage's tail after its last backward (on shared cores, taking cores from
  the stages still computing);
- memory per rank: the stage's weights and optimizer state plus the activations of
  the microbatches in flight (M with GPipe, S - s with 1F1B);
- tensor parallelism (T ranks per stage): a split layer's compute, weights and
  optimizer state are divided by T; each split call adds, per microbatch, an exchange
  between the T ranks forward and one backward ((T - 1) messages of its part, or of the
  whole output for a sum); when the plans run on this node, stages with split layers
  are instead timed whole under mpiexec, exchanges included (`measure.tensor_stages`);
- the 2D mesh (T = q x q, `tensor_mesh`): every layer of a mesh region (its Dense
  layers and the element-wise layers and LayerNormalizations they feed) computes on
  1/q^2 of its values; a Dense's kernel is 1/q^2 per rank, a LayerNormalization's
  scale 1/q; the region's outputs kept for the backward are 1/q^2 per rank (those
  gathered whole for a layer outside it, whole); each Dense moves
  `costmodel.summa_bytes` in q rounds forward and 4q backward (`summa_seconds`), and
  a region's edges gather or cut among all q^2 ranks. Mesh stages are costed by this
  model, not timed (`measure.tensor_stages` times 1D splits only).

alpha and beta are measured with MPI (a ping-pong between two ranks, and on one
node every ring size with all the plan's ranks running: `measure.rings`) or given
(`--latency`, `--bandwidth`), which also projects a plan onto a cluster this machine
is not (`--nodes`, `--ranks-per-node`).
"""

import functools
from dataclasses import replace

from .costmodel import (Across, Compute, Network, Row, crosses, interpolate, summa_seconds,
                        tensor_spans, work_and_wait)
from ..layout import Layout, resolve
from ..schedules import CHUNKED, PLANNED

__all__ = ["Network", "Compute", "Row", "predict", "search", "interpolate", "as_layout",
           "fuses", "tensor_costs", "mesh_costs"]

def fuses(s, stages, schedule, micro=2, chunks=1):
    """Whether stage `s` runs forward and backward in one call: where the schedule
    says so (`schedule.fuse`, which the executor reads too: the last stage under
    1F1B, or GPipe with one microbatch, or a stage alone). With `chunks`, `stages`
    and `s` count virtual stages (s on rank s % S, its chunk s // S)."""
    return _fusing(stages, schedule, micro, chunks)[s]


@functools.lru_cache(maxsize=256)
def _fusing(stages, schedule, micro, chunks):
    """`fuses` for every stage, from one play of the program: asked stage by stage,
    a search at a thousand stages built the program a million times."""
    from .. import schedules as sched

    ranks = stages // chunks
    dests = [[k + 1] if k < stages - 1 else [] for k in range(stages)]
    lists = sched.program(schedule, ranks, micro, dests, chunks)
    fused = {(s % ranks, a.chunk) for s in range(ranks) for a in lists[s] if a.kind == sched.FB}
    return tuple((s % ranks, s // ranks) in fused for s in range(stages))


def _weights_share(graph, rows, nodes, m):
    """(share of the stage's backward that its deferred kernels' weight gradients
    take, a function k -> time of k microbatches' W over one microbatch's): by the
    layers' profiles, a Dense call's backward being two products of its forward's
    size, one of them the weight gradient's; the profile's fixed cost per call is
    paid once by a batched W."""
    from ..engine import kernels

    deferred = [i for i, _ in kernels.deferred_nodes(graph, nodes)]
    whole = sum(rows[i][0] + rows[i][1] * m for i in nodes)
    mine = sum(rows[i][0] + rows[i][1] * m for i in deferred) / 3
    one = max(mine, 1e-30)
    share = min(mine / max(2 * whole / 3, 1e-30), 1.0)
    return share, lambda k: sum(rows[i][0] + rows[i][1] * m * k for i in deferred) / 3 / one


def _thirds(*pairs):
    """(forward, backward) pairs of one fused call, split a third forward as the
    profiles have it."""
    return [t for f, b in pairs for t in ((f + b) / 3, 2 * (f + b) / 3)]


def _elements(graph, t):
    from ..graph import numel

    return numel(graph.tensors[t].shape)


def tensor_costs(graph, num_tensor, m, network, across=False, layers=None):
    """{node: (compute divisor, forward exchange s, backward exchange s)} of the calls
    `num_tensor` ranks would split (`layers`: those named, else the default choice:
    by size); `across`: the tensor ranks of a stage span hosts."""
    from ..kinds import tensor as T

    if num_tensor == 1:
        return {}
    out = {}
    network = Across(network) if across else network
    for i, split in T.choose(graph, range(len(graph.nodes)), num_tensor, layers).items():
        node = graph.nodes[i]
        out_bytes, in_bytes = (4 * m * _elements(graph, t) for t in (node.outputs[0], node.inputs[0]))
        out[i] = (num_tensor, *T.exchange(split, out_bytes, in_bytes, num_tensor, network,
                                              op=node.op))
    return out


def mesh_costs(graph, q, m, network, across=False):
    """({node: (compute divisor, forward exchange s, backward exchange s)},
    {node: divisor of its weights and optimizer state}, {node: divisor of its output
    kept for the backward}) of the calls a q x q mesh would run (the default choice,
    `kinds.mesh.choose`: Dense, EinsumDense, attention and Embedding layers by size, and
    the element-wise layers and LayerNormalizations the region feeds). Each kind says
    what it exchanges (`MeshKind.products`: its SUMMA products, `sums`: the rest)."""
    from ..kinds import mesh as K

    network = Across(network) if across else network
    region = K.choose(graph, range(len(graph.nodes)), q * q)
    producers = {t: n.index for n in graph.nodes for t in n.outputs}
    costs, weights, kept = {}, {}, {}
    for i, split in region.items():
        node = graph.nodes[i]
        in_bytes, out_bytes = (4 * m * _elements(graph, t)
                               for t in (node.inputs[0], node.outputs[0]))
        kind = K.BY_NAME[split.kind]
        forward = backward = 0.0
        for x, w in kind.products(in_bytes, 4 * node.params):
            f, b = summa_seconds(q, x, w, network)
            forward, backward = forward + f, backward + b
        shape = graph.tensors[node.outputs[0]].shape
        tokens = m * _elements(graph, node.outputs[0]) / max(1, int(shape[-1] or 1))
        ahead, back = kind.sums(tokens, out_bytes, q)
        forward += sum(network.exchange(b, q) for b in ahead)
        backward += sum(network.exchange(b, q) for b in back)
        if node.params:
            weights[i] = q ** kind.share
        if split.gather:  # its blocks gathered whole for a layer outside the region
            forward += network.exchange(out_bytes / (q * q), q * q)
        else:
            kept[i] = q * q
        if any(producers.get(t) not in region for t in node.inputs):
            # A whole value entering the region: cut; its gradient gathered whole.
            backward += network.exchange(in_bytes / (q * q), q * q)
        costs[i] = (q * q, forward, backward)
    return costs, weights, kept


def predict(graph, rows, opt_per_byte, network, counts, batch, replicas, micro, schedule,
            ranks_per_node=None, cores=None, num_tensor=1, compute=None, stage_costs=None,
            stage_timer=None, chunks=1, tensor_mesh=None, tensor_layers=None):
    """Predicted step time and its parts, and peak memory per stage, for one plan.
    `tensor_layers`: the layers split over `num_tensor` ranks (None: the default
    choice, by size; `search.layers` names them per layer).

    `chunks` (interleaved schedules): `counts` cut S x chunks virtual stages, virtual
    stage j on rank j % S; the play runs each rank's chunks one action at a time,
    and memory and allreduce are per rank (all its chunks).

    `compute`: the model's step measured with this plan's ranks running (`Compute`):
    the rows are scaled to one rank's measured speed and the schedule is played with
    ranks slowing each other while they compute at once. Without it (a cluster this
    machine is not), `cores` per node: when a node runs more ranks than it has
    cores, every computation takes that many times longer. `stage_costs`
    (`measure.stage_costs`): what a stage pays besides its layers, for running its
    backward from a tape and for summing gradients every microbatch. `stage_timer`
    (`measure.StageTimer`): the stages of a pipeline without split layers timed
    whole, in place of their calls' profiles and `stage_costs`. `tensor_mesh` (q, q):
    the T = q * q tensor ranks as a 2D mesh (`mesh_costs`)."""
    rows = [Row(*r) for r in rows]
    from .. import schedules as sched
    from ..engine.partition import partition

    stages = len(counts)  # virtual stages with chunks
    ranks = stages // chunks  # pipeline positions S
    part = partition(graph, stages, counts)
    m = batch / (replicas * micro)
    on_node = ranks_per_node or ranks * replicas * num_tensor
    share = max(1.0, on_node / cores) if cores else 1.0
    slowdown, opt_rate = None, share * opt_per_byte
    if compute is not None:
        share = compute.alone(m) / max(sum(r.seconds(m) for r in rows), 1e-12)
        slowdown = compute.slowdown(m)
        opt_rate = compute.optimizer if compute.optimizer is not None else opt_per_byte
    starts = [sum(counts[:s]) for s in range(stages)]
    spans = tensor_spans(num_tensor, ranks_per_node)
    if tensor_mesh:
        split, weight_div, kept_div = mesh_costs(graph, tensor_mesh[0], m, network, spans)
    else:
        split = tensor_costs(graph, num_tensor, m, network, across=spans, layers=tensor_layers)
        weight_div, kept_div = {i: d for i, (d, _, _) in split.items()}, {}
    if slowdown is not None:
        # The exchanges were timed with every rank of the node running (`measure.rings`),
        # and the shared play slows whatever a stage does by how many ranks compute at
        # once: their work alone is that time over the slowdown of all of them.
        split = {i: (d, f / slowdown(on_node), b / slowdown(on_node))
                 for i, (d, f, b) in split.items()}
    div = lambda i: split[i][0] if i in split else 1  # noqa: E731
    work = [share * sum(rows[i].seconds(m) / div(i) for i in range(a, a + c))
            for a, c in zip(starts, counts)]
    exchange_f = [sum(split[i][1] for i in range(a, a + c) if i in split)
                  for a, c in zip(starts, counts)]
    exchange_b = [sum(split[i][2] for i in range(a, a + c) if i in split)
                  for a, c in zip(starts, counts)]
    send = [0.0] * stages
    transfer = {}  # (kind, source, destination) -> seconds on the link between hosts
    for e in part.edges:
        nbytes = _elements(graph, e.tensor) * 4 * m
        # Hosts are filled in rank order (rank = (replica * S + stage) * T + tensor): a
        # pipeline longer than a host's ranks sends some boundaries over the slower
        # link between hosts. The network moves those while both stages compute
        # (non-blocking sends): the sender pays the latency, the message arrives
        # after the link carried it, each way ("act" forward, "grad" back).
        if crosses(e.src % ranks, e.dst % ranks, ranks, replicas, num_tensor, ranks_per_node):
            moving = network.message(nbytes, across=True)
            send[e.src] += network.alpha_inter
            for key in (("act", e.src, e.dst), ("grad", e.dst, e.src)):
                transfer[key] = transfer.get(key, 0.0) + moving
        else:  # a copy through shared memory: the stage's own core does it
            send[e.src] += network.message(nbytes)
    wdiv = lambda i: weight_div.get(i, 1)  # noqa: E731
    kdiv = lambda i: kept_div.get(i, 1)  # noqa: E731
    params = [sum(rows[i].param_bytes / wdiv(i) for i in range(a, a + c))
              for a, c in zip(starts, counts)]
    forward = [c / 3 for c in work]
    backward = [2 * c / 3 for c in work]
    waits = [(0.0, 0.0)] * stages
    if (stage_timer is not None and num_tensor > 1 and not tensor_mesh
            and getattr(stage_timer, "splits", False)):
        # Stages with split layers, timed (exchanges included) with every rank of the
        # node running them and with only their own tensor ranks running. Compute
        # slows with the ranks computing at once; the waits for peers inside the
        # exchanges do not. Of a time `every` with all the ranks busy and `one` with
        # T of them: work * slowdown(busy) + wait, fitted through both.
        for s in range(stages):
            fused = fuses(s, stages, schedule, micro, chunks)
            f, b, f1, b1 = stage_timer(counts, s, m, fused, num_tensor)
            if fused:
                f, b, f1, b1 = _thirds((f, b), (f1, b1))
            parts = [work_and_wait(every, one, slowdown, on_node, num_tensor)
                     for every, one in ((f, f1), (b, b1))]
            (forward[s], wait_f), (backward[s], wait_b) = parts
            waits[s] = (wait_f, wait_b)
            exchange_f[s] = exchange_b[s] = 0.0
    elif stage_timer is not None and num_tensor == 1:
        for s in range(stages):
            fused = fuses(s, stages, schedule, micro, chunks)
            f, b = stage_timer(counts, s, m, fused)
            if fused:
                f, b = _thirds((f, b))
            forward[s], backward[s] = share * f, share * b
    elif stage_costs:
        at = lambda key: interpolate(stage_costs["batches"], stage_costs[key], m)  # noqa: E731
        for s in range(stages):
            if not fuses(s, stages, schedule, micro, chunks):
                whole = work[s] * at("taped")  # the summing of gradients included
                forward[s], backward[s] = whole * at("forward"), whole * (1 - at("forward"))
            else:
                backward[s] += share * params[s] * stage_costs["add_s_per_byte"]
    weight = [0.0] * stages
    batched = [lambda k: float(k)] * stages
    if sched.TABLE[schedule].split:
        # B leaves the deferred kernels' weight gradients to W: its share of the backward.
        for s, (a, c) in enumerate(zip(starts, counts)):
            nodes = [i for i in range(a, a + c) if i not in split]
            part_w, batched[s] = _weights_share(graph, rows, nodes, m)
            weight[s], backward[s] = backward[s] * part_w, backward[s] * (1 - part_w)
    per_stage_f = [c + s + x for c, s, x in zip(forward, send, exchange_f)]
    per_stage_b = [c + s + x for c, s, x in zip(backward, send, exchange_b)]
    dests = [p.dests for p in part.stages]
    # The step program the executor runs (`schedules.program`).
    lowered = sched.lower(sched.program(schedule, ranks, micro, dests, chunks),
                          [p.sources for p in part.stages], dests)
    across = ranks_per_node is not None and ranks_per_node < ranks * replicas * num_tensor
    # A replica is S x T consecutive ranks: a node holds this many of each sum's ranks.
    per_node = max(1, (ranks_per_node or 1) // (ranks * num_tensor))
    # A rank's chunks share one allreduce and one optimizer step.
    rank_params = [sum(params[j] for j in range(r, stages, ranks)) for r in range(ranks)]
    sums = [network.allreduce(p, replicas, across, per_node) for p in rank_params]
    reduce = [s + p * opt_rate for s, p in zip(sums, rank_params)]
    # Each stage's allreduce and optimizer step follow its own last backward, while
    # earlier stages still compute. On shared cores they take cores like any work:
    # both were measured with every rank of the node doing them at once, so their
    # work alone is that time over the slowdown of all the ranks computing.
    tail = reduce if slowdown is None else [r / slowdown(on_node) for r in reduce]
    sim = sched.simulate(lowered, per_stage_f, per_stage_b, slowdown, replicas * num_tensor,
                         network.wait, tail, waits,
                         weight_time=lambda s, k: weight[s] * batched[s](k), transfer=transfer)
    step = sim.finish
    memory = []
    if chunks > 1:
        # Per rank: its chunks' weights and state, and at the play's peak that many
        # chunk-microbatches of activations (of its chunks' mean size).
        for r in range(ranks):
            mine = [i for j in range(r, stages, ranks) for i in range(starts[j],
                                                                     starts[j] + counts[j])]
            state = sum(rows[i].param_bytes + rows[i].optimizer_bytes for i in mine)
            acts = sum(rows[i].activation_bytes for i in mine) / chunks
            memory.append(state + acts * m * sim.peak_activations[r])
    for s, (a, c) in enumerate(zip(starts, counts) if chunks == 1 else ()):
        # Microbatches of activations alive at once: the played program's peak (M with
        # GPipe, S - s with 1F1B, whatever a new schedule keeps).
        in_flight = sim.peak_activations[s]
        memory.append(sum((rows[i].param_bytes + rows[i].optimizer_bytes) / wdiv(i)
                          for i in range(a, a + c)) +
                      sum(rows[i].activation_bytes / kdiv(i) for i in range(a, a + c))
                      * m * in_flight)
        if sched.TABLE[schedule].split:
            # Kept for W: each deferred call's input and output gradient, per microbatch.
            from ..engine import kernels
            kept = sum(4 * (_elements(graph, graph.nodes[i].inputs[0])
                            + _elements(graph, graph.nodes[i].outputs[0]))
                       for i, _ in kernels.deferred_nodes(graph, range(a, a + c)))
            memory[-1] += kept * m * sim.peak_kept[s]
    return {"step_s": step, "pipeline_s": sim.makespan, "bubble": sim.bubble,
            "comm_s": (max(s + f + b for s, f, b in zip(send, exchange_f, exchange_b))
                       + max(transfer.values(), default=0.0)) * micro
            + max(sums),
            "tensor_layers": sorted(graph.nodes[i].op.name for i in split
                                    if not tensor_mesh or weight_div.get(i) == num_tensor),
            "memory_bytes": memory, "samples_s": batch / step}


def search(graph, rows, opt_per_byte, network, batch, ranks, memory_limit=None,
           microbatches=(1, 2, 4, 8, 16), schedules=PLANNED,
           ranks_per_node=None,
           cores=None, tensor=(1, 2, 4, 9), compute=None, stage_costs=None, stage_timer=None,
           chunks=(2,), meshes=True):
    """Every plan for `ranks` ranks, predicted, best first (plans over the memory
    limit last). `tensor`: the numbers of tensor ranks per stage to try (only those
    that split some layer); with `meshes`, each T = q x q (4, 9) also as a q x q
    mesh (2D, `tensor_mesh`) where some layer can run on it. `chunks`: model chunks
    per rank tried where `schedules` has "interleaved" (S > 1, T = 1, M a multiple
    of S, enough layer calls)."""
    from .. import balance as B
    from ..kinds import mesh as K
    from ..kinds import tensor as T

    shapes = []
    everything = range(len(graph.nodes))
    for t in tensor:
        q = int(round(t ** 0.5))
        layouts = [None] if t == 1 or T.choose(graph, everything, t) else []
        if meshes and q > 1 and q * q == t and K.choose(graph, everything, t):
            layouts.append((q, q))
        if ranks % t == 0:
            shapes += [(s, t, mesh) for s in range(1, ranks // t + 1) for mesh in layouts
                       if (ranks // t) % s == 0 and s <= len(graph.nodes)]
    candidates = []
    for stages, num_tensor, mesh in shapes:
        for micro in microbatches:
            shape = resolve(ranks, num_stages=stages, num_tensor=num_tensor,
                            num_microbatches=micro, tensor_mesh=mesh, environ={})
            if batch < shape.num_replicas * micro:
                continue
            m = batch / (shape.num_replicas * micro)
            counts = B.solve([Row(*r).seconds(m) for r in rows], stages)
            candidates += [replace(shape, schedule=schedule, balance=tuple(counts))
                           for schedule in (schedules if stages > 1 else ("1f1b",))
                           if schedule not in CHUNKED]
            if stages > 1 and num_tensor == 1 and micro % stages == 0:  # never a mesh
                candidates += [
                    replace(shape, schedule=schedule, num_chunks=v, balance=tuple(
                        B.solve([Row(*r).seconds(m) for r in rows], stages * v)))
                    for schedule in schedules if schedule in CHUNKED
                    for v in chunks if v > 1 and stages * v <= len(graph.nodes)]
    if stage_timer is not None:
        # Every stage the plans time, timed together: those with split layers in one
        # run under mpiexec, the others in passes over all of them.
        splits = getattr(stage_timer, "splits", False)
        stage_timer.prepare([(list(c.balance), s,
                              fuses(s, len(c.balance), c.schedule, c.num_microbatches,
                                    c.num_chunks),
                              c.num_tensor)
                             for c in candidates
                             if c.num_tensor == 1 or (splits and not c.tensor_mesh)
                             for s in range(len(c.balance))])
    plans = []
    for c in candidates:
        p = predict(graph, rows, opt_per_byte, network, list(c.balance), batch, c.num_replicas,
                    c.num_microbatches, c.schedule, ranks_per_node, cores, c.num_tensor,
                    compute, stage_costs, stage_timer, c.num_chunks, c.tensor_mesh)
        p.update(stages=c.num_stages, tensor=c.num_tensor, replicas=c.num_replicas,
                 tensor_mesh=list(c.tensor_mesh) if c.tensor_mesh else None,
                 microbatches=c.num_microbatches, schedule=c.schedule, counts=list(c.balance),
                 chunks=c.num_chunks,
                 fits=memory_limit is None or max(p["memory_bytes"]) <= memory_limit)

        plans.append(p)
    return sorted(plans, key=lambda p: (not p["fits"], p["step_s"]))


def as_layout(plan):
    """The `Layout` of one of `search`'s plans."""
    return Layout(num_stages=plan["stages"], num_replicas=plan["replicas"],
                  num_microbatches=plan["microbatches"], num_tensor=plan["tensor"],
                  schedule=plan["schedule"], num_chunks=plan.get("chunks", 1),
                  balance=tuple(plan["counts"]),
                  tensor_mesh=tuple(plan["tensor_mesh"]) if plan.get("tensor_mesh") else None,
                  tensor_layers=tuple(plan["tensor_layers"]) if plan.get("tensor_layers")
                  else None)
